"""Input checks, out of the way of the code they guard: every entry point calls one function here
before it touches a model or a cache, so bad input raises a ValueError or TypeError that says
what to do, and nothing has changed. Read it last: the rest reads as if inputs were always right."""
from __future__ import annotations

import math
import operator

import torch

MODES = ("naive", "cached")
# Below this, logits / temperature overflows float32 for ordinary logits, and sampling is greedy in
# all but name anyway: ask for 0.
MIN_TEMPERATURE = 1e-3


def int_at_least(name: str, value, minimum: int = 1, hint: str = "") -> int:
    """`value` if it is an int (a bool is not) of at least `minimum`, else a ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {wanted}{hint}, got {value!r}")
    return value


def _is_int_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def config(cfg) -> None:
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        int_at_least(f"GPTConfig.{name}", getattr(cfg, name))
    if type(cfg.layer_norm_eps) not in (int, float) or not 0 < cfg.layer_norm_eps < 1:
        raise ValueError(f"GPTConfig.layer_norm_eps must be a number in (0, 1), "
                         f"got {cfg.layer_norm_eps!r}")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head}): "
                         f"pick an n_head that divides it")
    if cfg.n_kv_head is not None:
        int_at_least("GPTConfig.n_kv_head", cfg.n_kv_head, hint=" or None")
        if cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"n_head ({cfg.n_head}) must be divisible by n_kv_head "
                             f"({cfg.n_kv_head}): each K/V head serves a whole group of query "
                             f"heads")


def sampling(sp, vocab_size: int | None = None) -> None:
    t = sp.temperature
    if type(t) not in (int, float) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
        raise ValueError(f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE}, "
                         f"got {t!r}")
    if sp.top_k is not None:
        int_at_least("top_k", sp.top_k, hint=" or None (no filtering)")
    if not isinstance(sp.seed, int) or isinstance(sp.seed, bool) or not 0 <= sp.seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {sp.seed!r}")
    if sp.eos_id is not None:
        int_at_least("eos_id", sp.eos_id, 0, hint=" (a token id) or None")
        if vocab_size is not None and sp.eos_id >= vocab_size:
            raise ValueError(f"eos_id must be a token id in [0, {vocab_size}) or None, "
                             f"got {sp.eos_id!r}")


def finite_probabilities(probs, temperature) -> None:
    if not torch.isfinite(probs).all():
        raise ValueError(f"sampling failed: softmax(logits / {temperature}) is not finite (the "
                         f"logits overflowed, or hold NaN); use a larger temperature, or 0 for "
                         f"greedy decoding")


def token_ids(ids, vocab_size: int) -> list[int]:
    """A prompt given as a list of ints, a 1-D tensor or a (1, T) tensor, as a list of ids."""
    if isinstance(ids, str):
        raise TypeError("got text, not token ids: encode it first, "
                        "e.g. minikv.load_tokenizer().encode(text)")
    if isinstance(ids, torch.Tensor):
        if not _is_int_tensor(ids):
            raise TypeError(f"token ids must be integers, got a {ids.dtype} tensor; "
                            f"use dtype=torch.long")
        ids = ids[0] if ids.dim() == 2 and ids.shape[0] == 1 else ids
        if ids.dim() != 1:
            raise ValueError(f"prompt must be 1-D (T,) or (1, T), got shape {tuple(ids.shape)}; "
                             f"generate one sequence at a time")
        ids = ids.tolist()
    try:
        tokens = [operator.index(t) for t in ids]  # ints and numpy ints pass; floats do not
    except TypeError as e:
        raise TypeError(f"token ids must be ints, got {ids!r:.80}: {e}") from None
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token "
                         "(e.g. the tokenizer's <|endoftext|> id)")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                         f"encode with the model's own tokenizer")
    return tokens


# --- the model and its cache ------------------------------------------------------------------
def forward(model, idx, cache, positions) -> None:
    """GPT.forward's inputs, checked before any cache slot is written."""
    from .cache import Cache  # cache.py imports this module
    cfg = model.config
    if not _is_int_tensor(idx):
        got = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise TypeError(f"idx must be an integer tensor of token ids, got {got}; "
                        f"use torch.tensor([ids], dtype=torch.long)")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must have shape (batch, T) with T >= 1, got {tuple(idx.shape)}; "
                         f"add a batch dimension with idx[None]")
    if idx.device != model.device:
        raise ValueError(f"idx is on {idx.device} but the model is on {model.device}; "
                         f"move it with idx.to(model.device)")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                         f"[0, {cfg.vocab_size}); encode with the model's own tokenizer")
    B, T = idx.shape
    if cache is not None:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a minikv.KVCache, got {type(cache).__name__}")
        cache.check_fits(cfg, B, T, model.device, model.dtype)
    if positions is None:
        past = 0 if cache is None else cache.get_seq_length()
        longest = int(past.max()) if isinstance(past, torch.Tensor) else past
        if longest + T > cfg.block_size:
            raise ValueError(f"sequence of {longest + T} positions exceeds block_size="
                             f"{cfg.block_size}: shorten the prompt or generate fewer tokens")
    elif (not _is_int_tensor(positions) or positions.shape not in ((T,), (B, T))
          or int(positions.min()) < 0 or int(positions.max()) >= cfg.block_size):
        raise ValueError(f"positions must be an integer tensor of shape ({T},) or ({B}, {T}) "
                         f"with values in [0, {cfg.block_size})")


def cache_fits(cache, cfg, batch_size: int, n_new: int, device, dtype) -> None:
    """Raise unless a model of `cfg` on (device, dtype) can append (batch_size, n_new) tokens."""
    if (have := (cache.n_layer, cache.n_head, cache.head_dim)) != (
            want := (cfg.n_layer, cfg.kv_heads, cfg.head_dim)):
        raise ValueError(f"cache has (n_layer, n_head, head_dim) = {have} (K/V heads) but the "
                         f"model needs {want}; build it with KVCache.for_model(model)")
    if cache.batch_size != batch_size:
        raise ValueError(f"cache holds batch {cache.batch_size} but idx has batch {batch_size}; "
                         f"use KVCache.for_model(model, batch_size={batch_size})")
    if cache.device != device or cache.dtype != dtype:
        raise ValueError(f"cache is {cache.dtype} on {cache.device} but the model is {dtype} on "
                         f"{device}; build it with KVCache.for_model(model)")
    _room(cache, n_new)


def _room(cache, n_new: int) -> None:
    if cache.get_seq_length() + n_new > cache.max_len:
        raise ValueError(f"KV cache overflow: {cache.get_seq_length()} cached + {n_new} new "
                         f"positions > max_len={cache.max_len}; create the cache with a larger "
                         f"max_len, or crop it first")


def cache_update(cache, key, value, layer_idx: int) -> None:
    if not 0 <= layer_idx < cache.n_layer:
        raise ValueError(f"layer_idx={layer_idx} out of range for {cache.n_layer} layers")
    shape = (cache.batch_size, cache.n_head, "T", cache.head_dim)
    for t in (key, value):
        if (t.dim() != 4 or t.shape != key.shape or (*t.shape[:2], "T", t.shape[3]) != shape
                or t.device != cache.device or t.dtype != cache.dtype):
            raise ValueError(f"key and value must both be {shape}, {cache.dtype} on "
                             f"{cache.device}; got {tuple(t.shape)} {t.dtype} on {t.device}")
    _room(cache, key.shape[2])


def crop(cache, max_length) -> None:
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise TypeError(f"crop takes an int length, got {type(max_length).__name__}")
    if not (n := cache.get_seq_length()) >= max_length >= 0:
        raise ValueError(f"cannot crop to {max_length}: the cache holds {n} positions; "
                         f"pass a length between 0 and {n}")


def gpt2_state_dict(sd: dict, want: dict | None = None, what: str = "") -> None:
    """A GPT-2 state dict (prefix removed); with `want`, exactly its names and shapes."""
    if want is not None:
        missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
        if missing or unexpected:
            raise ValueError(f"state dict does not match {what}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, t in want.items():
            if sd[name].shape != t.shape:
                raise ValueError(f"{name}: got shape {tuple(sd[name].shape)}, expected "
                                 f"{tuple(t.shape)} for {what}")
        return
    if "wte.weight" not in sd:
        raise ValueError("state dict has no 'transformer.wte.weight': "
                         "is this a GPT-2 state dict?")
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight, but GPT-2 ties them; "
                         "this model cannot load it")


def max_len_for(cfg, max_len) -> None:
    if isinstance(max_len, int) and max_len > cfg.block_size:
        raise ValueError(f"max_len={max_len} exceeds the model's block_size={cfg.block_size}: "
                         f"positions past it have no embedding; use max_len <= {cfg.block_size}")


# --- decoders: each returns the number of positions the call will need ----------------------
def fits(needed: int, limit: int, what: str, lower: str) -> None:
    if needed > limit:
        raise ValueError(f"{what} needs {needed} positions > block_size={limit}; lower {lower}")


def generate_call(model, prompt, max_new_tokens, mode, sp, cache, position_offset_bug) -> int:
    cfg = model.config
    int_at_least("max_new_tokens", max_new_tokens, 0)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    sampling(sp, cfg.vocab_size)
    if mode == "naive" and (cache is not None or position_offset_bug):
        raise ValueError("cache= and position_offset_bug= only apply to mode='cached'")
    past = 0 if cache is None else cache.get_seq_length()
    # The last new token is returned, never fed back, so the model sees at most this many.
    needed = past + len(prompt) + max_new_tokens - 1
    fits(needed, cfg.block_size, f"{past} cached + {len(prompt)} prompt + {max_new_tokens} new "
          f"tokens", "max_new_tokens or shorten the prompt")
    if cache is not None and needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions but this call needs "
                         f"{needed}; pass a larger cache or lower max_new_tokens")
    return needed


def speculative_call(target, draft, prompt, max_new_tokens, gamma, sp, adaptive_gamma,
                     max_gamma) -> int:
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the "
                         f"target's ({target.config.vocab_size}): both must use the same "
                         f"tokenizer")
    if target.device != draft.device:
        raise ValueError(f"draft is on {draft.device} but the target is on {target.device}; "
                         f"move both to one device")
    int_at_least("max_new_tokens", max_new_tokens, 0)
    int_at_least("gamma", gamma)
    if adaptive_gamma:
        int_at_least("max_gamma", max_gamma, gamma, hint=" (the largest γ adaptive γ may reach)")
    sampling(sp, target.config.vocab_size)
    needed = len(prompt) + max_new_tokens + (max_gamma if adaptive_gamma else gamma)
    fits(needed, min(target.config.block_size, draft.config.block_size),
          f"{len(prompt)} prompt + {max_new_tokens} new tokens + γ lookahead",
          "max_new_tokens or gamma")
    return needed


def lookup_call(target, prompt, max_new_tokens, gamma, ngram, sp) -> int:
    int_at_least("max_new_tokens", max_new_tokens, 0)
    int_at_least("gamma", gamma)
    int_at_least("ngram", ngram, hint=" (tokens of context the lookup matches)")
    sampling(sp, target.config.vocab_size)
    needed = len(prompt) + max_new_tokens + gamma
    fits(needed, target.config.block_size, f"{len(prompt)} prompt + {max_new_tokens} new tokens "
          f"+ γ lookahead", "max_new_tokens or gamma")
    return needed


def batch_call(model, prompts, max_new_tokens, sp, pad_id) -> list[list[int]]:
    """Check a generate_batch() call; return each prompt as a list of ids."""
    if isinstance(prompts, (str, torch.Tensor)) or not hasattr(prompts, "__iter__"):
        raise TypeError("prompts must be a list of prompts (each a list of token ids); for one "
                        "prompt use minikv.generate")
    rows = [token_ids(p, model.config.vocab_size) for p in prompts]
    if not rows:
        raise ValueError("no prompts to generate from")
    int_at_least("max_new_tokens", max_new_tokens, 0)
    sampling(sp, model.config.vocab_size)
    int_at_least("pad_id", pad_id, 0)
    if pad_id >= model.config.vocab_size:
        raise ValueError(f"pad_id must be a token id in [0, {model.config.vocab_size})")
    width = max(len(r) for r in rows)
    fits(width + max_new_tokens - 1, model.config.block_size,
          f"the longest prompt ({width}) + {max_new_tokens} new tokens",
          "max_new_tokens or shorten the prompts")
    return rows


def serve_call(model, requests, window, block_size, num_blocks) -> tuple[list[list[int]], int]:
    """Returns each request's prompt as a list of ids, and the pool's size in blocks."""
    int_at_least("window", window, hint=" (positions verified per pass)")
    int_at_least("block_size", block_size, hint=" (positions per block)")
    if not requests:
        raise ValueError("no requests to serve")
    prompts, sizes = [], []
    for i, r in enumerate(requests):
        prompts.append(token_ids(r.prompt, model.config.vocab_size))
        sampling(r.sampling, model.config.vocab_size)
        int_at_least(f"request {i}: max_new_tokens", r.max_new_tokens)
        int_at_least(f"request {i}: arrival", r.arrival, 0, hint=" (an engine step)")
        positions = len(prompts[-1]) + r.max_new_tokens + window
        fits(positions, model.config.block_size, f"request {i}: {len(prompts[-1])} prompt + "
              f"{r.max_new_tokens} new + {window} window rows", "max_new_tokens or the window")
        sizes.append(-(-positions // block_size) + 1)  # its blocks, one of them copied
    if num_blocks is None:
        return prompts, sum(sizes)
    int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
    if max(sizes) > num_blocks:
        i = sizes.index(max(sizes))
        raise ValueError(f"request {i} needs {sizes[i]} blocks of {block_size} positions, more "
                         f"than the whole pool ({num_blocks}); raise num_blocks or block_size, or "
                         f"shorten the request")
    return prompts, num_blocks


def quant_bits(bits) -> None:
    if bits not in (8, 4) or type(bits) is not int:
        raise ValueError(f"bits must be 8 or 4 (int8 or int4 codes), got {bits!r}")


def pool(num_blocks, block_size) -> None:
    int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
    int_at_least("block_size", block_size, hint=" (positions per block)")


def paged_fits(cache, cfg, batch_size, n_new, device, dtype) -> None:
    keys = cache.pool.keys
    if (len(keys), keys[0].shape[1], keys[0].shape[3]) != (cfg.n_layer, cfg.kv_heads, cfg.head_dim):
        raise ValueError("the block pool was built for another model's shapes; build it with "
                         "BlockPool(model.config, ...)")
    counts = cache.packed or [n_new] * len(cache.tables)
    if cache.packed and (batch_size != 1 or n_new != sum(counts) or min(counts) < 1):
        raise ValueError(f"a packed pass is one row of sum(packed) = {sum(counts)} tokens, "
                         f"at least one per table; got {batch_size} rows of {n_new}")
    if not cache.packed and batch_size != len(cache.tables):
        raise ValueError(f"batch of {batch_size} rows for {len(cache.tables)} block tables")
    if keys[0].device != device or keys[0].dtype != dtype:
        raise ValueError(f"the block pool is {keys[0].dtype} on {keys[0].device} but the model is "
                         f"{dtype} on {device}")
    short = [t.owner for t, n in zip(cache.tables, counts)
             if len(t.blocks) * cache.pool.block_size < t.length + n]
    if short:
        raise ValueError(f"sequences {short} have no room for {n_new} more positions: call "
                         f"cache.reserve({n_new}) before the pass")
