"""Checkers for chapter 05 (seed 001, deterministic requests), compared with the engine at run
time, on the CPU, leaving the caller's random state alone: choose, predict_server_passes and
verify_window (code), invariant_split_sum, verify_schedule and choose_determinism (tables)."""
from __future__ import annotations

import functools
import math
from functools import partial

import torch

from ...engine import GPT, KVCache, Request, SamplingParams, serve
from ...engine.verify import accept_matching, verify_and_commit
from . import (
    Exercise,
    Refused,
    as_int,
    call,
    call_hinted,
    chi_square_p,
    diagnose,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    kind,
    one_of,
    one_thread,
    passed,
    prediction,
    tensor,
    tiny_model,
)

_tiny = functools.cache(lambda: tiny_model(0))  # a small random GPT whose greedy output wanders


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
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _chooser(name: str, choose):
    """The learner's choose, each call checked: an int in range, logits and global RNG untouched."""
    def pick(logits, seed, position, temperature) -> int:
        case = (f"logits of {logits.numel()} tokens, seed={seed}, position={position}, "
                f"temperature={temperature}")
        given, state = logits.clone(), torch.random.get_rng_state()
        got = call_hinted(name, case, lambda e: (
            "at temperature 0 choose is greedy: return the argmax, draw nothing (dividing by a "
            "temperature of 0 gives inf and nan)" if temperature == 0 else "torch.multinomial "
            "takes probabilities, not logits: softmax(logits / temperature) first" if (
                "probability tensor" in str(e) or "invalid multinomial" in str(e)) else
            "your function raised on this input"), choose, given, seed, position, temperature)
        if not torch.equal(state, torch.random.get_rng_state()):
            fail(name, case, "the global RNG left alone", "the global RNG moved", GLOBAL_RNG)
        if not torch.equal(given, logits):
            fail(name, case, "the logits left as they were", "the logits changed",
                 "this is what you get with an in-place operation (logits /= temperature, "
                 "div_): it changes the caller's logits; compute a new tensor")
        if isinstance(got, bool) or not isinstance(got, int):
            fail(name, case, "a Python int", f"{got!r} ({kind(got)})",
                 f"return the token id as a Python int (int(...)), not {kind(got)}")
        if not 0 <= got < logits.numel():
            fail(name, case, f"a token id in 0..{logits.numel() - 1}", got,
                 "return an index into the logits")
        return got
    return pick


DRAWS = 2000
DIST_LOGITS = torch.tensor([1.0, 0.6, 0.2, 0.0, -0.3, -0.8])


@guarded
def check_choose(choose) -> None:
    """choose(logits, seed, position, temperature) -> a token id: the argmax at temperature 0, else
    a draw from softmax(logits / temperature) by a generator seeded from (seed, position) only."""
    name, n_cases = "choose", 0
    pick = _chooser(name, choose)
    with forbid(name, SamplingParams.choose):
        # greedy: the argmax, whatever the seed and position
        for i in range(10):
            logits = _logits(100 + i, vocab=5 + 3 * i)
            for temperature in (0, 0.0):
                got, n_cases = pick(logits, i, 7 * i, temperature), n_cases + 1
                expect(got == int(logits.argmax()), name, f"temperature {temperature!r}, logits "
                       f"{[round(x, 2) for x in logits.tolist()]}", int(logits.argmax()), got,
                       "at temperature 0 choose is greedy: return the argmax of the logits "
                       "(this is what you get when you sample at temperature 0 too)")
        # the same inputs give the same token, whatever was drawn before and in between
        requests = [(_logits(i), 10 + i, 3 * i + 1, 1.0) for i in range(12)]
        first = [pick(*r) for r in requests]
        for i, r in enumerate(requests):
            torch.rand(5)                             # other users of the global RNG
            pick(_logits(50 + i), i, i, 0.8)          # other requests' draws
            again, n_cases = pick(*r), n_cases + 1
            expect(again == first[i], name, f"the same call twice (seed={r[1]}, position={r[2]}, "
                   f"temperature 1.0), other draws in between", first[i], again,
                   SHARED_GENERATOR)
        # two batch compositions: request by request, then round-robin with a companion
        batch = [(_logits(200 + r), 1000 + r) for r in range(4)]
        alone = {(r, p): pick(*batch[r], p, 1.0) for r in range(len(batch)) for p in range(6)}
        for p in range(6):
            for r in reversed(range(len(batch))):
                pick(_logits(300 + p), 77, p, 1.3)    # a companion request in the batch
                got, n_cases = pick(*batch[r], p, 1.0), n_cases + 1
                expect(got == alone[r, p], name,
                       f"request {r} (seed={batch[r][1]}) at position {p}, in another batch",
                       alone[r, p], got, SHARED_GENERATOR)
        # different positions and seeds draw differently
        flat = _logits(400, vocab=16, scale=0.3)
        by_position = {s: [pick(flat, s, p, 1.0) for p in range(40)] for s in (0, 1, 2, 5)}
        by_seed = [pick(flat, s, 3, 1.0) for s in range(40)]
        n_cases += 4 * 40 + 40
        argmax = int(flat.argmax())
        if all(t == argmax for t in by_seed + sum(by_position.values(), [])):
            fail(name, "logits of 16 tokens with nearly equal values, temperature 1.0, 40 seeds "
                 "and 40 positions", "draws spread over the tokens", f"always {argmax}, the argmax",
                 "at temperature > 0 choose must DRAW from softmax(logits / temperature), not "
                 "take the argmax")
        for s, tokens in by_position.items():
            expect(len(set(tokens)) >= 4, name, f"seed={s}, positions 0..39, temperature 1.0, "
                   f"nearly equal logits", "different draws at different positions",
                   tokens, "this is what you get with seed * position: request seed 0 then draws "
                   "the same number at every position" if s == 0 and len(set(by_position[1])) >= 4
                   else "this is what you get when the generator is seeded by the seed alone: "
                   "every position then draws the same random number; seed it from (seed, "
                   "position)")
        expect(len(set(by_seed)) >= 4, name, "seeds 0..39 at position 3, temperature 1.0, nearly "
               "equal logits", "different draws for different seeds", by_seed,
               "this is what you get when the generator is seeded by the position alone: every "
               "request then draws the same numbers; seed it from (seed, position)")
        for s in (0, 1):
            shifted, n_cases = [pick(flat, s + 1, p, 1.0) for p in range(39)], n_cases + 39
            expect(shifted != by_position[s][1:], name,
                   f"seed={s + 1} at positions 0..38 vs seed={s} at positions 1..39",
                   "two different streams", "the same tokens, shifted by one position",
                   "this is what you get with seed + position: request seed 1 at position p draws "
                   "what request seed 0 draws at p + 1; mix them so that different pairs get "
                   "different generator seeds")
        # mixes that give two (seed, position) pairs below one million the same generator seed:
        # with 16 nearly equal logits, 40 independent pairs agree by chance about 16^-40 of the time
        at_zero, n_cases = [pick(flat, s, 0, 1.0) for s in range(40)], n_cases + 40
        expect(len(set(at_zero)) >= 4, name, "seeds 0..39 at position 0, temperature 1.0, nearly "
               "equal logits", "different draws for different seeds", at_zero,
               "this is what you get with seed * position (or any mix where position 0 cancels "
               "the seed): at position 0 every request then draws the same number")
        collisions = [(
            "40 pairs: seed s at position p against seed p at position s",
            [((s, s + 3 + s % 5), (s + 3 + s % 5, s)) for s in range(40)],
            "this is what you get with a mix that is symmetric in seed and position (seed + "
            "position, seed * position, seed ^ position): request seed 2 at position 5 then "
            "draws what request seed 5 draws at position 2")] + [(
                f"40 pairs: seed s + 1 at position p against seed s at position p + {k:,}",
                [((s + 1, 7 * s), (s, 7 * s + k)) for s in range(40)],
                f"this is what you get with seed * {k:,} + position: request seed 1 at position "
                f"p draws what request seed 0 draws at position p + {k:,}, and requests grow "
                f"that long; positions below one million must never reach the next seed's "
                f"numbers (a multiplier above 1,000,000), or mix the pair another way")
            for k in (10, 100, 1_000, 10_000, 100_000)]
        for case, pairs, hint in collisions:
            n_cases += 2 * len(pairs)
            if all(pick(flat, *a, 1.0) == pick(flat, *b, 1.0) for a, b in pairs):
                fail(name, case, "different draws", "the same draws, pair after pair", hint)
        # the draws follow softmax(logits / temperature)
        for temperature in (0.5, 1.0, 2.0):
            counts = torch.zeros(DIST_LOGITS.numel())
            for i in range(DRAWS):
                counts[pick(DIST_LOGITS, i, i % 13, temperature)] += 1
            n_cases += DRAWS
            want = torch.softmax(DIST_LOGITS.double() / temperature, -1)
            if chi_square_p(counts, want) < 1e-6:
                def alike(scaled: torch.Tensor) -> bool:  # drawn from softmax(scaled)?
                    return chi_square_p(counts, torch.softmax(scaled, -1)) > 1e-4
                fail(name, f"{DRAWS} draws (seeds 0..{DRAWS - 1}) from logits "
                     f"{DIST_LOGITS.tolist()} at temperature {temperature}",
                     f"frequencies near {[round(x, 3) for x in want.tolist()]}",
                     [round(x, 3) for x in (counts / DRAWS).tolist()],
                     "this is what you get when you ignore the temperature: divide the logits by "
                     "it before the softmax" if alike(DIST_LOGITS.double()) else
                     "this is what you get when you multiply the logits by the temperature: "
                     "divide them by it (a higher temperature flattens)" if alike(
                         DIST_LOGITS.double() * temperature) else
                     "draw from softmax(logits / temperature)")
    passed(name, n_cases)


# --- exercise 2: a batch-invariant sum ------------------------------------------------------------

def _chunk_sums(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [x[i:i + chunk].sum() for i in range(0, x.numel(), chunk)]


def fixed_schedule_sum(x: torch.Tensor, n_splits: int, chunk: int) -> torch.Tensor:
    """The one schedule, whatever n_splits: chunk sums x[i:i+chunk].sum(), added left to right."""
    sums = _chunk_sums(x, chunk)
    return sum(sums[1:], sums[0])


def _equal_pieces(x: torch.Tensor, n_splits: int, chunk: int) -> torch.Tensor:
    size = math.ceil(x.numel() / n_splits)
    return sum((x[w * size:(w + 1) * size].sum() for w in range(n_splits)), torch.zeros(()))


def _worker_totals(x: torch.Tensor, n_splits: int, chunk: int) -> torch.Tensor:
    sums = _chunk_sums(x, chunk)
    per = math.ceil(len(sums) / n_splits)
    totals = [sum(sums[w * per:(w + 1) * per], torch.zeros(())) for w in range(n_splits)
              if sums[w * per:(w + 1) * per]]
    return sum(totals[1:], totals[0])


def _split_sum_otherwise(answers) -> str:
    """The hint when no usual mistake explains the sums: do they change with n_splits?"""
    bits: dict[int, set] = {}
    for (x, _, _), got in answers:
        bits.setdefault(id(x), set()).add(got.view(torch.int32).item())
    return ("your result depends on the number of splits: fix the chunk size, never the chunk "
            "count, and merge the chunk sums in one fixed order" if any(
                len(values) > 1 for values in bits.values()) else "the fixed schedule: chunk sums "
            "x[i:i+chunk].sum() for i = 0, chunk, 2*chunk, ..., added one by one from left to "
            "right")


def _vectors() -> list[tuple[torch.Tensor, int]]:
    """(x, chunk): magnitudes from 1e-3 to 1e3, so the summation order shows in the last bits."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3), chunk)
            for n, chunk in [(1, 16), (15, 16), (16, 16), (17, 16), (100, 16), (257, 16),
                             (1000, 16), (4096, 16), (103, 5)]]


SPLIT_SUM = Exercise(
    "invariant_split_sum",
    cases=[(x, n_splits, chunk) for x, chunk in _vectors()
           for n_splits in (1, 2, 3, 4, 7, 8, 13, 64)],
    describe=lambda x, n_splits, chunk: (f"x of {x.numel()} float32 values, chunk={chunk}, "
                                         f"n_splits={n_splits}"),
    reference=fixed_schedule_sum,
    returns=tensor("return the sum as a 0-d float32 tensor, as the chunks' .sum() gives it (no "
                   "float(), no .item(), no float64)", shape=(), dtype=torch.float32),
    same=torch.equal, show=float,
    unchanged="this is what you get with in-place operations on x; compute new tensors",
    mistakes={
        "this is what you get when you cut x into n_splits equal pieces, as split-KV attention "
        "does: the pieces, and so the order of the additions, follow n_splits; fix the chunk "
        "SIZE instead": _equal_pieces,
        "this is what you get when each worker returns the total of its chunks: how the chunk "
        "sums are grouped then follows n_splits; workers return their chunk sums, and the merge "
        "adds them one by one": _worker_totals,
        "this is what you get when you merge with torch.stack(...).sum(): torch adds in its own "
        "order; add the chunk sums one by one, from left to right":
            lambda x, n_splits, chunk: torch.stack(_chunk_sums(x, chunk)).sum(),
        "this is what you get with x.sum(): its bits do not depend on n_splits here, but it is "
        "torch's own order (it may change with the length, the CPU or the threads), not the "
        "fixed schedule": lambda x, n_splits, chunk: x.sum(),
        "this is what you get when you drop the last, shorter chunk: every element is summed "
        "once": lambda x, n_splits, chunk: torch.zeros(()) if x.numel() < chunk else
            fixed_schedule_sum(x[:x.numel() // chunk * chunk], n_splits, chunk),
    },
    otherwise=_split_sum_otherwise)
check_invariant_split_sum = SPLIT_SUM.check


# --- exercise 3: the verifier's schedule ----------------------------------------------------------

def reference_schedule(n: int, window: int) -> list[tuple[int, int]]:
    """(first, proposals) of every verifier pass of a request with n new tokens and no rollback: it
    replays new token `first` (T₀ is 0), judges the proposals after it, then adds its own token."""
    passes, first = [], 0
    while first < n - 1:
        k = min(window - 1, n - 2 - first)
        passes.append((first, k))
        first += k + 1
    return passes


def served_schedule(n: int, window: int) -> list[tuple[int, int]]:
    """(first, proposals) of the verifier passes serve() runs for a deterministic request of n new
    tokens served with two sampled ones (the tables' test compares it with reference_schedule)."""
    prompt = [1, 2, 3, 4]
    requests = [Request(prompt, n, deterministic=True),
                Request([11, 12, 13], 9, temperature=1.0, seed=1),
                Request([20, 21], 25, temperature=1.0, seed=2)]
    with torch.inference_mode():
        out = serve(_tiny(), requests, window=window, trace=True)[0]
    return [(e.cache_len_before - len(prompt), len(e.input_ids))
            for e in out.trace if e.kind == "verify"]


def _pass_list(got, *case) -> list[tuple[int, int]]:
    """The contract: a list of (int, int) pairs (a 2-D array or tensor will do)."""
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        got = got.tolist() if got.ndim == 2 else got
    pairs = [int_list(p) for p in got] if isinstance(got, (list, tuple)) else [None]
    if any(p is None or len(p) != 2 for p in pairs):
        counts = isinstance(got, (tuple, list)) and len(got) == 2 and all(
            as_int(v) is not None for v in got)
        raise Refused("return the list of passes, one (first, proposals) pair each, not the counts"
                      if counts else "return a list of (first, proposals) pairs of ints")
    return [tuple(p) for p in pairs]


SCHEDULE = Exercise(
    "verify_schedule",
    # (10, 4) first: it tells most of the usual mistakes apart; max_new_tokens = 1 is left out
    cases=[(10, 4), (9, 4), (30, 4), (2, 4), (4, 4), (5, 4), (6, 4), (13, 4), (10, 1), (7, 2),
           (2, 1), (8, 3), (20, 8), (5, 16), (33, 16)],
    describe=lambda n, window: f"max_new_tokens={n}, window={window}",
    reference=served_schedule, solution=reference_schedule, returns=_pass_list, forbid=(serve,),
    mistakes={
        "this is what you get when every pass judges window - 1 proposals: the last may judge "
        "fewer, as the request stops at max_new_tokens (the pass's own token is the last one)":
            lambda n, window: [(f, window - 1) for f, _ in reference_schedule(n, window)],
        "this is what you get when you leave out the last, partial window: the tokens after the "
        "last full window still need a verifier pass (round the count up, not down)":
            lambda n, window: [p for p in reference_schedule(n, window) if p[1] == window - 1],
        "this is what you get when you forget the prefill: it gives T₀ by itself, so the windows "
        "cover the other max_new_tokens - 1 tokens only":
            lambda n, window: reference_schedule(n + 1, window),
        "`first` is the token the pass replays first: the last committed token (T₀ for the first "
        "pass), not the first proposal":
            lambda n, window: [(f + 1, k) for f, k in reference_schedule(n, window)],
        "this counts the pass's own token as a proposal: a pass of `window` rows replays one "
        "committed token and judges window - 1 proposals, then adds its own token":
            lambda n, window: [(f, k + 1) for f, k in reference_schedule(n, window)],
        "this is what you get with window proposals per pass: a pass has `window` rows, the first "
        "being the last committed token": lambda n, window: reference_schedule(n, window + 1),
    },
    otherwise="the prefill gives T₀; each pass replays the last committed token, judges the fast "
              "path's proposals after it (window - 1 at most, fewer if the budget ends first) and "
              "adds its own token; the next pass starts at that token")
check_verify_schedule = SCHEDULE.check


# --- exercise 4 (predict, then measure): what verification costs the server -----------------------

SERVER_PROMPTS = ((1, 2, 3, 4, 5), (11, 12, 13), (20, 21, 22, 23, 24, 25, 26), (40, 41))
SERVER_NEW, SERVER_WINDOW = 20, 4
PREDICT_D = (0, 1, 4)
STEPS = SERVER_NEW - 1                          # decode steps after the prefill
ROUNDS = math.ceil(STEPS / SERVER_WINDOW)       # verifier windows of a deterministic request


def server_passes(n_det: int, prompts: tuple = SERVER_PROMPTS) -> int:
    """Forward passes the server runs after the prefills (batched fast-path steps and verifier
    passes) when the first n_det of the requests are deterministic, measured on a tiny model."""
    requests = [Request(list(p), SERVER_NEW, deterministic=i < n_det)
                for i, p in enumerate(prompts)]
    with torch.inference_mode():
        outs = serve(_tiny(), requests, window=SERVER_WINDOW, trace=True)
    batched = {e.step for o in outs for e in o.trace if e.kind == "decode"}
    return len(batched) + sum(e.kind == "verify" for o in outs for e in o.trace)


_measured = functools.cache(server_passes)  # the checkers' copy: a learner's call still runs serve
_N = len(SERVER_PROMPTS)
# hint -> the passes a prediction with that mistake gives when d of the requests are deterministic
PASSES_MISTAKES = {
    "the prefill gives every request its first token: 19 decode steps make the other 19":
        lambda d: SERVER_NEW + d * ROUNDS if d < _N else SERVER_NEW - ROUNDS + d * ROUNDS,
    "one batched pass serves every request at once: count passes, not rows": lambda d: _N * STEPS,
    "verification is not free: each verifier pass replays one request alone, a pass of its own":
        lambda d: STEPS,
    "the last window is partial (19 tokens after T₀ are 4 windows of 4 and one of 3): it needs a "
    "verifier pass too": lambda d: STEPS + d * (STEPS // SERVER_WINDOW),
    "when EVERY request is verified at the same step, no batched pass runs at that step: the "
    "verifier passes replace the batched ones there, instead of adding to them":
        lambda d: STEPS + d * ROUNDS,
    "the verifier replays each deterministic request ALONE (batch 1, a fixed shape): one pass per "
    "request per window, not one for all of them": lambda d: STEPS + ROUNDS,
}


@one_thread
@guarded
def check_predict_server_passes(predict_server_passes) -> None:
    """predict_server_passes() -> {0: ..., 1: ..., 4: ...}: the server's forward passes after the
    prefills for 4 requests of 20 new tokens, window 4, the first d deterministic; measured."""
    name = "predict_server_passes"
    case = (f"{len(SERVER_PROMPTS)} greedy requests of {SERVER_NEW} new tokens served together, "
            f"window={SERVER_WINDOW}, the first d deterministic")
    got = prediction(name, case, predict_server_passes, serve, GPT.forward)
    if not isinstance(got, dict) or sorted(got) != list(PREDICT_D):
        fail(name, case, f"a dict with the keys {list(PREDICT_D)} (d)",
             sorted(got) if isinstance(got, dict) else got,
             "return your predictions as {0: ..., 1: ..., 4: ...}, one int per number of "
             "deterministic requests" + (" (did you forget to return it?)" if got is None else ""))
    for d in PREDICT_D:
        expect(as_int(got[d]) is not None, name, f"{case}, d = {d}", "an int", got[d],
               "a count of passes is a whole number")
    measured = {d: _measured(d) for d in PREDICT_D}
    wrong = [((d,), as_int(got[d])) for d in PREDICT_D if as_int(got[d]) != measured[d]]
    if wrong:
        (d,), you = wrong[0]
        reason = diagnose(PASSES_MISTAKES, wrong) or (
            "step by step: after the prefills, every step runs one batched pass for the requests "
            "that are not being verified (if any), and one verifier pass for each request whose "
            "window is full")
        fail(name, f"{case}, d = {d}", measured[d], you,
             f"you predicted {you} passes; the engine ran {measured[d]}: {reason}")
    print("  measured: " + ", ".join(f"d = {d}: {measured[d]} passes" for d in PREDICT_D)
          + f" (d = 2: {_measured(2)}, d = 3: {_measured(3)})")
    passed(name, len(PREDICT_D))


# --- exercise 5 (debug): a verifier window --------------------------------------------------------

def verify_window_buggy(model, seq, proposals, cache, sampling, start, window):
    """The notebook's broken verifier, verbatim: the token it draws to judge a position is drawn
    with the position of the row's INPUT token, one too early (greedy cannot tell)."""
    rows = seq[start:] + proposals
    cache.crop(min(cache.get_seq_length(), start))
    padded = rows + [0] * (window - len(rows))
    logits = model(torch.tensor([padded], device=model.device), cache=cache)[0]
    cache.crop(start + len(rows))
    first = len(seq) - 1 - start               # the row that scores proposals[0]
    accepted = 0
    while accepted < len(proposals):
        mine = sampling.choose(logits[first + accepted], len(seq) + accepted - 1)
        if mine != proposals[accepted]:
            break
        accepted += 1
    token = sampling.choose(logits[first + accepted], len(seq) + accepted - 1)
    seq.extend(proposals[:accepted] + [token])
    cache.crop(min(cache.get_seq_length(), len(seq) - 1))
    return accepted


def _engine_window(model, seq, proposals, cache, sampling, start, window):
    """The engine's verify-and-commit core on the same inputs (the reference)."""
    return verify_and_commit(
        seq, list(proposals), cache,
        lambda rows, c: model(torch.tensor([rows], device=model.device), cache=c)[0],
        partial(accept_matching, sampling=sampling, first_position=len(seq)),
        start=start, rows=window).verdict.accepted


def _window_case(model, prompt, n_committed, window, sampling, corrupt):
    """(seq, proposals, cache, start) of a request mid-decode, as the verifier finds it: the fast
    path proposed the rest of the window (the verifier's own draws, or with proposal `corrupt`
    changed), and its cache holds K/V of every token the fast path fed."""
    cache = KVCache.for_model(model, max_len=len(prompt) + n_committed + 2 * window + 2)
    seq = list(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([seq]), cache=cache)[0, -1]
        while len(seq) < len(prompt) + n_committed:
            seq.append(sampling.choose(logits, len(seq)))
            logits = model(torch.tensor([seq[-1:]]), cache=cache)[0, -1]
        start = len(prompt) + (len(seq) - 1 - len(prompt)) // window * window
        cache.crop(start)
        # the verifier's own draws at the window's positions, one at a time (a row reads the
        # proposals before it): what a faithful fast path proposes
        first, proposals = len(seq) - 1 - start, []
        for i in range(window - (len(seq) - start)):
            rows = (seq + proposals)[start:]
            replay = model(torch.tensor([rows + [0] * (window - len(rows))]),
                           cache=cache.fork())[0]
            proposals.append(sampling.choose(replay[first + i], len(seq) + i))
        if corrupt is not None and corrupt < len(proposals):
            proposals[corrupt] = (proposals[corrupt] + 1) % model.config.vocab_size
        # the cache as the fast path leaves it: K/V of every token it fed (all but its last one)
        fed = (seq + proposals)[start:len(seq) - 1 + len(proposals)]
        if fed:
            model(torch.tensor([fed]), cache=cache)
    return seq, proposals, cache, start


# (temperature, seed, committed tokens before the window, window, proposal to corrupt or None)
WINDOW_CASES = [(0.0, 0, 5, 4, None), (0.0, 0, 5, 4, 1), (1.0, 3, 5, 4, None), (1.0, 3, 9, 4, 2),
                (0.8, 7, 1, 4, None), (1.0, 11, 6, 2, None), (1.0, 5, 8, 8, None),
                (1.0, 5, 8, 8, 0), (0.0, 0, 3, 8, 5), (1.2, 2, 13, 4, None)]


def _window_hint(student: dict, engine: dict, buggy: dict, sampled: bool) -> str:
    if student == buggy and student != engine:
        return ("this is verify_window_buggy unchanged: " + WINDOW_SYMPTOM)
    if student["seq"][:-1] == engine["seq"][:-1] and student["seq"] != engine["seq"]:
        return ("the proposals judged right, the verifier's own token wrong: draw it the way the "
                "fast path draws a token at that position")
    if sampled and student["accepted"] < engine["accepted"]:
        return WINDOW_SYMPTOM
    if student["seq"] == engine["seq"]:
        return ("the right tokens, the cache wrong: afterwards it holds K/V up to the last "
                "committed token's predecessor (len(seq) - 1 positions), those of the replay "
                "that were kept")
    return ("replay the window's rows in ONE pass of `window` rows, judge each proposal against "
            "the verifier's own choice at its position, commit the accepted prefix and the "
            "verifier's own token, and crop the cache behind it")


WINDOW_SYMPTOM = ("symptom: greedy requests verify fine, sampled ones are rejected at nearly every "
                  "window, mostly at the first proposal. A sampled token is a seeded draw, and the "
                  "seed includes the POSITION of the token being drawn: the fast path drew the "
                  "token at position p with choose(row, p), where p = len(seq) + i for proposal i. "
                  "The verifier must draw with the same position, not with the position of the "
                  "row's input token (p - 1): that reuses the previous position's random number, "
                  "which is why its own token so often repeats the token before it")


@one_thread
@guarded
def check_verify_window(verify_window) -> None:
    """verify_window(model, seq, proposals, cache, sampling, start, window) -> accepted, against
    the engine's verify_and_commit on the same request: the tokens committed, the count, the cache
    (length and K/V)."""
    name, model, prompt, same_as_buggy = "verify_window", _tiny(), [7, 8, 9, 10, 11], 0
    for temperature, seed, n_committed, window, corrupt in WINDOW_CASES:
        sampling, results = SamplingParams(temperature, seed=seed), []
        for fn in verify_window, _engine_window, verify_window_buggy:  # the learner's first
            seq, proposals, cache, start = _window_case(model, prompt, n_committed, window,
                                                        sampling, corrupt)
            case = (f"{'greedy' if temperature == 0 else f'temperature {temperature}, seed {seed}'}"
                    f", window {window} starting at position {start}, seq of {len(seq)} tokens, "
                    f"proposals {proposals}")
            watched = (verify_and_commit, accept_matching) if fn is verify_window else ()
            with torch.inference_mode(), forbid(name, *watched):
                got = call(name, case, fn, model, seq, proposals, cache, sampling, start, window)
            length = cache.get_seq_length()
            results.append((dict(accepted=as_int(got), seq=list(seq), length=length),
                            [t[:, :, :length].clone() for t in cache.keys + cache.values]))
        (view, kv), (want, want_kv), (buggy, _) = results
        same_as_buggy += view["seq"] == buggy["seq"]
        if view != want:
            fail(name, case, f"accepted {want['accepted']}, seq ending "
                 f"{want['seq'][len(prompt):]}, cache length {want['length']}",
                 f"accepted {view['accepted']}, seq ending {view['seq'][len(prompt):]}, cache "
                 f"length {view['length']}", _window_hint(view, want, buggy, temperature > 0))
        if not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(kv, want_kv)):
            fail(name, case, "the cache's K/V equal to the engine's", "different K/V",
                 "the cache keeps the K/V of the committed positions, as the replay computed "
                 "them: crop it, never rewrite it")
    if same_as_buggy == len(WINDOW_CASES):
        fail(name, "every case", "a fixed verifier", "verify_window_buggy's results",
             "this is the buggy verifier unchanged: " + WINDOW_SYMPTOM)
    passed(name, len(WINDOW_CASES))


# --- exercise 6 (design): batch-invariant kernels, or verification? -------------------------------

DESIGN_PROMPTS = SERVER_PROMPTS + ((50, 51, 52, 53), (60,), (70, 71, 72, 73, 74, 75), (80, 81, 82))


def _passes(n_det: int) -> int:
    return _measured(n_det, DESIGN_PROMPTS)  # n_det of the 8 requests deterministic


def _cheaper(verify_passes: int, invariant_passes: float) -> str:
    return "verify" if verify_passes <= invariant_passes else "invariant"


def reference_determinism(n_det: int, overhead: float) -> str:
    """Verification costs serve()'s passes; invariant kernels the plain ones', each slower."""
    return _cheaper(_passes(n_det), _passes(0) * (1 + overhead))


DESIGN = Exercise(
    "choose_determinism",
    # (deterministic requests of 8, invariant kernels' overhead per pass): nothing to protect, one
    # request, a few, all of them, with overheads on both sides of every crossing and close to
    # it (an off-by-one in the steps, the window or the requests moves a crossing), and a tie
    cases=[(0, 0.05), (1, 0.05), (1, 0.4), (2, 0.4), (3, 0.4), (3, 0.9), (8, 0.5), (8, 1.9),
           (7, 1.9), (6, 1.2), (4, 1.2), (2, 0.15), (7, 1.7), (2, 0.45), (2, 0.51), (0, 0.0)],
    describe=lambda n_det, overhead: f"n_det={n_det}, overhead={overhead}",
    reference=reference_determinism,
    explain=lambda n_det, overhead: (
        f"verify takes {_passes(n_det)} passes, invariant kernels {_passes(0)} passes × "
        f"{1 + overhead:g} = {_passes(0) * (1 + overhead):g}"),
    returns=one_of("verify", "invariant", hint='return "verify" or "invariant"'),
    mistakes={
        "with no deterministic request there is nothing to verify: the verifying server is the "
        "plain one, and invariant kernels would only slow it down":
            lambda n_det, overhead: ("invariant" if n_det == 0
                                     else reference_determinism(n_det, overhead)),
        "when EVERY request of the batch is verified at the same step, no batched pass runs at "
        "that step: the verifier passes replace the batched ones there":
            lambda n_det, overhead: _cheaper(_passes(0) + n_det * ROUNDS,
                                             _passes(0) * (1 + overhead)),
        "each deterministic request is replayed ALONE: one verifier pass per request per window":
            lambda n_det, overhead: _cheaper(_passes(0) + (ROUNDS if n_det else 0),
                                             _passes(0) * (1 + overhead)),
        "verification is not free: each verifier pass is a forward pass of its own":
            lambda n_det, overhead: _cheaper(_passes(0), _passes(0) * (1 + overhead)),
        "batch-invariant kernels slow every pass, the ordinary requests' share included: the "
        "overhead is on all the traffic, not only the deterministic requests'":
            lambda n_det, overhead: _cheaper(_passes(n_det), _passes(0) * (
                1 + overhead * n_det / len(DESIGN_PROMPTS))),
    },
    otherwise="price both: the server's passes with verification (measured), and the plain "
              "server's passes, each slower by the overhead")
check_choose_determinism = DESIGN.check

EXERCISES = (SPLIT_SUM, SCHEDULE, DESIGN)
