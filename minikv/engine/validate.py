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
# --- decoders: each returns the number of positions the call will need -----------------
def fits(needed: int, limit: int, what: str, lower: str) -> None:
    if needed > limit:
        raise ValueError(f"{what} needs {needed} positions > block_size={limit}; lower {lower}")


