"""Input checks, out of the way of the code they guard: every entry point calls one
function here before it touches a model or a cache, so bad input raises a ValueError or
TypeError that says what to do, and nothing has changed. Read it last: the rest reads as
if inputs were always right."""
from __future__ import annotations

import operator

import torch


def int_at_least(name: str, value, minimum: int = 1, hint: str = "") -> int:
    """`value` if it is an int (not a bool) of at least `minimum`, else a ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {wanted}{hint}, got {value!r}")
    return value


def _is_int_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def token_ids(ids, vocab_size: int) -> list[int]:
    """A prompt given as a list of ints, a 1-D or a (1, T) tensor, as a list of ids."""
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


# --- the model and its cache -----------------------------------------------------------
def crop(cache, max_length) -> None:
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise TypeError(f"crop takes an int length, got {type(max_length).__name__}")
    if not (n := cache.get_seq_length()) >= max_length >= 0:
        raise ValueError(f"cannot crop to {max_length}: the cache holds {n} positions; "
                         f"pass a length between 0 and {n}")


# --- decoders: each returns the number of positions the call will need -----------------
def fits(needed: int, limit: int, what: str, lower: str) -> None:
    if needed > limit:
        raise ValueError(f"{what} needs {needed} positions > block_size={limit}; lower {lower}")


def serve_call(model, requests, window, block_size, num_blocks) -> tuple[list[list[int]], int]:
    """Returns each request's prompt as a list of ids, and the pool's size in blocks."""
    int_at_least("window", window, hint=" (positions verified per pass)")
    int_at_least("block_size", block_size, hint=" (positions per block)")
    if not requests:
        raise ValueError("no requests to serve")
    prompts, sizes = [], []
    for i, r in enumerate(requests):
        prompts.append(token_ids(r.prompt, model.config.vocab_size))
        r.sampling.check_vocab(model.config.vocab_size)
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
