"""Decode steps whose shapes never change, so torch.compile can trace one once (gpt-fast's
recipe) and a CUDA graph can record one and replay it (nano-vllm's; issue 56).

A decode step of the course target takes several times its weight-read time on a CPU
(chapter 01's roofline): the step is a few hundred small operations, each dispatched on
its own. torch.compile traces a function into generated code, but a trace holds only
while the shapes it saw hold, and a KVCache hands attention past + 1 keys, one more every
step, so a compiled step over it is traced again and again. Here the three things that
change per step are held in tensors of fixed size instead:

- `StaticCache` keeps `max_len` slots a layer and hands attention ALL of them; a pass
  writes its keys and values at the positions it is given (a tensor, index_copy_);
- attention masks the slots past each query's position, instead of slicing them off;
- the positions come in as a tensor, not as a Python number read off the cache.

The model's own layers run unchanged (GPT.blocks); only the cache and the attention
differ. Greedy decoding only, one sequence, a model with keys and values per head (MLA's
latent has its own decode: not here).

The server's decode batch (serving.py) the same way, one CUDA graph a batch size
(`GraphDecode`): a graph replays the launches it recorded, on the buffers it recorded them
with, so every input of a pass lives in a buffer of fixed shape, copied in before a replay.
A batch of B rows runs in the graph of the smallest captured size >= B; the rows past B
repeat row 0 and their logits are dropped. Attention reads each row's whole table (as many
blocks as the longest sequence may fill) and masks the slots past its length: no shape, and
no host read, depends on the batch (the eager pass's split-KV sizes its splits to the batch,
and finds the blocks in use with a host read). On a CPU there is nothing to capture: the same
buffers run eagerly, so the padding and the tables are tested on every machine.
"""
from __future__ import annotations

import math

import torch

from .attention import sdpa
from .cache import Cache, zeros
from .sampling import SamplingParams
from .validate import check_model, check_room, int_at_least, prompt_of_call


def check_per_head(model, what: str) -> None:
    check_model("model", model)
    if model.config.kv_lora_rank is not None:
        raise ValueError(f"{what} holds keys and values per head; MLA's latent decodes "
                         "through a KVCache (generate) or the server's eager decode")


class StaticCache(Cache):
    """`max_len` slots a layer, every one handed to attention each pass (module doc)."""

    def __init__(self, model, max_len: int):
        check_per_head(model, "a StaticCache")
        cfg = model.config
        self.max_len = int_at_least("max_len", max_len, 1, " (no positions past block_size)",
                                    cfg.block_size + 1)
        heads, key_dim, value_dim = cfg.kv_shape
        shape = (1, heads, max_len)
        self.keys = zeros(cfg.kv_layers, (*shape, key_dim), model.device, model.dtype)
        self.values = zeros(cfg.kv_layers, (*shape, value_dim), model.device, model.dtype)
        self.length, self.positions = 0, None  # positions: where the pass under way writes

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's (1, nkv, T, hs) K/V at its positions; return every slot."""
        # KV-CACHE: written in place at the positions, read back whole (the mask hides the rest)
        self.keys[layer_idx].index_copy_(2, self.positions, key)
        self.values[layer_idx].index_copy_(2, self.positions, value)
        return self.keys[layer_idx], self.values[layer_idx]


def forward(model, cache: StaticCache, ids: torch.Tensor, positions: torch.Tensor):
    """Logits of the last of `ids` (1, T) at `positions` (T,): the pass over every slot,
    each query masked to the slots at or before its own position. Its shapes are those
    of its inputs only, so a decode step (T = 1) is traced once."""
    cache.positions = positions
    seen = torch.arange(cache.max_len, device=ids.device) <= positions[:, None]  # (T, max_len)
    x = model.blocks(ids, cache, positions, lambda q, k, v: sdpa(q, k, v, attn_mask=seen))
    return model.lm_head(x[0, -1])  # (vocab,)


def static_generate(model, ids: list[int], max_new_tokens: int, step=None) -> list[int]:
    """Greedy tokens after `ids`, as `generate` gives them, through a StaticCache: the
    prompt in one pass, then each token by `step` (default: `forward`, eager; pass
    `torch.compile(forward)` to compile it)."""
    ids = prompt_of_call(model, ids, max_new_tokens, SamplingParams(), least=1)
    check_room(len(ids) + max_new_tokens, model.config.block_size, "the prompt and its tokens",
               "max_new_tokens")
    device, step = model.device, step or forward
    cache = StaticCache(model, len(ids) + max_new_tokens)
    with torch.inference_mode():
        # 1. Prefill: the prompt's positions, written and attended in one pass (eager: its
        #    length is the prompt's, traced for nothing).
        logits = forward(model, cache, torch.tensor([ids], device=device),
                         torch.arange(len(ids), device=device))
        tokens, cache.length = [int(logits.argmax())], len(ids)
        for position in range(len(ids), len(ids) + max_new_tokens - 1):
            # 2. Decode: one token at one position, every shape as in the step before.
            logits = step(model, cache, torch.tensor([tokens[-1:]], device=device),
                          torch.tensor([position], device=device))
            # 3. Greedy: the largest logit.
            tokens.append(int(logits.argmax()))
            cache.length = position + 1
    return tokens


# --- the server's decode batch, one CUDA graph a batch size ------------------------------
class StaticBatch(Cache):
    """A decode batch of `size` rows over a BlockPool, each input in a buffer of fixed
    shape (module doc): row i feeds ids[i] at positions[i], writes its K/V at (block[i],
    slot[i]) and sees positions 0 .. positions[i] of its table, `width` blocks."""

    def __init__(self, pool, size: int, width: int):
        self.pool, device = pool, pool.keys[0].device
        # one buffer, a row per sequence: token, position, block, slot, real, table
        self.inputs = torch.zeros(size, 5 + width, dtype=torch.long, device=device)
        self.ids, self.positions = self.inputs[:, :1], self.inputs[:, 1:2]  # (B, 1) each
        self.block, self.slot = self.inputs[:, 2], self.inputs[:, 3]  # where the new K/V go
        self.tables = self.inputs[:, 5:]  # (B, width)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise ValueError("a StaticBatch's rows have positions of their own: GraphDecode "
                         "hands the pass its positions")

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's (B, nkv, 1, hs) K/V; return every row's table, read in order."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        # KV-CACHE: written at each row's (block, slot); a padding row writes row 0's own
        # K/V to row 0's slot (the same bits twice: whichever write lands, nothing changes)
        real = self.inputs[:, 4].bool().view(-1, 1, 1)  # (B, 1, 1): not a padding row
        keys[self.block, :, self.slot] = torch.where(real, key[:, :, 0], key[:1, :, 0])
        values[self.block, :, self.slot] = torch.where(real, value[:, :, 0], value[:1, :, 0])
        # (B, width) blocks -> (B, width, nkv, page, hs) -> (B, nkv, width x page, hs)
        return tuple(pool[self.tables].transpose(1, 2).flatten(2, 3) for pool in (keys, values))


def batch_forward(model, batch: StaticBatch) -> torch.Tensor:
    """Logits (B, vocab) of a StaticBatch's pass: what a CUDA graph records."""
    slots = batch.tables.size(1) * batch.pool.page_size
    lengths = batch.positions + 1  # (B, 1): the positions each row sees, its new one too
    seen = torch.arange(slots, device=lengths.device) < lengths  # (B, slots)
    x = model.blocks(batch.ids, batch, batch.positions,
                     lambda q, k, v: sdpa(q, k, v, attn_mask=seen[:, None, None]))
    return model.lm_head(x[:, -1])


class GraphDecode:
    """The server's decode pass as one CUDA graph a batch size in `sizes` (module doc):
    `Engine(graphs=sizes)` runs a decode batch through it when a captured size holds it.
    `capture` (default: on a CUDA model) records the graphs; without, each size's pass runs
    eagerly on the same buffers. Made on a fresh pool: capturing runs each pass once, and
    writes into block 0."""

    def __init__(self, model, pool, sizes: tuple = (1, 2, 4, 8, 16, 32, 64),
                 capture: bool | None = None):
        check_per_head(model, "a GraphDecode")
        if not (isinstance(sizes, tuple) and sizes and all(
                type(b) is int and b >= 1 for b in sizes) and list(sizes) == sorted(set(sizes))):
            raise ValueError(f"sizes must be a tuple of batch sizes, rising, e.g. (1, 2, 4, 8), "
                             f"not {sizes!r:.40}")
        if sizes[-1] > pool.num_blocks:  # every row holds a block: no larger batch can run
            raise ValueError(f"a batch of {sizes[-1]} rows needs as many blocks; the pool has "
                             f"{pool.num_blocks}: record sizes up to {pool.num_blocks}")
        self.model, self.pool, self.sizes = model, pool, sizes
        self.width = math.ceil(model.config.block_size / pool.page_size)  # blocks a row can fill
        self.batches = {b: StaticBatch(pool, b, self.width) for b in sizes}
        self.logits, self.graphs = {}, {}
        if model.device.type == "cuda" if capture is None else capture:
            self.capture()

    def capture(self) -> None:
        """Each size's pass recorded, the largest first (the smaller reuse its memory)."""
        memory = None
        with torch.inference_mode():
            for b in reversed(self.sizes):
                batch_forward(self.model, self.batches[b])  # warm-up: kernels chosen, loaded
                graph = self.graphs[b] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory):
                    self.logits[b] = batch_forward(self.model, self.batches[b])
                memory = graph.pool()
        torch.cuda.synchronize()

    def size_for(self, rows: int) -> int | None:
        """The smallest recorded size that holds `rows` rows (None: none does)."""
        return next((b for b in self.sizes if b >= rows), None)

    def fits(self, tables: list) -> bool:
        """Whether a captured size holds these rows (else: the eager pass)."""
        return self.size_for(len(tables)) is not None and all(
            len(t.blocks) <= self.width for t in tables)

    def __call__(self, tables: list, tokens: list[int]) -> torch.Tensor:
        """Logits (B, vocab) of tokens[i] fed at tables[i]'s next position (its room
        reserved), valid until the next call (a graph's output is its own buffer); each
        table's length moves on by one."""
        size, page = self.size_for(len(tables)), self.pool.page_size
        batch = self.batches[size]
        # 1. Every row's inputs in one host tensor, the rows past the batch copies of row 0.
        rows = [[token, t.length, t.blocks[t.length // page], t.length % page, 1,
                 *t.blocks, *[0] * (self.width - len(t.blocks))]
                for t, token in zip(tables, tokens)]
        pads = [rows[0][:4] + [0] + rows[0][5:]] * (size - len(rows))
        # 2. One copy in: a replay reads the same buffers the graph was recorded with.
        batch.inputs.copy_(torch.tensor(rows + pads), non_blocking=True)
        # 3. The pass: replayed, or run on the buffers (nothing captured).
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = batch_forward(self.model, batch)
        # 4. The new positions are live: a replay runs no Python, so the books move here.
        for t in tables:
            t.length += 1
        return logits[:len(rows)]
