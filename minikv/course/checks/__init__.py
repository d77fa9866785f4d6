"""Checkers for the course exercises (solutions/ and exercises/): one module per chapter.

A checker runs the learner's function on small cases, compares with the engine (or with a known
answer), and on the first wrong case raises CheckFailed naming the input, what was expected, what
came back and, for the usual mistakes, which mistake it is. On success it prints one line.

A check cell cannot be silenced from an exercise cell: it reloads this package and runs a fresh
copy of its chapter's checker, loaded from the package's own file (`fresh`), so a checker patched
in an earlier cell is not the one that runs; and it refuses to run when the engine functions the
checkers compare with were replaced in the notebook (`engine_is_pristine`; every checker runs
through `guarded`, which also refuses replaced engine methods and leaves the random state alone).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import random
import sys
from pathlib import Path

import torch

import minikv

from ...engine import GPT, GPTConfig

HERE = Path(__file__).resolve().parent
ENGINE_DIR = HERE.parent.parent / "engine"
CHAPTERS = ("ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07")


class CheckFailed(AssertionError):
    """An exercise gave a wrong answer; the message says on which input and how."""


class EngineCalled(CheckFailed):
    """The learner's function called an engine function the exercise forbids (`forbid`)."""

    def __init__(self, exercise: str, called: str):
        self.called = called
        super().__init__(f"{exercise}: your function called minikv's own {called}(); the "
                         f"exercise is to write it yourself")


def fail(exercise: str, case: str, expected, got, hint: str = "") -> None:
    message = f"{exercise}: wrong for {case}\n  expected: {expected!r}\n  got:      {got!r}"
    raise CheckFailed(message + (f"\n  hint: {hint}" if hint else ""))


def expect(condition: bool, exercise: str, case: str, expected, got, hint: str = "") -> None:
    if not condition:
        fail(exercise, case, expected, got, hint)


def call(exercise: str, case: str, fn, *args, **kwargs):
    """Run the learner's function; a crash becomes a failed case that names the input."""
    return call_hinted(exercise, case, lambda e: "your function raised on this input", fn, *args,
                       **kwargs)


def call_hinted(exercise: str, case: str, hint_of, fn, *args, **kwargs):
    """Like `call`, but a crash gets the hint `hint_of(exception)` (a usual mistake named)."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 - any crash is a wrong answer for this case
        fail(exercise, case, "a result", f"{type(e).__name__}: {e}", hint_of(e))


def passed(exercise: str, n_cases: int) -> None:
    print(f"✓ {exercise}: all {n_cases} cases pass")


def random_windows(rng: random.Random, n_windows: int, lengths: tuple[int, int], vocab: int,
                   agree: float) -> list[tuple[list[int], list[int]]]:
    """Random speculative windows (proposals, verified): rng.randint(*lengths) proposals drawn from
    range(vocab), and the verifier's tokens, each the proposal's with probability `agree` (else
    drawn afresh), plus one more after the last proposal."""
    windows = []
    for _ in range(n_windows):
        n = rng.randint(*lengths)
        proposals = [rng.randrange(vocab) for _ in range(n)]
        verified = ([p if rng.random() < agree else rng.randrange(vocab) for p in proposals]
                    + [rng.randrange(vocab)])
        windows.append((proposals, verified))
    return windows


def tiny_model(seed: int, std: float = 0.1, **config_overrides) -> GPT:
    """A small random GPT (the "tiny" preset) on the CPU, in eval mode, whose weight matrices are
    re-drawn from N(0, std): larger weights than the default init, so greedy tokens vary. Seeded
    with `seed` under `torch.random.fork_rng`, so the caller's random state is left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset("tiny", **config_overrides)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
    return model


# --- integrity: the checker that runs is the packaged one ---------------------------------------

def _defined_in_engine(obj, name: str) -> bool:
    """Is `obj` the function or class `name` as the engine folder's source defines it?"""
    if isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        file = getattr(module, "__file__", None)
        return (obj.__name__ == name and file is not None
                and Path(file).resolve().parent == ENGINE_DIR and getattr(module, name) is obj)
    code = getattr(obj, "__code__", None)
    return (code is not None and code.co_name == name
            and Path(code.co_filename).resolve().parent == ENGINE_DIR)


def engine_is_pristine() -> None:
    """Raise unless every function and class the engine defines, wherever it is reachable
    (minikv.X, minikv.engine.X, minikv.engine.module.X), is the one in the package's files: a
    checker compares with them, so replacing one (say minikv.generate) could make any answer
    look right."""
    defined = {}
    for path in ENGINE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        defined[f"minikv.engine.{path.stem}"] = names
    public = [n for n in minikv.engine.__all__ if any(n in names for names in defined.values())]
    places = [(minikv, public), (minikv.engine, public)]
    places += [(sys.modules[m], names) for m, names in defined.items() if m in sys.modules]
    for module, names in places:
        for name in names:
            if hasattr(module, name) and not _defined_in_engine(getattr(module, name), name):
                raise CheckFailed(f"{module.__name__}.{name} is not the packaged one (it was "
                                  f"replaced in this notebook): restart the kernel and run the "
                                  f"notebook from the top")


def engine_methods_are_pristine() -> None:
    """Raise unless every method of every class the engine defines (BlockPool.allocate,
    PagedCache.reserve, KVCache.crop, ...) is the one in the engine's files: `fresh` checks the
    engine's functions and classes, but a method replaced in the notebook could change the
    reference a checker compares with, and make a wrong answer look right."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("minikv.engine.") or module is None:
            continue
        for cls in [v for v in vars(module).values()
                    if isinstance(v, type) and v.__module__ == name]:
            for attr, value in vars(cls).items():
                if attr.startswith("__"):
                    continue  # dataclasses write __init__, __eq__, ... themselves
                parts = [value.fget, value.fset] if isinstance(value, property) else [value]
                for part in parts:
                    function = inspect.unwrap(getattr(part, "__func__", part))  # decorated too
                    code = getattr(function, "__code__", None)
                    if code is not None and Path(code.co_filename).resolve().parent != ENGINE_DIR:
                        raise CheckFailed(f"{name}.{cls.__name__}.{attr} is not the packaged one "
                                          f"(it was replaced in this notebook): restart the "
                                          f"kernel and run the notebook from the top")


def guarded(check):
    """How every checker runs: first refuse an engine whose methods were replaced in the notebook
    (the references are computed with them), then run under torch.random.fork_rng, so that neither
    the checker nor the learner's code it calls changes the notebook's random state."""
    @functools.wraps(check)
    def run(*args, **kwargs):
        engine_methods_are_pristine()
        with torch.random.fork_rng(devices=[]):
            return check(*args, **kwargs)
    return run


def one_thread(check):
    """Tiny models decode fastest on one thread, and stay fast when other work shares the CPU."""
    @functools.wraps(check)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return check(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return run


def fresh(chapter: str):
    """A new copy of checks/<chapter>.py, loaded from the package's file (not the module this
    notebook may have imported, and perhaps patched), after checking the engine is untouched."""
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}; one of {CHAPTERS}")
    engine_is_pristine()
    spec = importlib.util.spec_from_file_location(f"{__name__}.{chapter}", HERE / f"{chapter}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not placed in sys.modules: nobody else holds this copy
    return module


# --- what learners' functions must not do, and what they must return ----------------------------

@contextlib.contextmanager
def forbid(exercise: str, *engine_functions):
    """While the learner's function runs, calling one of these engine functions fails the check,
    however it was reached (minikv.generate, a name imported earlier, a method): the exercise asks
    you to write it, not to call it. Watched with sys.setprofile, so no reference can dodge it."""
    codes = {f.__code__: f"{f.__module__}.{f.__qualname__}" for f in engine_functions}
    called = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])
    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if called:
        raise EngineCalled(exercise, called[0])


def prediction(exercise: str, case: str, fn, *engine_functions,
               why: str = "a prediction is made before the measurement: reason it out, and let "
                          "the check cell measure"):
    """Call a predict-then-measure exercise's `fn` (every chapter has one) with the engine
    functions that would measure the answer forbidden: a prediction is reasoned out before the
    check cell measures, and `why` says so when the function ran the model anyway."""
    try:
        with forbid(exercise, *engine_functions):
            return call(exercise, case, fn)
    except EngineCalled as e:
        raise CheckFailed(f"{exercise}: your prediction ran the model (it called minikv's own "
                          f"{e.called}()): {why}") from None


def as_int(value):
    """`value` as an int when it is one (a Python int, a numpy or 0-d torch integer), else None: a
    float such as 25.0 or 25.5 is not an int, and neither is a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        return int(value)
    if type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu" \
            and getattr(value, "ndim", 1) == 0:
        return int(value)
    return None


def int_list(value):
    """`value` as a list of ints (a list, tuple or 1-D integer tensor/array), else None."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dim() != 1:
            return None
        return [int(v) for v in value]
    if type(value).__module__ == "numpy":
        value = value.tolist() if getattr(value, "ndim", 0) == 1 else None
    if not isinstance(value, (list, tuple)):
        return None
    ints = [as_int(v) for v in value]
    return None if any(v is None for v in ints) else ints


class PassCounter:
    """Counts the forward passes a model makes and the token positions each one feeds."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.passes = model, []

    def __enter__(self) -> PassCounter:
        def hook(module, args, kwargs):
            idx = args[0] if args else kwargs.get("idx")
            self.passes.append(tuple(idx.shape) if isinstance(idx, torch.Tensor) else None)
        self.handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def cache_state(cache) -> tuple:
    """Everything a KVCache holds: its length and every layer's keys and values (cloned)."""
    return cache.get_seq_length(), [t.clone() for t in cache.keys + cache.values]


def same_cache_prefix(before: tuple, cache, keep: int) -> bool:
    """True when `cache` still holds, in every layer, the first `keep` positions of `before`."""
    _, tensors = before
    return all(torch.equal(a[:, :, :keep], b[:, :, :keep])
               for a, b in zip(tensors, cache.keys + cache.values))
