"""Autoregressive decoding, naive and cached.
naive:  every step feeds the WHOLE sequence again, recomputing each position's K/V.
cached: one prefill over the prompt fills the KV cache; each decode step feeds ONE token.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .cache import KVCache, check_cache
from .records import GenerationOutput, KVCounter, Stats, TraceEvent
from .sampling import SamplingParams
from .validate import check_flags, check_room, one_of, prompt_of_call


def generate(model, ids, max_new_tokens: int, mode: str = "cached", temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | None = None, *,
             cache: KVCache | None = None, trace: bool = False,
             return_logits: bool = False) -> GenerationOutput:
    """Up to `max_new_tokens` after `ids`, stopping after `eos_id`; greedy at temperature
    0, else sampled with `seed`. A `cache` passed in is extended in place (`fork()` to
    keep it)."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    prompt = prompt_of_call(model, ids, max_new_tokens, sp)
    check_flags(trace=trace, return_logits=return_logits)
    needed = _check_call(model, prompt, max_new_tokens, mode, cache)
    if mode == "cached" and cache is None and max_new_tokens > 0:
        cache = KVCache.for_model(model, max_len=needed)
    device = model.device
    generator = torch.Generator(device=device).manual_seed(sp.seed)
    out = GenerationOutput(prompt, [], Stats(prompt_len=len(prompt)), [] if trace else None,
                           [] if return_logits else None)  # logits: a list until the end
    # A failure or Ctrl-C before the return crops the cache back; no other thread may use it.
    with (cache.restored_on_error() if cache is not None else nullcontext(),
          torch.inference_mode(), KVCounter(model) as counter):
        for step in range(max_new_tokens):
            # 1. What to feed: naive feeds everything again; cached, the prompt once
            #    (prefill) then only the newest token (decode).
            if mode == "naive":
                inputs, past = prompt + out.tokens, 0
            else:
                inputs, past = (prompt if step == 0 else out.tokens[-1:]), cache.get_seq_length()
            positions = list(range(past, past + len(inputs)))
            # 2. One forward pass; with a cache, positions continue where the cache ends.
            kv_before = counter.count
            logits = model(torch.tensor([inputs], device=device), cache=cache,
                           last_only=True)[0, -1]  # (vocab,)
            # 3. Pick the next token from the last position's logits.
            token = int(sp.sample(logits, generator))
            out.tokens.append(token)
            # 4. Record the pass.
            _record(out, mode, step, inputs, positions, past, cache, counter.count - kv_before,
                    token, logits)
            if token == sp.eos_id:
                break
        return _finish(out, counter.count)


def _record(out: GenerationOutput, mode, step, inputs, positions, past, cache, kv_computed,
            token, logits) -> None:
    """Count one pass; keep its logits and its trace event when asked for."""
    out.stats.forward_passes += 1
    out.stats.positions_processed += len(inputs)
    if out.logits is not None:
        out.logits.append(logits.float().clone())
    if out.trace is not None:
        kind = "recompute" if mode == "naive" else "prefill" if step == 0 else "decode"
        out.trace.append(TraceEvent(
            kind=kind, step=step, input_ids=tuple(inputs), positions=tuple(positions),
            cache_len_before=past, cache_len_after=cache.get_seq_length() if cache else 0,
            kv_computed=kv_computed, token=token))


def _finish(out: GenerationOutput, kv_computed: int) -> GenerationOutput:
    out.logits = torch.stack(out.logits) if out.logits else None
    out.stats.new_tokens = len(out.tokens)
    out.stats.kv_computed = kv_computed
    return out


def _check_call(model, prompt, max_new_tokens, mode, cache) -> int:
    """The positions the call needs: cached, prompt and new (the last new token is never
    fed back)."""
    one_of("mode", mode, ("naive", "cached"))
    check_cache(cache)
    if mode == "naive" and cache is not None:
        raise ValueError("cache= only applies to mode='cached'")
    past = 0 if cache is None else cache.get_seq_length()
    needed = past + len(prompt) + max_new_tokens - 1
    check_room(needed, model.config.block_size, f"{past} cached + {len(prompt)} prompt + "
               f"{max_new_tokens} new tokens", "max_new_tokens or shorten the prompt")
    if cache is not None:  # this model's, one row: refused now even if no pass would run
        cache.check_fits(model.config, 1, 0, model.device, model.dtype)
    if cache is not None and cache.max_len is not None and needed > cache.max_len:
        raise ValueError(f"needs {needed} positions, the cache {cache.max_len}: use a larger cache")
    return needed
