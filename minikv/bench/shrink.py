"""Caches that hold less (chapter 07) at long context: K/V bytes and decode tokens/s from a
968-token prompt up to 1,000 positions, 124M GPT-2 shapes, for the full fp32 cache, int8 and int4
codes, grouped- and multi-query attention, and sinks + a sliding window; every ratio against the
full cache in the same run."""
from __future__ import annotations

import torch

from ..engine import GPT, GPTConfig, KVCache, QuantizedKVCache, SinkWindowCache
from . import alternate


def variants(preset: str, device, dtype) -> dict[str, tuple[GPT, callable]]:
    """name -> (model, a function making its empty cache)."""
    def model(**overrides) -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig.preset(preset, **overrides)).to(device, dtype).eval()
    full = model()
    n_head = full.config.n_head
    return {
        "full cache": (full, lambda: KVCache.for_model(full)),
        "int8 codes": (full, lambda: QuantizedKVCache.for_model(full, bits=8)),
        "int4 codes": (full, lambda: QuantizedKVCache.for_model(full, bits=4)),
        f"GQA, 2 K/V heads of {n_head}": (gqa := model(n_kv_head=2),
                                          lambda: KVCache.for_model(gqa)),
        "MQA, 1 K/V head": (mqa := model(n_kv_head=1), lambda: KVCache.for_model(mqa)),
        "4 sinks + 252 window": (full, lambda: SinkWindowCache.for_model(full, 4, 252)),
    }


def bench_shrink(preset: str, context: int, n_tokens: int, repeats: int, device,
                 dtype=torch.float32) -> dict:
    """Prefill `context` tokens once per variant, then time `n_tokens` decode steps from that
    state (alternating variants, medians)."""
    block_size = GPTConfig.preset(preset).block_size
    if context + n_tokens > block_size:  # GPT-2 has no position embedding past block_size
        raise ValueError(f"context {context} + {n_tokens} decode steps > block_size {block_size} "
                         f"of {preset!r}: use a shorter context")
    prompt = torch.randint(1, 500, (1, context), generator=torch.Generator().manual_seed(0))
    prompt, runs, held = prompt.to(device), {}, {}
    with torch.inference_mode():
        for name, (model, make) in variants(preset, device, dtype).items():
            cache = make()
            model(prompt, cache=cache, last_only=True)
            held[name] = cache.nbytes

            def decode(model=model, cache=cache):
                state = cache.fork() if isinstance(cache, SinkWindowCache) else cache
                token = prompt[:, -1:]
                for _ in range(n_tokens):
                    token = model(token, cache=state, last_only=True)[:, -1].argmax(-1, True)
                if state is cache:
                    cache.crop(context)
            runs[name] = decode
        seconds = alternate(runs, repeats, device)
    full = "full cache"
    return {"context": context, "n_tokens": n_tokens, "preset": preset, "rows": {
        name: {"kv_bytes": held[name], "bytes_vs_full": held[name] / held[full],
               "tokens_per_s": n_tokens / seconds[name],
               "speed_vs_full": seconds[full] / seconds[name]} for name in runs}}
