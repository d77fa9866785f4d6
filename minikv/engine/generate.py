"""Autoregressive decoding, naive and cached.
naive:  every step feeds the WHOLE sequence again, recomputing every position's K/V (seed 003).
cached: one prefill over the prompt fills the KV cache; each decode step then feeds ONE token.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .cache import KVCache
from .records import GenerationOutput, KVCounter, Stats, TraceEvent
from .sampling import SamplingParams
from .validate import fits, int_at_least, token_ids


def generate(model, ids, max_new_tokens: int, mode: str = "cached", temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | None = None, *,
             cache: KVCache | None = None, trace: bool = False, return_logits: bool = False,
             position_offset_bug: bool = False) -> GenerationOutput:
    """Generate up to `max_new_tokens` after `ids`, stopping after `eos_id`; greedy when the
    temperature is 0, else sampled from a generator seeded with `seed`. In cached mode a `cache`
    passed in is continued and extended in place (`fork()` it to keep it). `position_offset_bug`
    reproduces seed 003's wrong approach: positions restart at 0 every step."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    prompt = token_ids(ids, model.config.vocab_size)
    _check_call(model, max_new_tokens, mode, sp, cache, position_offset_bug)
    past = 0 if cache is None else cache.get_seq_length()
    # The last new token is returned, never fed back, so the model sees at most this many.
    needed = past + len(prompt) + max_new_tokens - 1
    fits(needed, model.config.block_size, f"{past} cached + {len(prompt)} prompt + "
         f"{max_new_tokens} new tokens", "max_new_tokens or shorten the prompt")
    if cache is not None and cache.max_len is not None and needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions but this call needs "
                         f"{needed}; pass a larger cache or lower max_new_tokens")
    if mode == "cached" and cache is None and max_new_tokens > 0:
        cache = KVCache.for_model(model, batch_size=1, max_len=needed)
    device = model.device
    generator = torch.Generator(device=device).manual_seed(sp.seed)
    stats = Stats(prompt_len=len(prompt))
    events: list[TraceEvent] = []
    step_logits: list[torch.Tensor] = []
    sequence = list(prompt)
    # A failure or Ctrl-C mid-way crops a caller's cache back: a retry never feeds a token twice.
    with (torch.inference_mode(), KVCounter(model) as counter,
          cache.restored_on_error() if cache is not None else nullcontext()):
        for step in range(max_new_tokens):
            # 1. What to feed: naive feeds everything again; cached feeds the prompt once
            #    (prefill), then only the newest token (decode).
            if mode == "naive":
                inputs, past = list(sequence), 0
            else:
                inputs, past = (prompt if step == 0 else sequence[-1:]), cache.get_seq_length()
            first = 0 if position_offset_bug else past  # the bug: positions restart at 0
            positions = list(range(first, first + len(inputs)))
            # 2. One forward pass; with a cache, positions continue where the cache ends.
            kv_before = counter.count
            logits = model(torch.tensor([inputs], device=device), cache=cache, last_only=True,
                           positions=torch.tensor(positions, device=device)
                           if position_offset_bug else None)[0, -1]  # (vocab,)
            # 3. Pick the next token from the last position's logits.
            token = int(sp.sample(logits, generator))
            sequence.append(token)
            # 4. Record the pass.
            stats.forward_passes += 1
            stats.positions_processed += len(inputs)
            if return_logits:
                step_logits.append(logits.float().clone())
            if trace:
                kind = "recompute" if mode == "naive" else "prefill" if step == 0 else "decode"
                events.append(TraceEvent(
                    kind=kind, step=step, input_ids=tuple(inputs), positions=tuple(positions),
                    cache_len_before=past, cache_len_after=cache.get_seq_length() if cache else 0,
                    kv_computed=counter.count - kv_before, token=token))
            if token == sp.eos_id:
                break
    stats.new_tokens = len(sequence) - len(prompt)
    stats.kv_computed = counter.count
    return GenerationOutput(prompt=prompt, tokens=sequence[len(prompt):], stats=stats,
                            trace=events if trace else None,
                            logits=torch.stack(step_logits) if step_logits else None)


def _check_call(model, max_new_tokens, mode, sp, cache, position_offset_bug) -> None:
    int_at_least("max_new_tokens", max_new_tokens, 0)
    if mode not in ("naive", "cached"):
        raise ValueError(f"unknown mode {mode!r}; choose one of ('naive', 'cached')")
    sp.check_vocab(model.config.vocab_size)
    if mode == "naive" and (cache is not None or position_offset_bug):
        raise ValueError("cache= and position_offset_bug= only apply to mode='cached'")
