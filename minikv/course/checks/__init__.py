"""Checkers for the course exercises (solutions/ and exercises/): one module per chapter.

A checker runs the learner's function on small cases, compares with the engine (or with a known
answer), and on the first wrong case raises CheckFailed naming the input, what was expected, what
came back and, for a usual mistake, which mistake it is (`hint:`). On success it prints one line,
"✓ name: all N cases pass". Every checker leaves the caller's random state alone. A check cell
reads `importlib.reload(checks).fresh("chNN").check_x(fn)`: `fresh` runs a new copy of the
chapter's module, so a checker patched in an exercise cell is not the one that runs.

The recipe, for writing or converting a chapter's checkers (chapter 05 is the model):
1. An exercise whose function returns a value is an `Exercise`, data rather than code:
       SCHED = hints("ch05")["verify_schedule"]   # checks/hints/ch05.toml: a key per mistake
       SCHEDULE = Exercise(
           "verify_schedule", cases=[(10, 4), (9, 4), ...],   # the learner's arguments
           describe=lambda n, window: f"max_new_tokens={n}, window={window}",
           reference=served_schedule,    # the right answer, measured by the engine where it can
           returns=pass_list,            # the contract: the answer coerced, or Refused(hint)
           mistakes=named(SCHED, no_prefill=lambda n, window: schedule(n + 1, window), ...),
           otherwise=SCHED["otherwise"], forbid=(serve,), solution=schedule)
       check_verify_schedule = SCHEDULE.check
   Write each usual mistake ONCE, as a wrong implementation with the learner's signature (often
   the solution with one knob turned), under its hint's key in checks/hints/chNN.toml: a table
   per exercise, each hint written once, as students read it. The checker runs the mistake to
   name the one behind wrong answers, and tests/test_checks_table.py feeds it to the checker and
   expects exactly its hint back, so the cases must tell the mistakes apart.
2. List the module's exercises in `EXERCISES` (the generic test finds them there) and delete
   their mutants from tests/test_checks_chNN.py, except the few a table cannot state: wrong
   types, crashes, inputs changed in place, two mistakes at once.
3. An exercise that drives a model or a stateful object stays code, built from the same pieces
   (`call`, `fail`/`expect`, `expect_tensor`, `diagnose`, `kind`, `forbid`, `prediction`,
   `guarded`); its mutants stay in tests/test_checks_chNN.py.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import operator
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import minikv

from ...engine import GPT, GPTConfig

HERE = Path(__file__).resolve().parent
CHAPTERS = tuple(f"ch{i:02}" for i in range(14))  # the chapters, 00 to 13


class CheckFailed(AssertionError):
    """An exercise gave a wrong answer; the message says on which input and how."""


class EngineCalled(CheckFailed):
    """The learner's function called an engine function the exercise forbids (`forbid`)."""

    def __init__(self, exercise: str, called: str):
        self.called = called
        whose = "" if called.startswith("torch.") else "minikv's own "
        super().__init__(f"{exercise}: your function called {whose}{called}(); the "
                         f"exercise is to write it yourself")


def fail(exercise: str, case: str, expected, got, hint: str = "") -> None:
    message = f"{exercise}: wrong for {case}\n  expected: {expected!r}\n  got:      {got!r}"
    raise CheckFailed(message + (f"\n  hint: {hint}" if hint else ""))


def expect(condition: bool, exercise: str, case: str, expected, got, hint: str = "") -> None:
    if not condition:
        fail(exercise, case, expected, got, hint)


def call(exercise: str, case: str, fn, *args, **kwargs):  # a crash: a failed case naming the input
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


def tiny_model(seed: int, std: float = 0.1, **config_overrides) -> GPT:
    """A random "tiny" GPT on the CPU, its matrices drawn from N(0, std) (so greedy tokens vary),
    seeded under fork_rng (the caller's random state stays)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset("tiny", **config_overrides)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
    return model


def token_ids(got, h: dict[str, str]) -> list[int]:
    """The contract "a flat list of token ids", else Refused with the hint h["array"],
    h["not_list"], h["nested"] (where h has it) or h["not_int"]."""
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        raise Refused(h["array"].format(type=f"{type(got).__module__}.{type(got).__name__}"))
    if not isinstance(got, (list, tuple)):
        raise Refused(h["not_list"].format(type=type(got).__name__))
    if "nested" in h and any(isinstance(t, (list, tuple)) for t in got):
        raise Refused(h["nested"])
    bad = [t for t in got if as_int(t) is None]
    if bad:
        raise Refused(h["not_int"].format(bad=bad[0], type=type(bad[0]).__name__))
    return [as_int(t) for t in got]


def pair_hint(mistakes: list, got: Sequence[int], want: Sequence[int], otherwise: str) -> str:
    """The hint of the first ((a, b), hint) in `mistakes` whose pair gives `got` (None: any
    value) and is wrong somewhere, for a predicted pair of counts; else `otherwise`."""
    return next((hint for pair, hint in mistakes
                 if all(m is None or m == v for m, v in zip(pair, got))
                 and any(m is not None and m != w for m, w in zip(pair, want))), otherwise)


# --- how every check runs --------------------------------------------------------------------

def fresh(chapter: str):
    """A new copy of checks/<chapter>.py, loaded from its file: the checker the check cell runs,
    not one an exercise cell may have patched. Refused while a public engine function or class,
    which the checkers compare with, was replaced in the notebook (minikv.generate = ...)."""
    for module in (minikv, minikv.engine):
        for name in minikv.engine.__all__:
            obj = getattr(module, name, None)
            ours = not callable(obj) or getattr(obj, "__module__", "").startswith("minikv.engine")
            if not ours:
                raise CheckFailed(f"{module.__name__}.{name} is not the packaged one (it was "
                                  f"replaced in this notebook): restart the kernel and run the "
                                  f"notebook from the top")
    spec = importlib.util.spec_from_file_location(f"{__name__}.{chapter}", HERE / f"{chapter}.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)  # not placed in sys.modules: nobody else holds this copy
    return checker


@contextlib.contextmanager
def _one_thread():  # tiny models decode fastest on one thread, also when the CPU is shared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def guarded(check):
    """Run a checker under fork_rng: the notebook's random state stays as it was."""
    return torch.random.fork_rng(devices=[])(check)  # a context manager that wraps a function


def one_thread(check):
    return _one_thread()(check)


# --- what learners' functions must not do, and what they must return ----------------------------

@contextlib.contextmanager
def forbid(exercise: str, *engine_functions):
    """While the learner's function runs, calling one of these engine functions fails the check,
    however it was reached (minikv.generate, a name imported earlier, a method): the exercise asks
    you to write it, not to call it. Watched with sys.setprofile, so no reference can dodge it.
    A string names a torch builtin (function or tensor method, e.g. "softmax"), forbidden too."""
    if not engine_functions:
        yield
        return
    codes = {f.__code__: f"{f.__module__}.{f.__qualname__}" for f in engine_functions
             if not isinstance(f, str)}
    builtins = {f for f in engine_functions if isinstance(f, str)}
    called = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])
        elif event == "c_call" and getattr(arg, "__name__", None) in builtins:
            called.append(f"torch.{arg.__name__}")
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
    """`value` as an int if it is one (Python, numpy or 0-d torch; not 25.0, not a bool), else
    None."""
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


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells expected fewer
    than 5 times pooled into one; an outcome of probability 0 that happened gives 0)."""
    counts, probs, n = counts.flatten().double(), probs.flatten().double(), counts.sum()
    if bool(((probs <= 1e-12) & (counts > 0)).any()):
        return 0.0
    big = probs * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([probs[big] * n, (probs[~big] * n).sum().view(1)])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor(max(int(keep.sum()) - 1, 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def cache_state(cache) -> tuple:  # a KVCache's length and every layer's K and V, cloned
    return cache.get_seq_length(), [t.clone() for t in cache.keys + cache.values]


def same_cache_prefix(before: tuple, cache, keep: int) -> bool:  # the first `keep` positions?
    _, tensors = before
    return all(torch.equal(a[:, :, :keep], b[:, :, :keep])
               for a, b in zip(tensors, cache.keys + cache.values))


# --- pieces the code checkers of chapters 04, 06 and 07 share ------------------------------------
FORGOT = " (did you forget to return it?)"


class Labelled(list):
    """A case's argument that carries what the case is about (`label`), for the message."""

    def __init__(self, label: str, items=()):
        super().__init__(items)
        self.label = label


def type_name(value) -> str:  # for hints that say "not a {type}": 'torch.Tensor', 'list'
    return f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")


def raised_as(error, hint: str, says: str = "") -> Callable:
    """A crash's hint for `call_hinted`: `hint` for an `error` whose message has `says`."""
    return lambda e: (hint if isinstance(e, error) and says in str(e)
                      else "your function raised on this input")


def call_kept(exercise: str, case: str, unchanged: str, fn, *args,
              raised: Callable = raised_as((), ""), **kwargs):
    """`call_hinted` on copies of the tensor arguments; the hint `unchanged` if fn changed one."""
    given = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = call_hinted(exercise, case, raised, fn, *given, **kwargs)
    expect(all(map(_unchanged, args, given)), exercise, case, "the arguments left as they were",
           "an argument changed in place", unchanged)
    return got


def obeyed(exercise: str, case: str, returns: Callable, got, *args, expected=None):
    """A table's contract in a code checker: `returns(got, *args)`, or CheckFailed with its hint."""
    try:
        return returns(got, *args)
    except Refused as r:
        fail(exercise, case, r.expected or expected, got, r.hint + FORGOT * (got is None))


def predicted(exercise: str, case: str, got, keys: Sequence, not_a_dict: str,
              not_whole: str) -> dict:
    """A prediction as a dict of Python ints with these keys, or CheckFailed."""
    if not isinstance(got, dict) or set(got) != set(keys):
        fail(exercise, case, f"a dict with the keys {list(keys)}",
             list(got) if isinstance(got, dict) else got, not_a_dict + FORGOT * (got is None))
    for key in keys:
        expect(as_int(got[key]) is not None, exercise, f"{case}: {key}", "an int", got[key],
               not_whole)
    return {key: as_int(got[key]) for key in keys}


def as_measured(exercise: str, case: str, got: dict, measured: dict, wrongs: Callable,
                said: str, otherwise: str, label: Callable = str) -> None:
    """Fail on the first prediction in `got` unlike `measured`, with the hint `said` filled in
    ({you}, {want}, {what}: label(key), {reason}: the hints of the usual wrong values
    `wrongs(key)` that it equals, joined, else `otherwise`)."""
    wrong = [key for key in measured if got[key] != measured[key]]
    if wrong:
        key = wrong[0]
        you, want = got[key], measured[key]
        reason = "; or ".join(dict.fromkeys(h for w, h in wrongs(key) if w == you != want))
        others = f" (and {len(wrong) - 1} more of your predictions)" if len(wrong) > 1 else ""
        fail(exercise, f"{case}: {label(key)}{others}", want, you,
             said.format(you=you, want=want, what=label(key), reason=reason or otherwise))


# --- exercises that return a value, checked from data (the recipe above) -------------------------

def kind(value) -> str:
    """What `value` is, for messages: 'a float', 'None', 'a tensor of shape (2, 3), ...'."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {value.dtype}"
    name = f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class Refused(Exception):
    """A return contract's refusal: the answer is not of the form the exercise asks for. `hint`
    says what to return; `expected` is what the message shows as expected (else the answer)."""

    def __init__(self, hint: str, expected=None):
        super().__init__(hint)
        self.hint, self.expected = hint, expected


def _as_is(got, *case):
    return got


def integer(hint: str = "return one Python int", float_hint: str = ""):
    """The contract "one int" (Python, numpy or 0-d torch; not a bool, not even 25.0)."""
    def coerce(got, *case):
        if as_int(got) is None:
            raise Refused(float_hint if float_hint and isinstance(got, float) else hint)
        return as_int(got)
    return coerce


def ints(n: int, hint: str, float_hint: str = ""):
    """The contract "n ints" (a list, tuple, 1-D integer tensor or array), coerced to a tuple."""
    def coerce(got, *case):
        values = int_list(got)
        if values is None or len(values) != n:
            floats = isinstance(got, (list, tuple)) and any(isinstance(v, float) for v in got)
            raise Refused(float_hint if float_hint and floats else hint)
        return tuple(values)
    return coerce


def one_of(*values, hint: str):
    """The contract "one of these values" (of the same type: True is not 1)."""
    def coerce(got, *case):
        if not any(type(got) is type(v) and got == v for v in values):
            raise Refused(hint)
        return got
    return coerce


def parts(hint: str | Callable, *contracts: Callable):
    """The contract "a tuple (or list) of these parts", each coerced by its contract,
    contract(part, *case), which returns None to refuse it; `hint` may be a function of the case."""
    def coerce(got, *case):
        said = hint(*case) if callable(hint) else hint
        if not isinstance(got, (list, tuple)) or len(got) != len(contracts):
            raise Refused(said)
        values = tuple(contract(part, *case) for contract, part in zip(contracts, got))
        if any(v is None for v in values):
            raise Refused(said)
        return values
    return coerce


def tensor(hint: str, shape=None, dtype: torch.dtype | None = None):
    """The contract "a torch tensor" of this dtype and shape (a tuple, or a function of the
    case's arguments)."""
    def coerce(got, *case):
        want = shape(*case) if callable(shape) else shape
        if not isinstance(got, torch.Tensor) or (dtype is not None and got.dtype != dtype) \
                or (want is not None and tuple(got.shape) != tuple(want)):
            words = ["a", "0-d" if want == () else "", str(dtype or "").replace("torch.", ""),
                     "tensor", f"of shape {tuple(want)}" if want else ""]
            raise Refused(hint, " ".join(w for w in words if w))
        return got
    return coerce


def diagnose(mistakes: dict, wrong: list, returns=_as_is, same=operator.eq) -> str:
    """The hint of the first mistake (hint -> wrong implementation) that reproduces every wrong
    answer in `wrong` ((case, answer) pairs): seeing them all tells apart mistakes that agree on
    one case. Else those reproducing the first wrong answer (two mistakes at once?), joined."""
    def gives(mistake, case, got) -> bool:
        try:
            return bool(same(returns(mistake(*case), *case), got))
        except Exception:  # noqa: BLE001 - a mistake that cannot run here reproduces nothing
            return False
    if not wrong:
        return ""
    for hint, mistake in mistakes.items():
        if all(gives(mistake, case, got) for case, got in wrong):
            return hint
    return "; or ".join(h for h, mistake in mistakes.items() if gives(mistake, *wrong[0]))


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:  # float64, abs and rel
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def expect_tensor(exercise: str, case: str, got, want: torch.Tensor, *, shape_words: str = "",
                  hints: dict | None = None, mistakes: dict | None = None, inputs: tuple = (),
                  same: Callable = close, values: str = "the reference's values") -> None:
    """The ladder every tensor answer climbs, each rung once: a tensor, then `want`'s shape, its
    dtype, no NaN, then `same(got, want)`. At the first rung it fails, CheckFailed names the
    mistake: the hint of the wrong implementation in `mistakes` (hint -> fn, called with
    `inputs`) that gives this answer, else `hints[rung]` (rungs: "tensor", "shape", "dtype",
    "nan", "close"), a string or a function of the answer that returns one. `shape_words` follows
    the shape in the message, e.g. " (B, n_head, T, hs)"; `values` names what was expected."""
    hints = hints or {}

    def hint(rung: str, default: str = "") -> str:
        said = hints.get(rung, default)
        return said(got) if callable(said) else said

    def named(rung: str, alike: Callable) -> str:
        found = diagnose(mistakes, [(inputs, got)], same=alike) if mistakes else ""
        return found or hint(rung)
    if not isinstance(got, torch.Tensor):
        fail(exercise, case, f"a torch tensor of shape {tuple(want.shape)}{shape_words}",
             kind(got), hint("tensor", "return one torch tensor")
             + (" (did you forget to return it?)" if got is None else ""))
    if got.shape != want.shape:  # a mistake with these wrong values (size-1 dims aside): its
        #                            hint; else one with this shape, else the shape's hint
        def squeezed(a, b) -> bool:  # `same` on other shapes may not run: then not alike
            try:
                return isinstance(a, torch.Tensor) and bool(same(a.squeeze(), b.squeeze()))
            except Exception:  # noqa: BLE001
                return False
        by_values = not squeezed(got, want) and named("", squeezed)
        fail(exercise, case, f"shape {tuple(want.shape)}{shape_words}", f"shape {tuple(got.shape)}",
             by_values or named("shape", lambda a, b: isinstance(a, torch.Tensor)
                                and a.shape == b.shape))
    if got.dtype != want.dtype:
        fail(exercise, case, f"dtype {want.dtype}", f"dtype {got.dtype}", hint("dtype"))
    if got.is_floating_point() and bool(got.isnan().any()):
        fail(exercise, case, "no NaN", "NaN in the answer", hint("nan"))
    if not same(got, want):  # a few integers shown as they are, more by how far they are off
        off = (got.double() - want.double()).abs().max()
        fail(exercise, case, values, f"values off by up to {off:.4g}"
             if got.is_floating_point() or got.numel() > 16 else got, named("close", same))


def hints(chapter: str) -> dict[str, dict[str, str]]:
    """A chapter's hints, checks/hints/<chapter>.toml: one table per exercise, one key per named
    mistake (or refusal), its hint as students read it; "{name}" marks a value the checker fills
    in with str.format."""
    with (HERE / "hints" / f"{chapter}.toml").open("rb") as f:
        return tomllib.load(f)


def named(table: dict[str, str], **wrong: Callable) -> dict[str, Callable]:
    """An Exercise's `mistakes` (hint -> wrong implementation), each wrong implementation given
    under its hint's key in `table` (hints(chapter)[exercise]), in order."""
    return {table[key]: fn for key, fn in wrong.items()}


def _unchanged(before, after) -> bool:
    if isinstance(before, torch.Tensor):
        return torch.equal(before, after)
    if isinstance(before, (tuple, list)):  # a tuple of tensors (a partial result)
        return (type(before) is type(after) and len(before) == len(after)
                and all(_unchanged(b, a) for b, a in zip(before, after)))
    return before == after


@dataclass(frozen=True, eq=False)
class Exercise:
    """An exercise whose function returns a value, as data: `check(fn)` calls fn(*case) for every
    case (a crash is a failed case naming the input), coerces each answer with the contract
    `returns(answer, *case)`, compares it with `reference(*case)` by `same`, and on the first
    case refused, crashed, changed in place or wrong, fails with the mistake that explains the
    wrong answers (`diagnose`), else `otherwise`; or prints "✓ name: all N cases pass"."""

    name: str
    cases: Sequence[tuple]          # the learner's arguments, one tuple per case
    describe: Callable[..., str]    # a case in words: describe(*case)
    reference: Callable             # the right answer, reference(*case), from the engine if it can
    returns: Callable = _as_is      # the contract: integer(), ints(2), one_of(...), tensor(...)
    mistakes: dict = field(default_factory=dict)  # hint -> wrong implementation, same signature
    otherwise: str | Callable = ""  # the hint when no mistake explains; or a function of every
    #                                 (case, answer) pair that returns it
    forbid: tuple = ()              # engine functions the learner's function must not call
    same: Callable = operator.eq    # does an answer match the reference? (torch.equal, allclose)
    show: Callable = _as_is         # a value as the message shows it
    explain: Callable | None = None  # words after the expected value: explain(*case)
    unchanged: str = ""             # if set, the hint when fn changes an argument in place
    raised: str | Callable = "your function raised on this input"  # or a function of the error
    solution: Callable | None = None  # a right answer in the learner's form, for the tests, when
    #                                   the reference calls a function that `forbid` forbids

    def check(self, fn) -> None:
        with torch.random.fork_rng(devices=[]), _one_thread():
            wants = self._wants  # before the learner's function runs: its cases are its own
            runs = [self._run(fn, case) for case in self.cases]
            wrong = [(case, got) for case, (got, refused), want in zip(self.cases, runs, wants)
                     if refused is None and not self.same(got, want)]
            for case, (got, refused), want in zip(self.cases, runs, wants):
                if refused is not None:
                    shown, answer, hint = refused
                    fail(self.name, self.describe(*case), shown or self.show(want), answer, hint)
                if not self.same(got, want):
                    expected = self.show(want)
                    if self.explain is not None:
                        expected = f"{expected!r}: {self.explain(*case)}"
                    hint = diagnose(self.mistakes, wrong, self.returns, self.same)
                    if not hint and callable(self.otherwise):
                        hint = self.otherwise([(c, g) for c, (g, r) in zip(self.cases, runs)
                                               if r is None])
                    fail(self.name, self.describe(*case), expected, self.show(got),
                         hint or self.otherwise)
        passed(self.name, len(self.cases))

    @functools.cached_property
    def _wants(self) -> list:
        return [self.reference(*case) for case in self.cases]

    def _run(self, fn, case: tuple):
        """(the answer coerced, None), or (None, (expected, answer, hint) to fail with)."""
        given = copy.deepcopy(case)  # fn may change its arguments: the next cases stay whole
        try:
            with forbid(self.name, *self.forbid):
                got = fn(*given)
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # noqa: BLE001 - any crash is a wrong answer for this case
            hint = self.raised(e) if callable(self.raised) else self.raised
            return None, ("a result", f"{type(e).__name__}: {e}", hint)
        try:
            value = self.returns(got, *case)
        except Refused as r:
            return None, (r.expected, got, r.hint + (" (did you forget to return it?)"
                                                     if got is None else ""))
        names = inspect.signature(self.reference).parameters if self.unchanged else ()
        for name, before, after in zip(names, case, given):
            if not _unchanged(before, after):
                return None, (f"{name} left as it was", f"{name} changed", self.unchanged)
        return value, None
