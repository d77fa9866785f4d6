"""A decode step whose shapes never change, so torch.compile can trace it once (gpt-fast's
recipe; CUDA graphs need the same, issue 56).

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
"""
from __future__ import annotations

import torch

from .attention import sdpa
from .cache import Cache, zeros
from .sampling import SamplingParams
from .validate import check_room, int_at_least, prompt_of_call


class StaticCache(Cache):
    """`max_len` slots a layer, every one handed to attention each pass (module doc)."""

    def __init__(self, model, max_len: int):
        cfg = model.config
        if cfg.kv_lora_rank is not None:
            raise ValueError("a StaticCache holds keys and values per head; MLA's latent "
                             "decodes through a KVCache (generate)")
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
