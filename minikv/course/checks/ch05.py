"""Checkers for chapter 05 (seed 001, deterministic requests), compared with the engine at run
time, on the CPU, leaving the caller's random state alone: choose, predict_server_passes and
verify_window (code), invariant_split_sum, verify_schedule and choose_determinism (tables). The
hints, as students read them, are in hints/ch05.toml."""
from __future__ import annotations

import functools
import itertools
import math
from functools import partial

import torch

from ...engine import GPT, KVCache, Request, SamplingParams, serve
from ...engine.verify import accept_matching, verify_and_commit
from .. import checks as ck

H = ck.hints("ch05")
_tiny = functools.cache(lambda: ck.tiny_model(0))  # a small random GPT whose greedy output wanders

# --- exercise 1: the same request draws the same tokens wherever it runs --------------------------
C, DRAWS, MULTIPLIERS = H["choose"], 2000, (10, 100, 1_000, 10_000, 100_000)
DIST_LOGITS = torch.tensor([1.0, 0.6, 0.2, 0.0, -0.3, -0.8])


def _logits(seed: int, vocab: int = 8, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _chooser(choose, name: str = "choose"):
    """The learner's choose, each call checked: an int in range, logits and global RNG untouched."""
    def pick(logits, seed, position, temperature) -> int:
        case = (f"logits of {logits.numel()} tokens, seed={seed}, position={position}, "
                f"temperature={temperature}")
        given, state = logits.clone(), torch.random.get_rng_state()
        got = ck.call_hinted(name, case, lambda e: C["greedy_crash"] if temperature == 0 else C[
            "probabilities"] if "probability tensor" in str(e) or "invalid multinomial" in str(e)
            else "your function raised on this input", choose, given, seed, position, temperature)
        for ok, expected, answer, hint in [
                (torch.equal(state, torch.random.get_rng_state()), "the global RNG left alone",
                 "the global RNG moved", C["global_rng"]),
                (torch.equal(given, logits), "the logits left as they were", "the logits changed",
                 C["in_place"]),
                (isinstance(got, int) and not isinstance(got, bool), "a Python int",
                 f"{got!r} ({ck.kind(got)})", C["python_int"].format(kind=ck.kind(got)))]:
            ck.expect(ok, name, case, expected, answer, hint)
        ck.expect(0 <= got < logits.numel(), name, case, f"a token id in 0..{logits.numel() - 1}",
                  got, C["index"])
        return got
    return pick


@ck.guarded
def check_choose(choose) -> None:
    """choose(logits, seed, position, temperature) -> a token id, seeded by (seed, position)."""
    name, pick, nearly = "choose", _chooser(choose), "temperature 1.0, nearly equal logits"
    with ck.forbid(name, SamplingParams.choose):
        for i, temperature in itertools.product(range(10), (0, 0.0)):  # greedy: the argmax
            logits = _logits(100 + i, vocab=5 + 3 * i)
            got, want = pick(logits, i, 7 * i, temperature), int(logits.argmax())
            ck.expect(got == want, name, f"temperature {temperature!r}, logits "
                      f"{[round(x, 2) for x in logits.tolist()]}", want, got, C["greedy"])
        # the same inputs give the same token, whatever was drawn before and in between, and in
        # a batch of another composition (round-robin with a companion request)
        requests = [(_logits(i), 10 + i, 3 * i + 1, 1.0) for i in range(12)]
        first = [pick(*r) for r in requests]
        for i, r in enumerate(requests):
            torch.rand(5)                             # other users of the global RNG
            pick(_logits(50 + i), i, i, 0.8)          # other requests' draws
            again = pick(*r)
            ck.expect(again == first[i], name, f"the same call twice (seed={r[1]}, position="
                      f"{r[2]}, temperature 1.0), other draws in between", first[i], again,
                      C["shared_generator"])
        batch = [(_logits(200 + r), 1000 + r) for r in range(4)]
        alone = {(r, p): pick(*batch[r], p, 1.0) for r in range(4) for p in range(6)}
        for p, r in itertools.product(range(6), (3, 2, 1, 0)):
            pick(_logits(300 + p), 77, p, 1.3)
            got = pick(*batch[r], p, 1.0)
            ck.expect(got == alone[r, p], name, f"request {r} (seed={batch[r][1]}) at position "
                      f"{p}, in another batch", alone[r, p], got, C["shared_generator"])
        # different positions and seeds draw differently; mixes that give two (seed, position)
        # pairs below one million the same generator seed are caught: with 16 nearly equal
        # logits, 40 independent pairs agree by chance about 16^-40 of the time
        flat = _logits(400, vocab=16, scale=0.3)
        by_position = {s: [pick(flat, s, p, 1.0) for p in range(40)] for s in (0, 1, 2, 5)}
        by_seed, argmax = [pick(flat, s, 3, 1.0) for s in range(40)], int(flat.argmax())
        shifted = [[pick(flat, s + 1, p, 1.0) for p in range(39)] for s in (0, 1)]
        at_zero = [pick(flat, s, 0, 1.0) for s in range(40)]
        for ok, case, expected, got, key in [
                (any(t != argmax for t in by_seed + sum(by_position.values(), [])), "logits of 16 "
                 "tokens with nearly equal values, temperature 1.0, 40 seeds and 40 positions",
                 "draws spread over the tokens", f"always {argmax}, the argmax", "argmax"),
                *[(len(set(t)) >= 4, f"seed={s}, positions 0..39, {nearly}", "different draws at "
                   "different positions", t, "seed_times_position" if s == 0 and len(set(
                       by_position[1])) >= 4 else "seed_alone") for s, t in by_position.items()],
                (len(set(by_seed)) >= 4, f"seeds 0..39 at position 3, {nearly}",
                 "different draws for different seeds", by_seed, "position_alone"),
                *[(shifted[s] != by_position[s][1:], f"seed={s + 1} at positions 0..38 vs seed="
                   f"{s} at positions 1..39", "two different streams",
                   "the same tokens, shifted by one position", "seed_plus_position")
                  for s in (0, 1)],
                (len(set(at_zero)) >= 4, f"seeds 0..39 at position 0, {nearly}",
                 "different draws for different seeds", at_zero, "position_zero")]:
            ck.expect(ok, name, case, expected, got, C[key])
        for case, pairs, hint in [(
                "40 pairs: seed s at position p against seed p at position s",
                [((s, s + 3 + s % 5), (s + 3 + s % 5, s)) for s in range(40)], C["symmetric"])] + [(
                f"40 pairs: seed s + 1 at position p against seed s at position p + {k:,}",
                [((s + 1, 7 * s), (s, 7 * s + k)) for s in range(40)], C["multiplier"].format(k=k))
                for k in MULTIPLIERS]:
            if all(pick(flat, *a, 1.0) == pick(flat, *b, 1.0) for a, b in pairs):
                ck.fail(name, case, "different draws", "the same draws, pair after pair", hint)
        for temperature in (0.5, 1.0, 2.0):  # the draws follow softmax(logits / temperature)
            counts = torch.zeros(DIST_LOGITS.numel())
            for i in range(DRAWS):
                counts[pick(DIST_LOGITS, i, i % 13, temperature)] += 1
            want = torch.softmax(DIST_LOGITS.double() / temperature, -1)
            if ck.chi_square_p(counts, want) < 1e-6:
                drawn = [ck.chi_square_p(counts, torch.softmax(DIST_LOGITS.double() * t, -1))
                         > 1e-4 for t in (1, temperature)]  # softmax(logits), softmax(logits × t)
                ck.fail(name, f"{DRAWS} draws (seeds 0..{DRAWS - 1}) from logits "
                        f"{DIST_LOGITS.tolist()} at temperature {temperature}",
                        f"frequencies near {[round(x, 3) for x in want.tolist()]}",
                        [round(x, 3) for x in (counts / DRAWS).tolist()], C["no_temperature"]
                        if drawn[0] else C["times_temperature"] if drawn[1] else C["softmax"])
    ck.passed(name, 20 + 12 + 24 + 5 * 40 + 2 * 39 + 40 + 80 * (1 + len(MULTIPLIERS)) + 3 * DRAWS)


# --- exercise 2: a batch-invariant sum ------------------------------------------------------------
SPLIT = H["invariant_split_sum"]


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
    return SPLIT["depends_on_splits" if any(len(v) > 1 for v in bits.values()) else "otherwise"]


def _vectors() -> list[tuple[torch.Tensor, int]]:
    """(x, chunk): magnitudes from 1e-3 to 1e3, so the summation order shows in the last bits."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3), chunk)
            for n, chunk in [(1, 16), (15, 16), (16, 16), (17, 16), (100, 16), (257, 16),
                             (1000, 16), (4096, 16), (103, 5)]]


SPLIT_SUM = ck.Exercise(
    "invariant_split_sum",
    cases=[(x, n_splits, chunk) for x, chunk in _vectors()
           for n_splits in (1, 2, 3, 4, 7, 8, 13, 64)],
    describe=lambda x, n_splits, chunk: (f"x of {x.numel()} float32 values, chunk={chunk}, "
                                         f"n_splits={n_splits}"),
    reference=fixed_schedule_sum,
    returns=ck.tensor(SPLIT["returns"], shape=(), dtype=torch.float32),
    same=torch.equal, show=float, unchanged=SPLIT["unchanged"],
    mistakes={
        SPLIT["equal_pieces"]: _equal_pieces,
        SPLIT["worker_totals"]: _worker_totals,
        SPLIT["stack_sum"]: lambda x, n_splits, chunk: torch.stack(_chunk_sums(x, chunk)).sum(),
        SPLIT["torch_sum"]: lambda x, n_splits, chunk: x.sum(),
        SPLIT["last_chunk"]: lambda x, n_splits, chunk: torch.zeros(()) if x.numel() < chunk
        else fixed_schedule_sum(x[:x.numel() // chunk * chunk], n_splits, chunk),
    },
    otherwise=_split_sum_otherwise)
check_invariant_split_sum = SPLIT_SUM.check

# --- exercise 3: the replay's schedule ------------------------------------------------------------
SCHED = H["verify_schedule"]


def reference_schedule(n: int, window: int) -> list[tuple[int, int]]:
    """(first, proposals) of every replay of n new tokens, no rollback (T₀ is token 0)."""
    passes, first = [], 0
    while first < n - 1:
        k = min(window - 1, n - 2 - first)
        passes.append((first, k))
        first += k + 1
    return passes


def served_schedule(n: int, window: int) -> list[tuple[int, int]]:
    """(first, proposals) of serve()'s replays of a deterministic request beside two sampled."""
    prompt = [1, 2, 3, 4]
    requests = [Request(prompt, n, deterministic=True),
                Request([11, 12, 13], 9, temperature=1.0, seed=1),
                Request([20, 21], 25, temperature=1.0, seed=2)]
    with torch.inference_mode():
        out = serve(_tiny(), requests, replay_window=window, trace=True)[0]
    return [(e.cache_len_before - len(prompt), len(e.input_ids))
            for e in out.trace if e.kind == "verify"]


def _pass_list(got, *case) -> list[tuple[int, int]]:
    """The contract: a list of (int, int) pairs (a 2-D array or tensor will do)."""
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        got = got.tolist() if got.ndim == 2 else got
    pairs = [ck.int_list(p) for p in got] if isinstance(got, (list, tuple)) else [None]
    if any(p is None or len(p) != 2 for p in pairs):
        counts = isinstance(got, (tuple, list)) and len(got) == 2 and all(
            ck.as_int(v) is not None for v in got)
        raise ck.Refused(SCHED["counts" if counts else "pairs"])
    return [tuple(p) for p in pairs]


SCHEDULE = ck.Exercise(
    "verify_schedule",
    # (10, 4) first: it tells most of the usual mistakes apart; max_new_tokens = 1 is left out
    cases=[(10, 4), (9, 4), (30, 4), (2, 4), (4, 4), (5, 4), (6, 4), (13, 4), (10, 1), (7, 2),
           (2, 1), (8, 3), (20, 8), (5, 16), (33, 16)],
    describe=lambda n, window: f"max_new_tokens={n}, window={window}",
    reference=served_schedule, solution=reference_schedule, returns=_pass_list, forbid=(serve,),
    mistakes={
        SCHED["all_full"]: lambda n, w: [(f, w - 1) for f, _ in reference_schedule(n, w)],
        SCHED["no_partial"]: lambda n, w: [p for p in reference_schedule(n, w) if p[1] == w - 1],
        SCHED["no_prefill"]: lambda n, w: reference_schedule(n + 1, w),
        SCHED["first_is_proposal"]: lambda n, w: [(f + 1, k) for f, k in reference_schedule(n, w)],
        SCHED["own_token"]: lambda n, w: [(f, k + 1) for f, k in reference_schedule(n, w)],
        SCHED["window_proposals"]: lambda n, w: reference_schedule(n, w + 1),
    },
    otherwise=SCHED["otherwise"])
check_verify_schedule = SCHEDULE.check

# --- exercise 4 (predict, then measure): what replay costs the server -----------------------------
SERVER_PROMPTS = ((1, 2, 3, 4, 5), (11, 12, 13), (20, 21, 22, 23, 24, 25, 26), (40, 41))
SERVER_NEW, SERVER_WINDOW, PREDICT_D = 20, 4, (0, 1, 4)
STEPS = SERVER_NEW - 1                          # decode steps after the prefill
ROUNDS = math.ceil(STEPS / SERVER_WINDOW)       # replays of a deterministic request
PASSES, _N = H["predict_server_passes"], len(SERVER_PROMPTS)


def server_passes(n_det: int, prompts: tuple = SERVER_PROMPTS) -> int:
    """The server's passes after the prefills (batched and replays), the first n_det replayed."""
    requests = [Request(list(p), SERVER_NEW, deterministic=i < n_det)
                for i, p in enumerate(prompts)]
    with torch.inference_mode():
        outs = serve(_tiny(), requests, replay_window=SERVER_WINDOW, trace=True)
    batched = {e.step for o in outs for e in o.trace if e.kind == "decode"}
    return len(batched) + sum(e.kind == "verify" for o in outs for e in o.trace)


_measured = functools.cache(server_passes)  # the checkers' copy: a learner's call still runs serve
PASSES_MISTAKES = {  # hint -> the passes predicted with that mistake when d are deterministic
    PASSES["prefill"]: lambda d: SERVER_NEW + d * ROUNDS - (ROUNDS if d == _N else 0),
    PASSES["rows"]: lambda d: _N * STEPS,
    PASSES["not_free"]: lambda d: STEPS,
    PASSES["partial"]: lambda d: STEPS + d * (STEPS // SERVER_WINDOW),
    PASSES["replace"]: lambda d: STEPS + d * ROUNDS,
    PASSES["alone"]: lambda d: STEPS + ROUNDS,
}


@ck.one_thread
@ck.guarded
def check_predict_server_passes(predict_server_passes) -> None:
    """predict_server_passes() -> {d: the server's passes after the prefills} for d = 0, 1, 4."""
    name = "predict_server_passes"
    case = (f"{len(SERVER_PROMPTS)} greedy requests of {SERVER_NEW} new tokens served together, "
            f"replay_window={SERVER_WINDOW}, the first d deterministic")
    got = ck.prediction(name, case, predict_server_passes, serve, GPT.forward)
    ck.expect(isinstance(got, dict) and sorted(got) == list(PREDICT_D), name, case,
              f"a dict with the keys {list(PREDICT_D)} (d)", sorted(got) if isinstance(got, dict)
              else got, PASSES["dict"] + (" (did you forget to return it?)" if got is None else ""))
    for d in PREDICT_D:
        ck.expect(ck.as_int(got[d]) is not None, name, f"{case}, d = {d}", "an int", got[d],
                  PASSES["whole"])
    measured = {d: _measured(d) for d in PREDICT_D}
    wrong = [((d,), ck.as_int(got[d])) for d in PREDICT_D if ck.as_int(got[d]) != measured[d]]
    if wrong:
        (d,), you = wrong[0]
        ck.fail(name, f"{case}, d = {d}", measured[d], you, f"you predicted {you} passes; the "
                f"engine ran {measured[d]}: "
                f"{ck.diagnose(PASSES_MISTAKES, wrong) or PASSES['otherwise']}")
    print("  measured: " + ", ".join(f"d = {d}: {measured[d]} passes" for d in PREDICT_D)
          + f" (d = 2: {_measured(2)}, d = 3: {_measured(3)})")
    ck.passed(name, len(PREDICT_D))


# --- exercise 5 (debug): a replayed window's verification -----------------------------------------
WINDOW = H["verify_window"]
# (temperature, seed, committed tokens before the window, window, proposal to corrupt or None)
WINDOW_CASES = [(0.0, 0, 5, 4, None), (0.0, 0, 5, 4, 1), (1.0, 3, 5, 4, None), (1.0, 3, 9, 4, 2),
                (0.8, 7, 1, 4, None), (1.0, 11, 6, 2, None), (1.0, 5, 8, 8, None),
                (1.0, 5, 8, 8, 0), (0.0, 0, 3, 8, 5), (1.2, 2, 13, 4, None)]


def _engine_window(model, seq, proposals, cache, sampling, start, window, shift=0):
    """The engine's verify-and-commit core on the same inputs (the reference); with shift=-1 the
    notebook's verify_window_buggy, which draws with the position of the row's INPUT token."""
    return verify_and_commit(
        seq, list(proposals), cache,
        lambda rows, c: model(torch.tensor([rows], device=model.device), cache=c)[0],
        partial(accept_matching, sampling=sampling, first_position=len(seq) + shift),
        start=start, rows=window).verdict.accepted


def _window_case(model, prompt, n_committed, window, sampling, corrupt):
    """(seq, proposals, cache, start) of a request mid-decode, as the verifier finds it: the fast
    path proposed the rest of the window (the verifier's own draws, or with proposal `corrupt`
    changed), and its cache holds K/V of every token the fast path fed (all but its last)."""
    cache = KVCache.for_model(model, max_len=len(prompt) + n_committed + 2 * window + 2)
    seq = list(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([seq]), cache=cache)[0, -1]
        while len(seq) < len(prompt) + n_committed:
            seq.append(sampling.choose(logits, len(seq)))
            logits = model(torch.tensor([seq[-1:]]), cache=cache)[0, -1]
        start = len(prompt) + (len(seq) - 1 - len(prompt)) // window * window
        cache.crop(start)
        own = list(seq)  # the verifier's own draws at the window's positions, one at a time
        for _ in range(window - (len(seq) - start)):
            _engine_window(model, own, [], cache.fork(), sampling, start, window)
        proposals = own[len(seq):]
        if corrupt is not None and corrupt < len(proposals):
            proposals[corrupt] = (proposals[corrupt] + 1) % model.config.vocab_size
        if fed := (seq + proposals)[start:len(seq) - 1 + len(proposals)]:
            model(torch.tensor([fed]), cache=cache)
    return seq, proposals, cache, start


def _window_hint(student: dict, engine: dict, buggy: dict, sampled: bool) -> str:
    if student == buggy and student != engine:
        return WINDOW["buggy"] + WINDOW["symptom"]
    if student["seq"][:-1] == engine["seq"][:-1] and student["seq"] != engine["seq"]:
        return WINDOW["own_token"]
    if sampled and student["accepted"] < engine["accepted"]:
        return WINDOW["symptom"]
    return WINDOW["cache" if student["seq"] == engine["seq"] else "otherwise"]


@ck.one_thread
@ck.guarded
def check_verify_window(verify_window) -> None:
    """verify_window(...) -> accepted, against verify_and_commit: tokens, count, cache, K/V."""
    name, model, prompt, same_as_buggy = "verify_window", _tiny(), [7, 8, 9, 10, 11], 0
    for temperature, seed, n_committed, window, corrupt in WINDOW_CASES:
        sampling, results = SamplingParams(temperature, seed=seed), []
        for fn in verify_window, _engine_window, partial(_engine_window, shift=-1):  # theirs 1st
            seq, proposals, cache, start = _window_case(model, prompt, n_committed, window,
                                                        sampling, corrupt)
            case = (f"{'greedy' if temperature == 0 else f'temperature {temperature}, seed {seed}'}"
                    f", window {window} starting at position {start}, seq of {len(seq)} tokens, "
                    f"proposals {proposals}")
            watched = (verify_and_commit, accept_matching) if fn is verify_window else ()
            with torch.inference_mode(), ck.forbid(name, *watched):
                got = ck.call(name, case, fn, model, seq, proposals, cache, sampling, start, window)
            length = cache.get_seq_length()
            results.append((dict(accepted=ck.as_int(got), seq=list(seq), length=length),
                            [t[:, :, :length].clone() for t in cache.keys + cache.values]))
        (view, kv), (want, want_kv), (buggy, _) = results
        same_as_buggy += view["seq"] == buggy["seq"]
        ck.expect(view == want, name, case, f"accepted {want['accepted']}, seq ending "
                  f"{want['seq'][len(prompt):]}, cache length {want['length']}",
                  f"accepted {view['accepted']}, seq ending {view['seq'][len(prompt):]}, cache "
                  f"length {view['length']}", _window_hint(view, want, buggy, temperature > 0))
        ck.expect(all(torch.allclose(a, b, atol=1e-5) for a, b in zip(kv, want_kv)), name, case,
                  "the cache's K/V equal to the engine's", "different K/V", WINDOW["kv"])
    ck.expect(same_as_buggy < len(WINDOW_CASES), name, "every case", "a fixed verifier",
              "verify_window_buggy's results", WINDOW["buggy_everywhere"] + WINDOW["symptom"])
    ck.passed(name, len(WINDOW_CASES))


# --- exercise 6 (design): batch-invariant kernels, or replay? -------------------------------------
DESIGN_PROMPTS = SERVER_PROMPTS + ((50, 51, 52, 53), (60,), (70, 71, 72, 73, 74, 75), (80, 81, 82))
D = H["choose_determinism"]


def _passes(n_det: int) -> int:
    return _measured(n_det, DESIGN_PROMPTS)  # n_det of the 8 requests deterministic


def _cheaper(verify_passes: int, invariant_passes: float) -> str:
    return "verify" if verify_passes <= invariant_passes else "invariant"


def reference_determinism(n_det: int, overhead: float) -> str:
    """Verification costs serve()'s passes; invariant kernels the plain ones', each slower."""
    return _cheaper(_passes(n_det), _passes(0) * (1 + overhead))


DESIGN = ck.Exercise(
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
    returns=ck.one_of("verify", "invariant", hint=D["returns"]),
    mistakes={
        D["nothing_to_verify"]: lambda n, o: "invariant" if n == 0 else reference_determinism(n, o),
        D["replace"]: lambda n, o: _cheaper(_passes(0) + n * ROUNDS, _passes(0) * (1 + o)),
        D["alone"]: lambda n, o: _cheaper(_passes(0) + ROUNDS * (n > 0), _passes(0) * (1 + o)),
        D["not_free"]: lambda n, o: _cheaper(_passes(0), _passes(0) * (1 + o)),
        D["all_traffic"]: lambda n, o: _cheaper(_passes(n), _passes(0) * (
            1 + o * n / len(DESIGN_PROMPTS))),
    },
    otherwise=D["otherwise"])
check_choose_determinism = DESIGN.check

EXERCISES = (SPLIT_SUM, SCHEDULE, DESIGN)
