"""Checkers for chapter 05 (seed 001, deterministic requests: no rollback; seed 004's rollback
shape).

- choose: the token a request draws at a position must be a pure function of (logits, seed,
  position, temperature): the same in repeated calls interleaved with other random draws and in
  two simulated batch compositions, never touching the global RNG; different across positions and
  seeds; the argmax at temperature 0; and distributed as softmax(logits / temperature) over many
  seeds (a chi-square test with a generous threshold). A Python int.
- invariant_split_sum: the same float32 bits for every split count, and the fixed chunked
  schedule's bits.
- verify_schedule: against the counters of real `serve` runs on a tiny random model, as ints.

Each usual mistake is recognised by computing what it would give, and named in the hint. Everything
runs on the CPU in about a second and leaves the caller's random state alone.
"""
from __future__ import annotations

import math

import torch

from ...engine import GPT, Request, SamplingParams, serve
from . import (
    CheckFailed,
    as_int,
    call,
    expect,
    fail,
    forbid,
    guarded,
    one_thread,
    passed,
    tiny_model,
)

_MODELS: dict[str, GPT] = {}


def _tiny() -> GPT:
    """A small random GPT on the CPU whose greedy output wanders, built once, without touching the
    caller's RNG."""
    if "tiny" not in _MODELS:
        _MODELS["tiny"] = tiny_model(0)
    return _MODELS["tiny"]




def _kind(value) -> str:
    return f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")


def _a(value) -> str:
    """'a float', 'an int', 'a numpy.ndarray': the type of `value` with its article."""
    kind = _kind(value)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


# --- exercise 1: the same request draws the same tokens wherever it runs --------------------------

GLOBAL_RNG = ("this is what you get when you draw from torch's global RNG (torch.multinomial or "
              "torch.rand without generator=, or torch.manual_seed inside choose): every other "
              "draw in the server moves it, and yours move theirs; draw from a torch.Generator of "
              "your own, seeded from (seed, position)")
SHARED_GENERATOR = ("this is what you get with a generator shared across calls (created once, "
                    "outside choose): its state moves on with every draw, so a token depends on "
                    "what was drawn before it, i.e. on the batch; create a new generator in every "
                    "call, seeded from (seed, position) only")


def _logits(seed: int, vocab: int = 8, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def _choose_crash_hint(temperature):
    def hint(error: Exception) -> str:
        if temperature == 0:
            return ("at temperature 0 choose is greedy: return the argmax, draw nothing (dividing "
                    "by a temperature of 0 gives inf and nan)")
        if "probability tensor" in str(error) or "invalid multinomial" in str(error):
            return ("torch.multinomial takes probabilities, not logits: "
                    "softmax(logits / temperature) first")
        return "your function raised on this input"
    return hint


class _Chooser:
    """Calls the learner's choose and checks what every call must hold: a Python int in range,
    the logits left as they were, the global RNG untouched."""

    def __init__(self, name: str, choose):
        self.name, self.choose, self.calls = name, choose, 0

    def __call__(self, logits, seed, position, temperature, case=None) -> int:
        case = case or (f"logits of {logits.numel()} tokens, seed={seed}, position={position}, "
                        f"temperature={temperature}")
        given = logits.clone()
        state = torch.random.get_rng_state()
        try:
            got = self.choose(given, seed, position, temperature)
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # noqa: BLE001 - any crash is a wrong answer for this case
            fail(self.name, case, "a token id", f"{type(e).__name__}: {e}",
                 _choose_crash_hint(temperature)(e))
        self.calls += 1
        if not torch.equal(state, torch.random.get_rng_state()):
            fail(self.name, case, "the global RNG left alone", "the global RNG moved", GLOBAL_RNG)
        if not torch.equal(given, logits):
            fail(self.name, case, "the logits left as they were", "the logits changed",
                 "this is what you get with an in-place operation (logits /= temperature, "
                 "div_): it changes the caller's logits; compute a new tensor")
        if isinstance(got, bool) or not isinstance(got, int):
            fail(self.name, case, "a Python int", f"{got!r} ({_kind(got)})",
                 f"return the token id as a Python int (int(...)), not {_a(got)}")
        if not 0 <= got < logits.numel():
            fail(self.name, case, f"a token id in 0..{logits.numel() - 1}", got,
                 "return an index into the logits")
        return got


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs`."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


DRAWS = 2000
DIST_LOGITS = torch.tensor([1.0, 0.6, 0.2, 0.0, -0.3, -0.8])


@guarded
def check_choose(choose) -> None:
    """choose(logits, seed, position, temperature) -> a token id, a pure function of its inputs:
    the argmax at temperature 0, else a draw from softmax(logits / temperature) with a generator
    seeded from (seed, position) only."""
    name = "choose"
    pick = _Chooser(name, choose)
    n_cases = 0
    with forbid(name, SamplingParams.choose):
        # greedy: the argmax, whatever the seed and position
        for i in range(10):
            logits = _logits(100 + i, vocab=5 + 3 * i)
            want = int(logits.argmax())
            for temperature in (0, 0.0):
                got = pick(logits, i, 7 * i, temperature)
                expect(got == want, name, f"temperature {temperature!r}, logits "
                       f"{[round(x, 2) for x in logits.tolist()]}", want, got,
                       "at temperature 0 choose is greedy: return the argmax of the logits "
                       "(this is what you get when you sample at temperature 0 too)")
                n_cases += 1
        # the same inputs give the same token, whatever was drawn before and in between
        requests = [(_logits(i), 10 + i, 3 * i + 1, 1.0) for i in range(12)]
        first = [pick(*r) for r in requests]
        for i, r in enumerate(requests):
            torch.rand(5)                             # other users of the global RNG
            pick(_logits(50 + i), i, i, 0.8)          # other requests' draws
            again = pick(*r)
            expect(again == first[i], name, f"the same call twice (seed={r[1]}, position={r[2]}, "
                   f"temperature 1.0), other draws in between", first[i], again,
                   SHARED_GENERATOR)
            n_cases += 1
        # two batch compositions: request by request, then round-robin with a companion
        batch = [(_logits(200 + r), 1000 + r) for r in range(4)]
        alone = {(r, p): pick(batch[r][0], batch[r][1], p, 1.0)
                 for r in range(len(batch)) for p in range(6)}
        for p in range(6):
            for r in reversed(range(len(batch))):
                pick(_logits(300 + p), 77, p, 1.3)    # a companion request in the batch
                got = pick(batch[r][0], batch[r][1], p, 1.0)
                expect(got == alone[r, p], name,
                       f"request {r} (seed={batch[r][1]}) at position {p}, in another batch",
                       alone[r, p], got, SHARED_GENERATOR)
                n_cases += 1
        # different positions and seeds draw differently
        flat = _logits(400, vocab=16, scale=0.3)
        by_position = {s: [pick(flat, s, p, 1.0) for p in range(40)] for s in (0, 1, 2, 5)}
        by_seed = [pick(flat, s, 3, 1.0) for s in range(40)]
        n_cases += 4 * 40 + 40
        everything = by_seed + [t for tokens in by_position.values() for t in tokens]
        argmax = int(flat.argmax())
        if all(t == argmax for t in everything):
            fail(name, "logits of 16 tokens with nearly equal values, temperature 1.0, 40 seeds "
                 "and 40 positions", "draws spread over the tokens", f"always {argmax}, the argmax",
                 "at temperature > 0 choose must DRAW from softmax(logits / temperature), not "
                 "take the argmax")
        for s, tokens in by_position.items():
            expect(len(set(tokens)) >= 4, name, f"seed={s}, positions 0..39, temperature 1.0, "
                   f"nearly equal logits", "different draws at different positions",
                   tokens, "this is what you get when the generator is seeded by the seed alone: "
                   "every position then draws the same random number; seed it from (seed, "
                   "position)")
        expect(len(set(by_seed)) >= 4, name, "seeds 0..39 at position 3, temperature 1.0, nearly "
               "equal logits", "different draws for different seeds", by_seed,
               "this is what you get when the generator is seeded by the position alone: every "
               "request then draws the same numbers; seed it from (seed, position)")
        for s in (0, 1):
            shifted = [pick(flat, s + 1, p, 1.0) for p in range(39)]
            n_cases += 39
            expect(shifted != by_position[s][1:], name,
                   f"seed={s + 1} at positions 0..38 vs seed={s} at positions 1..39",
                   "two different streams", "the same tokens, shifted by one position",
                   "this is what you get with seed + position: request seed 1 at position p draws "
                   "what request seed 0 draws at p + 1; mix them so that different pairs get "
                   "different seeds, e.g. seed * 1_000_003 + position")
        # the draws follow softmax(logits / temperature)
        for temperature in (0.5, 1.0, 2.0):
            counts = torch.zeros(DIST_LOGITS.numel())
            for i in range(DRAWS):
                counts[pick(DIST_LOGITS, i, i % 13, temperature)] += 1
            n_cases += DRAWS
            case = (f"{DRAWS} draws (seeds 0..{DRAWS - 1}) from logits {DIST_LOGITS.tolist()} at "
                    f"temperature {temperature}")
            want = torch.softmax(DIST_LOGITS.double() / temperature, -1)
            if _chi_square_p(counts, want) < 1e-6:
                hint = "draw from softmax(logits / temperature)"
                if _chi_square_p(counts, torch.softmax(DIST_LOGITS.double(), -1)) > 1e-4:
                    hint = ("this is what you get when you ignore the temperature: divide the "
                            "logits by it before the softmax")
                elif _chi_square_p(counts, torch.softmax(DIST_LOGITS.double() * temperature,
                                                         -1)) > 1e-4:
                    hint = ("this is what you get when you multiply the logits by the "
                            "temperature: divide them by it (a higher temperature flattens)")
                fail(name, case, f"frequencies near {[round(x, 3) for x in want.tolist()]}",
                     [round(x, 3) for x in (counts / DRAWS).tolist()], hint)
    passed(name, n_cases)


# --- exercise 2: a batch-invariant sum ------------------------------------------------------------

def _fixed_schedule_sum(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The one schedule: chunk sums x[i:i+chunk].sum(), added left to right."""
    sums = [x[i:i + chunk].sum() for i in range(0, x.numel(), chunk)]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total


def _split_sum_mistakes(x: torch.Tensor, n_splits: int, chunk: int) -> list[tuple[float, str]]:
    """The bits the usual wrong schedules give, each with the mistake that gives it."""
    n = x.numel()
    size = math.ceil(n / n_splits)
    equal_pieces = torch.zeros((), dtype=x.dtype)
    for w in range(n_splits):
        equal_pieces = equal_pieces + x[w * size:(w + 1) * size].sum()
    chunk_sums = [x[i:i + chunk].sum() for i in range(0, n, chunk)]
    per_worker = math.ceil(len(chunk_sums) / n_splits)
    worker_totals = [sum(chunk_sums[w * per_worker:(w + 1) * per_worker], torch.zeros(()))
                     for w in range(n_splits) if chunk_sums[w * per_worker:(w + 1) * per_worker]]
    totals = worker_totals[0]
    for t in worker_totals[1:]:
        totals = totals + t
    full = n // chunk * chunk
    mistakes = [
        (totals, "this is what you get when each worker returns the total of its chunks: how "
                 "the chunk sums are grouped then follows n_splits; workers return their chunk "
                 "sums, and the merge adds them one by one"),
        (torch.stack(chunk_sums).sum(), "this is what you get when you merge with "
                                        "torch.stack(...).sum(): torch adds in its own order; add "
                                        "the chunk sums one by one, from left to right"),
        (x.sum(), "this is what you get with x.sum(): its bits do not depend on n_splits here, "
                  "but it is torch's own order (it may change with the length, the CPU or the "
                  "threads), not the fixed schedule"),
    ]
    if n_splits > 1:  # in one piece it is x.sum(), named above
        mistakes.insert(0, (equal_pieces, "this is what you get when you cut x into n_splits "
                                          "equal pieces, as split-KV attention does: the pieces, "
                                          "and so the order of the additions, follow n_splits; "
                                          "fix the chunk SIZE instead"))
    if full < n:
        mistakes.append((_fixed_schedule_sum(x[:full], chunk) if full else torch.zeros(()),
                         "this is what you get when you drop the last, shorter chunk: every "
                         "element is summed once"))
    return [(float(v), h) for v, h in mistakes]


@guarded
def check_invariant_split_sum(invariant_split_sum) -> None:
    """invariant_split_sum(x, n_splits, chunk) is the same float32 bits for every n_splits, and the
    fixed schedule's."""
    name = "invariant_split_sum"
    g = torch.Generator().manual_seed(0)
    vectors = []
    for n, chunk in [(1, 16), (15, 16), (16, 16), (17, 16), (100, 16), (257, 16), (1000, 16),
                     (4096, 16), (103, 5)]:
        # magnitudes from 1e-3 to 1e3: the summation order shows in the last bits
        x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3)
        vectors.append((x.float(), chunk))
    splits = [1, 2, 3, 4, 7, 8, 13, 64]
    n_cases = 0
    for x, chunk in vectors:
        want = _fixed_schedule_sum(x, chunk)
        first = None
        for n_splits in splits:
            case = f"x of {x.numel()} float32 values, chunk={chunk}, n_splits={n_splits}"
            given = x.clone()
            got = call(name, case, invariant_split_sum, given, n_splits, chunk)
            if not (isinstance(got, torch.Tensor) and got.dim() == 0
                    and got.dtype == torch.float32):
                shape = (f"a {got.dtype} tensor of shape {tuple(got.shape)}"
                         if isinstance(got, torch.Tensor) else f"a {_kind(got)}")
                fail(name, case, "a 0-d float32 tensor", f"{got!r} ({shape})",
                     "return the sum as a 0-d float32 tensor, as the chunks' .sum() gives it "
                     "(no float(), no .item(), no float64)")
            if not torch.equal(given, x):
                fail(name, case, "x left as it was", "x changed",
                     "this is what you get with in-place operations on x; compute new tensors")
            if not torch.equal(got, want):
                hints = dict.fromkeys(h for v, h in _split_sum_mistakes(x, n_splits, chunk)
                                      if v == float(got) and v != float(want))
                if not hints and first is not None and not torch.equal(got, first):
                    hints = {"your result depends on the number of splits: fix the chunk size, "
                             "never the chunk count, and merge the chunk sums in one fixed "
                             "order": None}
                fail(name, case, float(want), float(got), "; or ".join(hints) or
                     "the fixed schedule: chunk sums x[i:i+chunk].sum() for i = 0, chunk, "
                     "2*chunk, ..., added one by one from left to right")
            first = got if first is None else first
            n_cases += 1
    passed(name, n_cases)


# --- exercise 3: how many verifier passes and fast steps ------------------------------------------

def _schedule_mistakes(n: int, window: int) -> list[tuple[tuple[int, int], str]]:
    rounds = math.ceil((n - 1) / window)
    return [
        ((math.ceil(n / window), n - math.ceil(n / window)),
         "this is what you get when you forget the prefill: it gives the first new token T₀ by "
         "itself, so only max_new_tokens - 1 tokens are left to the windows"),
        (((n - 1) // window, n - 1 - (n - 1) // window),
         "this is what you get when you round the number of passes down: a last, partial window "
         "needs a pass of its own (round up)"),
        ((rounds, n - 1),
         "this is what you get when every token after T₀ counts as a fast step: each round's "
         "own token comes from the verifier, so fast steps + rounds = max_new_tokens - 1"),
        ((rounds, n - rounds),
         "this is what you get when the prefill's token T₀ counts as a fast step: fast steps + "
         "rounds = max_new_tokens - 1 (nothing rejected)"),
        ((rounds, rounds * (window - 1)),
         "this is what you get when every window is full: the last may hold fewer proposals, as "
         "the request stops at max_new_tokens"),
    ]


@one_thread
@guarded
def check_verify_schedule(verify_schedule) -> None:
    """verify_schedule(max_new_tokens, window) -> (rounds, fast_steps), ints, against real serve()
    counters."""
    name = "verify_schedule"
    model = _tiny()
    others = [Request([11, 12, 13], 9, temperature=1.0, seed=1),
              Request([20, 21], 25, temperature=1.0, seed=2)]
    # (9, 4) first: it tells most of the usual mistakes apart; max_new_tokens = 1 is left out
    cases = [(9, 4), (30, 4), (2, 4), (4, 4), (5, 4), (6, 4), (10, 4), (13, 4), (10, 1), (7, 2),
             (2, 1), (8, 3), (20, 8), (5, 16), (33, 16)]
    for n, window in cases:
        with torch.inference_mode():
            out = serve(model, [Request([1, 2, 3, 4], n, deterministic=True)] + others,
                        window=window)[0]
        assert out.stats.rollbacks == 0, ("checker case with a rollback: "
                                          "the formula only holds without rollbacks")
        want = (out.stats.rounds, out.stats.fast_steps)
        case = f"max_new_tokens={n}, window={window}"
        got = call(name, case, verify_schedule, n, window)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            fail(name, case, want, got, f"return a pair (rounds, fast_steps), not {_a(got)}"
                 + (f" of {len(got)}" if isinstance(got, (tuple, list)) else ""))
        values = tuple(as_int(v) for v in got)
        if None in values:
            bad = next(v for v, i in zip(got, values) if i is None)
            fail(name, case, want, got, f"both counts are ints, not {bad!r} ({_kind(bad)}): "
                 f"use integer arithmetic (//, math.ceil gives an int), no float()")
        if values != want:
            hints = dict.fromkeys(h for wrong, h in _schedule_mistakes(n, window)
                                  if wrong == values and wrong != want)
            fail(name, case, want, values, "; or ".join(hints) or
                 "the prefill gives the first new token for free; each verifier pass commits a "
                 "whole window (window - 1 fast-path proposals + the verifier's own token), the "
                 "last pass maybe fewer")
    passed(name, len(cases))
