"""Command-line values checked as argparse reads them: a number out of its range or a path of the
wrong kind ends the command at once with `error: argument --x: ...` (exit 2), before any model is
loaded or any file written. Ranges are closed: no 0 or -1 taken with another meaning (none, off),
since a typo would then change what a command does instead of stopping it."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

SEEDS = 2**63  # torch.Generator.manual_seed takes [0, 2**63) without wrapping


def integer(low: int, high: int | None = None, what: str = ""):
    """An argparse type: an int in [low, high] (high None: no upper bound)."""
    span = f"from {low:,} to {high:,}" if high is not None else f"at least {low:,}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {span}{what}, not {text!r}")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {span}{what}, got {value:,}")
        return value
    parse.__name__ = "integer"
    return parse


def number(low: float, high: float = math.inf, what: str = "", *, above: bool = False):
    """An argparse type: a finite float in [low, high] (in (low, high] with `above`)."""
    span = (f"more than {low}" if above else f"at least {low}") + (
        f" and at most {high}" if high < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {span}{what}, not {text!r}")
        if not (math.isfinite(value) and (value > low if above else value >= low)
                and value <= high):
            raise argparse.ArgumentTypeError(f"must be {span}{what}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


positive = integer(1)
seed = integer(0, SEEDS - 1)
port = integer(1, 65535, " (a TCP port; 8000 is the usual one)")


def directory(text: str) -> Path:
    """An argparse type: an existing directory (a checkpoint to read, say)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is {'a file' if path.exists() else 'not there'}: give a directory")
    return path


def notebook(text: str) -> Path:
    """An argparse type: an existing .ipynb file."""
    path = Path(text)
    if not path.is_file() or path.suffix != ".ipynb":
        kind = ("a directory" if path.is_dir() else "not there" if not path.exists()
                else "not a .ipynb file")
        raise argparse.ArgumentTypeError(f"{text} is {kind}: give a notebook (.ipynb) file")
    return path


def output_file(text: str) -> Path | str:
    """An argparse type: a file to write, in a folder that exists (the file may not yet); "-"
    (standard output) as it is."""
    if text == "-":  # standard output
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name in it")
    if not path.parent.is_dir():
        kind = "is not a directory" if path.parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{path.parent} {kind}: give a file in a folder that "
                                         "exists")
    return path
