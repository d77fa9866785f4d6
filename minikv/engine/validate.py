"""Input checks shared by several files (each file checks its own inputs, beside the code they
guard): bad input raises a ValueError or TypeError that says what to do, before anything
changes. Read it last: the rest reads as if inputs were always right."""
from __future__ import annotations

import math
import operator

import torch


def int_at_least(name: str, value, minimum: int = 1, hint: str = "", below=None) -> int:
    """`value` if it is an int (not a bool) in [minimum, below), else a ValueError."""
    if type(value) is not int or not minimum <= value < (value + 1 if below is None else below):
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        wanted = wanted if below is None else f"an int in [{minimum}, {below})"
        raise ValueError(f"{name} must be {wanted}{hint}, got {value!r}")
    return value


def one_of(name: str, value, choices: tuple):
    """`value` if it is one of `choices` (of the same type: 8.0 is not 8), else a ValueError."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def number_in(name: str, value, low: float, high: float = math.inf, hint: str = "") -> float:
    """`value` if it is an int or float (not a bool) in (low, high), else a ValueError."""
    if type(value) not in (int, float) or not low < value < high:
        wanted = f"> {low}" if high == math.inf else f"in ({low}, {high})"
        raise ValueError(f"{name} must be a number {wanted}{hint}, not {value!r:.40}")
    return value


# Value checks run only where reading a tensor costs nothing: on a GPU each read makes the host
# wait for the device. bench/syncs.py turns this off to count a GPU's waits on a CPU.
FREE_READS = True


def reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading t's values is free (host memory): then its values are checked."""
    return FREE_READS and t.device.type == "cpu"


def is_int_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def check_flags(**flags) -> None:
    """Flags are bools: truthiness would turn "no" or 1 into a choice the caller did not make."""
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"{name} must be True or False, got {value!r:.40}")


def check_model(name: str, model) -> None:
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise TypeError(f"{name} must be a minikv.GPT, not {type(model).__name__}")


def token_ids(ids, vocab_size: int) -> list[int]:
    """`ids` (a list or tuple of ints, or a 1-D or (1, T) int tensor) as a list of ints."""
    if not isinstance(ids, (list, tuple, torch.Tensor)):  # bytes, sets, dicts iterate to ints too
        how = "encode it first with" if isinstance(ids, str) else "e.g. [464, 3124] or"
        raise TypeError(f"token ids must be a list, a tuple or an int tensor, not "
                        f"{type(ids).__name__}: {how} tokenizer.encode(text)")
    if isinstance(ids, torch.Tensor):
        if not is_int_tensor(ids):
            raise TypeError(f"token ids must be ints, not {ids.dtype}: use dtype=torch.long")
        ids = ids[0] if ids.dim() == 2 and ids.shape[0] == 1 else ids
        if ids.dim() != 1:
            raise ValueError(f"one sequence at a time: a prompt is (T,) or (1, T), not {ids.shape}")
        ids = ids.tolist()
    if any(type(t) is bool for t in ids):  # operator.index would take True as token 1
        raise TypeError(f"token ids must be ints, not True/False: got {ids!r:.60}")
    try:
        tokens = [operator.index(t) for t in ids]  # ints and numpy ints pass; floats do not
    except TypeError as e:
        raise TypeError(f"token ids must be ints, got {ids!r:.60}: {e}") from None
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token (e.g. <|endoftext|>)")
    for extreme in (min(tokens), max(tokens)):  # both inside the vocabulary: every id is
        int_at_least("token id", extreme, 0, " (encode with the model's own tokenizer)", vocab_size)
    return tokens


def prompt_of_call(model, ids, max_new_tokens, sampling, least: int = 0,
                   name: str = "max_new_tokens") -> list[int]:
    """The prompt as token ids, once what every decoder's call holds is checked."""
    check_model("model", model)
    int_at_least(name, max_new_tokens, least)
    sampling.check_vocab(model.config.vocab_size)
    return token_ids(ids, model.config.vocab_size)


def check_room(needed: int, limit: int, what: str, lower: str,
               whose: str = "block_size") -> None:
    if needed > limit:
        raise ValueError(f"{what} needs {needed} positions > {whose}={limit}; lower {lower}")


def tightest(limit: int, rooms: dict[str, int | None]) -> tuple[int, str]:
    """The smallest of the model's context (`limit`, its block_size) and the rooms of the
    other caches a pass feeds ({name: max_len}), and whose it is, for check_room."""
    named = [(n, f"the {name} cache's max_len") for name, n in rooms.items() if n is not None]
    return min([(limit, "block_size"), *named], key=lambda pair: pair[0])

