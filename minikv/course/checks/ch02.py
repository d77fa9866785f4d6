"""Checkers for chapter 02 (seed 003, the KV-cache visual guide).

Each checker compares the learner's function with the engine itself: `kv_cache_bytes` and real
caches' `nbytes`, the K/V vectors `generate` counts with its hooks, the logits the model gives at
the positions it picks itself, and the engine's own attention kernel. Models here are tiny, random
and on the CPU, so every checker runs in well under a second and leaves the caller's random state
alone.
"""
from __future__ import annotations

import torch

from ...engine import GPT, GPTConfig, KVCache, causal_attention, generate, kv_cache_bytes
from . import call, expect, fail, passed

_MODELS: dict[str, GPT] = {}


def _tiny(name: str = "tiny", **overrides) -> GPT:
    """A small random GPT on the CPU, built once, without touching the caller's RNG."""
    key = f"{name}{sorted(overrides.items())}"
    if key not in _MODELS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _MODELS[key] = GPT(GPTConfig.preset(name, **overrides)).eval()
    return _MODELS[key]


# --- exercise 1: cache bytes ----------------------------------------------------------------------

def check_cache_bytes(cache_bytes) -> None:
    """cache_bytes(cfg, seq_len, batch_size, bytes_per_value, n_kv_head) against kv_cache_bytes and
    a real cache."""
    name = "cache_bytes"
    gpt2 = GPTConfig.preset("gpt2")
    # 8B-like shapes
    llama = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    dtypes = {2: torch.float16, 4: torch.float32, 1: torch.float8_e4m3fn}
    cases = [  # cfg, seq_len, batch_size, bytes_per_value, n_kv_head
        (gpt2, 100, 1, 2, None), (gpt2, 1024, 1, 2, None), (gpt2, 100, 4, 4, None),
        (gpt2, 0, 1, 2, None), (gpt2, 100, 1, 2, 4), (llama, 4096, 1, 2, 8),
        (llama, 4096, 8, 1, 8), (llama, 1, 1, 2, 1),
        (GPTConfig.preset("target"), 256, 2, 4, None),
    ]
    for cfg, seq_len, batch, nbytes, kv_heads in cases:
        case = (f"n_layer={cfg.n_layer}, n_head={cfg.n_head}, head_dim={cfg.head_dim}, "
                f"seq_len={seq_len}, batch_size={batch}, bytes_per_value={nbytes}, "
                f"n_kv_head={kv_heads}")
        want = kv_cache_bytes(cfg, seq_len, batch, dtypes[nbytes], n_kv_head=kv_heads)
        got = call(name, case, cache_bytes, cfg, seq_len, batch_size=batch,
                   bytes_per_value=nbytes, n_kv_head=kv_heads)
        hint = ("layers x 2 (K and V) x batch x KV heads x seq_len x head_dim x bytes per value; "
                "with grouped-query attention only n_kv_head heads are cached" if kv_heads else
                "layers x 2 (K and V) x batch x heads x seq_len x head_dim x bytes per value")
        expect(isinstance(got, int) and not isinstance(got, bool) and got == want, name, case,
               want, got, hint)
    # and what a real cache holds: the tiny model's cache after 37 positions, fp32
    model = _tiny()
    cache = KVCache.for_model(model, max_len=64)
    with torch.inference_mode():
        model(torch.arange(1, 38)[None], cache=cache)
    got = call(name, "the tiny model's real cache holding 37 positions (fp32)", cache_bytes,
               model.config, 37, batch_size=1, bytes_per_value=4, n_kv_head=None)
    expect(got == cache.nbytes, name, "the tiny model's real cache holding 37 positions (fp32)",
           cache.nbytes, got, "compare with KVCache.nbytes")
    passed(name, len(cases) + 1)


# --- exercise 2: K/V work with and without a cache ------------------------------------------------

def check_kv_work(kv_work) -> None:
    """kv_work(prompt_len, new_tokens) -> (naive, cached) K/V vectors per layer, against the
    engine's counters."""
    name = "kv_work"
    model = _tiny()
    cases = [(3, 5), (1, 4), (1, 1), (4, 0), (1, 10), (6, 3), (2, 12), (10, 1)]
    for p, n in cases:
        case = f"prompt_len={p}, new_tokens={n}"
        prompt = list(range(1, p + 1))
        want = (generate(model, prompt, n, mode="naive").stats.kv_computed,
                generate(model, prompt, n, mode="cached").stats.kv_computed)
        got = call(name, case, kv_work, p, n)
        try:
            got_pair = tuple(int(x) for x in got)
        except (TypeError, ValueError):
            fail(name, case, want, got, "return a pair (naive, cached) of ints")
        hint = ("naive: step i feeds the prompt plus the i tokens made so far; the last new token "
                "is never fed. cached: the prompt once, then one token per later step" if n else
                "no new tokens: no forward pass at all")
        expect(got_pair == want, name, case, want, got, hint)
    passed(name, len(cases))


# --- exercise 3: the position-offset bug, fixed ---------------------------------------------------

def _as_positions(got) -> list[int]:
    if isinstance(got, torch.Tensor):
        return [int(x) for x in got.flatten().tolist()]
    return [int(x) for x in got]


def check_decode_positions(decode_positions) -> None:
    """decode_positions(cache, n_new) -> the position ids of the next n_new tokens, judged by the
    model's logits."""
    name = "decode_positions"
    model = _tiny()
    # (cached length, new tokens); (0, n) is a prefill
    cases = [(3, 1), (0, 4), (7, 1), (12, 3), (20, 1)]
    n_cases = 0
    for length, n_new in cases + [("crop", 1)]:
        # capacity 40: size(2) of a buffer is NOT the length
        cache = KVCache.for_model(model, max_len=40)
        with torch.inference_mode():
            if length == "crop":
                model(torch.arange(1, 16)[None], cache=cache)
                cache.crop(9)  # a rollback: the next token goes to position 9, not 15
                length = 9
                case = "a cache that held 15 positions and was cropped back to 9, 1 new token"
            else:
                if length:
                    model(torch.arange(1, length + 1)[None], cache=cache)
                case = f"a cache holding {length} positions (capacity 40), {n_new} new token(s)"
            new = torch.arange(30, 30 + n_new)[None]
            got_raw = call(name, case, decode_positions, cache, n_new)
            expect(cache.get_seq_length() == length, name, case,
                   f"the cache left at length {length}", f"length {cache.get_seq_length()}",
                   "only read the cache; do not feed or crop it")
            try:
                got = _as_positions(got_raw)
            except (TypeError, ValueError):
                fail(name, case, list(range(length, length + n_new)), got_raw,
                     "return a list (or tensor) of ints")
            want = list(range(length, length + n_new))
            if len(got) != n_new or any(not 0 <= p < model.config.block_size for p in got):
                fail(name, case, want, got,
                     f"one position id per new token, each in [0, {model.config.block_size})")
            # the engine picks positions itself
            reference = model(new, cache=cache.fork())
            yours = model(new, cache=cache.fork(), positions=torch.tensor(got))
        hint = ("positions continue where the cache ends: cache.get_seq_length(), not 0 "
                "(seed 003's bug) and not the buffer's size(2), which is its capacity")
        expect(torch.equal(reference, yours), name, case,
               f"positions {want} (the model's logits at them)", got, hint)
        n_cases += 1
    passed(name, n_cases)


# --- exercise 4: attention for one new query, with a cache ----------------------------------------

def check_cached_attention(cached_attention) -> None:
    """cached_attention(q, k_cache, v_cache, k_new, v_new) against the engine's kernel and the full
    triangle's last row."""
    name = "cached_attention"
    n_cases = 0
    gen = torch.Generator().manual_seed(0)
    for batch, n_head, cached, head_dim in [(1, 8, 3, 32), (1, 4, 0, 16), (2, 2, 9, 8),
                                            (1, 1, 1, 4), (1, 12, 99, 64)]:
        case = f"batch {batch}, {n_head} heads, {cached} cached positions, head_dim {head_dim}"
        L = cached + 1
        q_all, k_all, v_all = (torch.randn(batch, n_head, L, head_dim, generator=gen) * 2
                               for _ in range(3))
        q = q_all[:, :, -1:]
        k_cache, v_cache, k_new, v_new = (k_all[:, :, :-1], v_all[:, :, :-1],
                                          k_all[:, :, -1:], v_all[:, :, -1:])
        args = [t.clone() for t in (q, k_cache, v_cache, k_new, v_new)]
        got = call(name, case, cached_attention, *args)
        want = causal_attention(q, k_all, v_all)  # what minikv runs at a decode step
        # the last row of the no-cache triangle
        last_row = causal_attention(q_all, k_all, v_all)[:, :, -1:]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            fail(name, case, f"a tensor of shape {tuple(want.shape)} (B, n_head, 1, head_dim)",
                 tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__,
                 "one output row per head for the single new query")
        hint = ("concatenate the cached and new keys/values, scale q @ K^T by 1/sqrt(head_dim), "
                "softmax over ALL positions (the new token may see every cached one: no mask), "
                "then multiply by V")
        expect(torch.allclose(got, want, atol=1e-5, rtol=1e-4), name, case,
               "the engine's attention output (to 1e-5)",
               f"an output off by up to {(got - want).abs().max():.4f}", hint)
        expect(torch.allclose(got, last_row, atol=1e-5, rtol=1e-4), name,
               case + " (vs the no-cache triangle's last row)",
               "the last row of attention without a cache (to 1e-5)",
               f"an output off by up to {(got - last_row).abs().max():.4f}", hint)
        n_cases += 1
    passed(name, n_cases)
