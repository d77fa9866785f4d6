"""Static batching: prompts of different lengths decoded together, one pass per step.

The prompts are LEFT-padded to the longest, so every row's newest token sits in the same
last column and each step appends one column for all rows to one ordinary KVCache. Two
things make the padding invisible: explicit position ids (a row's real tokens start at
position 0, whatever its padding: with default positions they would start at its pad
length) and an attention mask (no query sees a pad key). Right padding would put the
rows' next tokens in different columns, each step writing a different slot per row, which
a one-length KVCache cannot hold.
"""
from __future__ import annotations

import torch

from .attention import padded_attention
from .cache import KVCache
from .records import GenerationOutput, Stats
from .sampling import SamplingParams
from .validate import check_room, int_at_least, prompt_of_call


def generate_batch(model, prompts, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, seed: int = 0, eos_id: int | None = None, *,
                   pad_id: int = 0) -> list[GenerationOutput]:
    """One output per prompt, in order, from one forward pass per step for all of them;
    greedy tokens equal each prompt's alone. A row past `eos_id` decodes on with the rest
    (rows do not mix), what it makes dropped."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    rows = _checked_rows(model, prompts, max_new_tokens, sp, pad_id)
    B, width = len(rows), max(len(r) for r in rows)
    device = model.device
    pad = torch.tensor([width - len(r) for r in rows], device=device)              # (B,)
    idx = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)  # (B, T)
    cache = KVCache.for_model(model, batch_size=B, max_len=width + max(max_new_tokens - 1, 0))
    generator = torch.Generator(device=device).manual_seed(sp.seed)
    new: list[list[int]] = [[] for _ in rows]
    done = [False] * B  # on the host: the step reads its tokens back once, and no more
    stats = [Stats(prompt_len=len(r)) for r in rows]
    with torch.inference_mode():
        for step in range(max_new_tokens):
            # 1. Positions: each row counts from its first real token; padding shifts
            #    none.
            past = cache.get_seq_length()
            columns = past + torch.arange(idx.shape[1], device=device)                  # (T,)
            positions = (columns - pad.view(-1, 1)).clamp(min=0)                         # (B, T)
            # 2. One pass for the whole batch; the mask hides every row's padding.
            logits = model(idx, cache=cache, positions=positions, last_only=True,
                           attention=lambda q, k, v: padded_attention(q, k, v, pad))[:, -1]
            # 3. One token per row, read back once; a finished row's are dropped.
            tokens = sp.sample(logits, generator)                                       # (B,)
            for b, t in enumerate(tokens.tolist()):
                if not done[b]:
                    new[b].append(t)
                    stats[b].forward_passes += 1
                    stats[b].positions_processed += len(rows[b]) if step == 0 else 1
                    done[b] = t == eos_id
            if all(done):
                break
            idx = tokens.view(B, 1)
    for b, s in enumerate(stats):
        s.new_tokens = len(new[b])
        s.kv_computed = s.positions_processed  # each row's own positions (padding not counted)
    return [GenerationOutput(prompt=r, tokens=n, stats=s, trace=None, logits=None)
            for r, n, s in zip(rows, new, stats)]


def _checked_rows(model, prompts, max_new_tokens, sp, pad_id) -> list[list[int]]:
    """Each prompt as a list of ids, once the call is known to be right."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (lists of token ids), not "
                        f"{type(prompts).__name__}")
    rows = [prompt_of_call(model, p, max_new_tokens, sp) for p in prompts]
    if not rows:
        raise ValueError("no prompts to generate from")
    int_at_least("pad_id", pad_id, 0, " (a token id)", model.config.vocab_size)
    width = max(len(r) for r in rows)
    check_room(width + max_new_tokens - 1, model.config.block_size,
               f"the longest prompt ({width}) + {max_new_tokens} new tokens", "max_new_tokens")
    return rows
