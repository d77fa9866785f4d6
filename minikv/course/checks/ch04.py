"""Checkers for chapter 04 (seed 004, speculative decoding: draft, verify, roll back).

- speculative_round: the learner's round, looped to 40+ new tokens on tiny random target/draft
  pairs for γ = 1..6. Every round is compared with the chapter's round computed on forks of the
  caches (the proposals, the target's choices), its forward passes are counted (γ draft passes,
  ONE target pass of γ + 1 rows), both caches are checked whole afterwards (length, and every
  layer's keys and values against a fresh computation of the committed tokens), and the output
  against target-only greedy decoding (`minikv.generate`). The engine's own round is forbidden.
- residual: against `verify.residual_distribution`, then the whole accept-or-resample step in
  closed form, which must give exactly p.
- alpha_from_trace: against the engine's `stats.alpha` on real speculative traces (tiny pairs and
  the course pair, greedy and sampled, a draft that is always right, a trace with no round).
- best_gamma: against the argmax of the chapter's speed-up formula, as an int.

Each usual mistake is recognised by computing what it would give, and named in the hint. All on the
CPU, in about a second, leaving the caller's random state alone.
"""
from __future__ import annotations

import math

import torch

from ...engine import GPT, GPTConfig, KVCache, generate, speculative_generate
from ...engine.verify import accept_matching, residual_distribution, verify_and_commit
from ..checkpoint import load_course_model
from . import (
    PassCounter,
    as_int,
    cache_state,
    call,
    call_hinted,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    one_thread,
    passed,
    same_cache_prefix,
    tiny_model,
)

# --- exercise 1: one speculative round ----------------------------------------------------------

_PAIRS: dict[int, tuple[GPT, GPT]] = {}


def tiny_pair(seed: int) -> tuple[GPT, GPT]:
    """A random 2-layer target and a 1-layer draft that often agrees with it: the draft is the
    target's embeddings, first block and final LayerNorm, and the target's second block is damped
    (its output projections scaled by 0.3), so α is about 0.6-0.85 and rounds both reject and
    accept everything. Built once per seed, without touching the caller's RNG."""
    if seed not in _PAIRS:
        target = tiny_model(seed)
        with torch.no_grad():
            for block in target.transformer.h[1:]:
                block.attn.c_proj.weight.mul_(0.3)
                block.mlp.c_proj.weight.mul_(0.3)
        with torch.random.fork_rng(devices=[]):
            draft = GPT(GPTConfig.preset("tiny", n_layer=1)).eval()
        kept = {k: v for k, v in target.state_dict().items()
                if not k.startswith("transformer.h.") or k.startswith("transformer.h.0.")}
        draft.load_state_dict(kept)
        _PAIRS[seed] = target, draft
    return _PAIRS[seed]


# (pair seed, prompt, γ): γ = 1..6, several prompts, each run to 40+ new tokens
ROUND_CASES = [(0, [3, 17, 200, 41, 9], 1), (1, [100, 7], 2), (2, [3, 17, 200, 41, 9], 3),
               (1, [55, 56, 57, 58, 59, 60, 61, 62], 4), (1, [5], 5), (2, [100, 7], 6),
               (0, [100, 7], 3)]
NEW_TOKENS = 40


def _reference_round(target, draft, seq, t_cache, d_cache, gamma):
    """The chapter's round on (forks of) the caches: the draft's proposals, the target's greedy
    choice at each of its γ + 1 rows."""
    proposals = []
    for _ in range(gamma):
        pending = (seq + proposals)[d_cache.get_seq_length():]
        logits = draft(torch.tensor([pending]), cache=d_cache, last_only=True)[0, -1]
        proposals.append(int(logits.argmax()))
    logits = target(torch.tensor([seq[-1:] + proposals]), cache=t_cache)[0]  # (γ + 1, vocab)
    return proposals, logits.argmax(-1).tolist()


def _matching(proposals, choices, shift=0):
    """Leading proposals equal to the target's choice `shift` rows later."""
    n = 0
    while n < len(proposals) and n + shift < len(choices) and proposals[n] == choices[n + shift]:
        n += 1
    return n


def _round_mistakes(proposals, choices) -> list[tuple[list[int], str]]:
    """What the usual wrong rounds commit, each with the mistake that gives it."""
    gamma, n = len(proposals), _matching(proposals, choices)
    mistakes = []
    if n < gamma:
        mistakes.append((proposals[:n + 1],
                         "this is what you get when you commit the DRAFT's token at the first "
                         "mismatch: the target disagreed with it, so commit the target's own "
                         "token there (its choice at that row)"))
    else:
        mistakes.append((list(proposals),
                         "this is what you get when you forget the bonus token: when all γ "
                         "proposals are accepted, the target's last row (row γ) still gives one "
                         "more token of its own, for free"))
    off = "this is what you get when you are off by one in the target's rows: the pass fed " \
          "seq[-1] + proposals, so row 0 (the output at the last committed token) scores " \
          "proposal 1, row i scores proposal i + 1, and row γ gives the bonus"
    m = _matching(proposals, choices, shift=1)
    mistakes.append((proposals[:m] + choices[m + 1:m + 2], off))
    if n < gamma:
        mistakes.append((proposals[:n] + choices[n + 1:n + 2], off))
    kept = [p for p, c in zip(proposals, choices) if p == c]
    if len(kept) > n:
        mistakes.append((kept + [choices[len(kept)]],
                         "this is what you get when you keep every proposal that matches: only "
                         "the matching PREFIX is accepted, everything after the first mismatch "
                         "is thrown away"))
    return mistakes


def _round_crash_hint(error: Exception) -> str:
    if isinstance(error, ValueError) and "cannot crop to" in str(error):
        return ("this is what you get when you roll back with crop(len(seq) - 1) without min(...): "
                "after a fully accepted round the draft's cache is SHORTER than len(seq) - 1 (it "
                "never fed its last proposal, nor the bonus token), and a cache cannot grow by a "
                "crop; crop each cache to min(its length, len(seq) - 1)")
    return "your function raised on this input"


def _pass_hints(target_passes, draft_passes, gamma, first_draft_rows, seq_len):
    """(expected, got, hint) for the first wrong pass count or shape, or None."""
    want_t = [(1, gamma + 1)]
    if target_passes != want_t:
        if len(target_passes) > 1:
            hint = ("this is what you get when you score the proposals one target pass each: the "
                    "point of speculative decoding is ONE target pass over seq[-1:] + proposals "
                    "(γ + 1 rows), scoring every proposal at once")
        elif target_passes == [(1, gamma)]:
            hint = ("this is what you get when you feed the target only the proposals: its cache "
                    "holds everything but the last committed token, so feed seq[-1:] + proposals")
        elif target_passes == [(1, seq_len + gamma)]:
            hint = ("this is what you get when you feed the target the whole sequence again: its "
                    "cache already holds everything but the last committed token; feed "
                    "seq[-1:] + proposals")
        elif not target_passes:
            hint = "the target must score the proposals: one pass over seq[-1:] + proposals"
        else:
            hint = "one target pass over seq[-1:] + proposals: shape (1, γ + 1)"
        return f"target passes of shape {want_t}", f"{target_passes}", hint
    want_d = [(1, first_draft_rows)] + [(1, 1)] * (gamma - 1)
    if draft_passes != want_d:
        if len(draft_passes) != gamma:
            hint = (f"one draft pass per proposal: γ = {gamma} passes, each feeding what the draft "
                    f"cache has not seen yet, then proposing one token")
        elif draft_passes[0] == (1, 1) and first_draft_rows > 1:
            hint = ("this is what you get when the draft's first pass feeds only the last "
                    "committed token: it must feed everything its cache has not seen, "
                    "seq[d_cache.get_seq_length():] (after a fully accepted round the draft never "
                    "fed its last proposal, so that is 2 tokens)")
        elif draft_passes[0] == (1, seq_len):
            hint = ("this is what you get when the draft re-feeds the whole sequence: feed only "
                    "what its cache has not seen yet, seq[d_cache.get_seq_length():]")
        else:
            hint = ("pass 1 feeds seq[d_cache.get_seq_length():], then each pass feeds the "
                    "previous proposal (one token)")
        return f"draft passes of shape {want_d}", f"{draft_passes}", hint
    return None


def _cache_length_hint(name: str, got: int, want: int, after_pass: int, seq_len: int) -> str:
    if got == 0 and want > 0:
        return (f"this is what you get when you reset the {name} cache (or crop it to 0): a "
                f"rollback keeps everything up to the last committed token; only the rejected "
                f"positions go")
    if got == after_pass > want:
        return (f"this is what you get when you do not crop the {name} cache: it still holds K/V "
                f"of rejected proposals; crop it to min(its length, len(seq) - 1)")
    if got == seq_len - 1 > want:
        return (f"the {name} cache grew: after a fully accepted round it is shorter than "
                f"len(seq) - 1 and must stay so; crop to min(its length, len(seq) - 1), never "
                f"beyond its length")
    if got == seq_len:
        return ("keep K/V up to the last committed token, not including it: the newest token "
                "has no K/V yet (it is fed next round), so at most len(seq) - 1 positions")
    return "crop both caches to min(their length, len(seq) - 1) after committing"


def _fresh_kv(model, tokens: list[int]) -> KVCache:
    cache = KVCache.for_model(model, max_len=max(len(tokens), 1))
    if tokens:
        model(torch.tensor([tokens]), cache=cache)
    return cache


def _same_kv(cache: KVCache, fresh: KVCache, n: int) -> bool:
    return all(torch.allclose(a[:, :, :n], b[:, :, :n], atol=1e-4, rtol=1e-4)
               for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values))


def _check_round(name, case, round_fn, target, draft, seq, t_cache, d_cache, gamma) -> None:
    """Run one round of the learner's and check everything it did."""
    before_seq = list(seq)
    t_before, d_before = cache_state(t_cache), cache_state(d_cache)
    d0 = d_before[0]
    proposals, choices = _reference_round(target, draft, before_seq, t_cache.fork(),
                                          d_cache.fork(), gamma)
    n = _matching(proposals, choices)
    expected = proposals[:n] + [choices[n]]
    case = f"{case}, round at len(seq) = {len(before_seq)}"
    with forbid(name, speculative_generate, verify_and_commit, accept_matching), \
            PassCounter(target) as t_passes, PassCounter(draft) as d_passes:
        got = call_hinted(name, case, _round_crash_hint, round_fn, target, draft, seq, t_cache,
                           d_cache, gamma)
    # what it returned, and what it did to seq
    tokens = int_list(got)
    if tokens is None:
        kind = f"{type(got).__module__}.{type(got).__name__}".replace("builtins.", "")
        fail(name, case, expected, got,
             "your function returned None: return the tokens it appended to seq (a list of ints)"
             if got is None else f"return the tokens the round appended to seq as a list of "
             f"ints, not a {kind}")
    if seq == before_seq:
        fail(name, case, f"seq extended by {expected}", "seq unchanged",
             "append the committed tokens to seq in place (seq.extend(...)), then return them")
    if seq != before_seq + tokens:
        fail(name, case, f"seq == seq before the round + the returned tokens ({tokens})",
             f"seq grew by {seq[len(before_seq):]}",
             "append exactly the tokens you return, in place, and nothing else")
    # the passes it made
    wrong = _pass_hints(t_passes.passes, d_passes.passes, gamma, len(before_seq) - d0,
                        len(before_seq))
    if wrong:
        fail(name, case, *wrong)
    # what it committed
    if tokens != expected:
        hints = list(dict.fromkeys(h for w, h in _round_mistakes(proposals, choices)
                                   if tokens == w))  # one wrong answer may fit two mistakes
        hint = "; or ".join(hints) or ("commit the proposals up to the first one the target "
                                       "disagrees with, then the target's own token there (or "
                                       "its bonus token after all γ)")
        fail(name, case, f"{expected} (the draft proposed {proposals}; the target's rows chose "
             f"{choices})", tokens, hint)
    # both caches, whole: lengths, then every layer's keys and values
    committed = len(seq)
    for label, cache, model, before, after_pass in (
            ("target", t_cache, target, t_before, len(before_seq) + gamma),
            ("draft", d_cache, draft, d_before, len(before_seq) + gamma - 1)):
        want = min(after_pass, committed - 1)
        got_len = cache.get_seq_length()
        expect(got_len == want, name, case, f"{label} cache length {want}",
               f"{label} cache length {got_len}",
               _cache_length_hint(label, got_len, want, after_pass, committed))
        kept = min(before[0], want)
        fresh = _fresh_kv(model, seq[:want])
        if not same_cache_prefix(before, cache, kept) or not _same_kv(cache, fresh, want):
            fail(name, case, f"the {label} cache's K/V (every layer, keys and values) equal to a "
                 f"fresh computation of the first {want} committed tokens",
                 "different K/V",
                 "this is what you get when you zero, reset or overwrite cache entries: a "
                 "rollback only moves the length back (cache.crop), it never rewrites the K/V "
                 "it keeps; and every token must be fed at its own position, once")


@one_thread
@guarded
def check_speculative_round(speculative_round) -> None:
    """speculative_round(target, draft, seq, t_cache, d_cache, gamma) -> the new committed tokens
    of one greedy round, seq extended in place and both caches cropped, looped to 40+ tokens."""
    name = "speculative_round"
    with torch.inference_mode():
        for seed, prompt, gamma in ROUND_CASES:
            target, draft = tiny_pair(seed)
            case = f"prompt {prompt}, γ = {gamma}"
            max_len = len(prompt) + NEW_TOKENS + gamma + 2
            t_cache = KVCache.for_model(target, max_len=max_len)
            d_cache = KVCache.for_model(draft, max_len=max_len)
            # the prefill, done here: the target's cache holds the prompt, the draft's nothing yet
            first = target(torch.tensor([prompt]), cache=t_cache, last_only=True)[0, -1]
            seq = list(prompt) + [int(first.argmax())]
            while len(seq) - len(prompt) < NEW_TOKENS:
                _check_round(name, case, speculative_round, target, draft, seq, t_cache, d_cache,
                             gamma)
            new = seq[len(prompt):]
            alone = generate(target, prompt, len(new)).tokens
            expect(new == alone, name, case, f"target-only greedy decoding: {alone}", new,
                   "greedy speculative decoding must give exactly the target's own tokens")
    passed(name, len(ROUND_CASES))


# --- exercise 2: the residual distribution ------------------------------------------------------

def _distributions(seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    return p / p.sum(), q / q.sum()


def _normalised(t: torch.Tensor) -> torch.Tensor:
    return t / t.sum()


RESIDUAL_MISTAKES = [
    (lambda p, q: (p - q).clamp(min=0),
     "this is what you get when you forget to normalise: divide max(0, p - q) by its sum, so "
     "the residual is a distribution"),
    (lambda p, q: _normalised((p - q).abs()),
     "this is what you get with |p - q|: it puts mass where the draft proposed too MUCH "
     "(q > p), which acceptance already over-serves; keep only where p > q"),
    (lambda p, q: p.clone(),
     "this is what you get when you resample from p itself: the tokens the draft proposes "
     "often are then over-represented (accepted AND resampled)"),
    (lambda p, q: _normalised((q - p).clamp(min=0)),
     "this is what you get with max(0, q - p): that is where the draft over-proposes; the "
     "residual is where the TARGET wants more than the draft gave"),
    (lambda p, q: q.clone(),
     "this is what you get when you resample from the draft's q"),
]


def _as_list(t) -> list:
    return [round(x, 4) for x in t.tolist()]


def speculative_sample_distribution(p: torch.Tensor, q: torch.Tensor, residual) -> torch.Tensor:
    """The distribution of one speculative step, in closed form: draw x ~ q, accept with
    min(1, p/q), else draw from residual(p, q). Leviathan et al. prove it equals p, whatever q
    is."""
    accept = torch.minimum(torch.ones_like(p), p / q.clamp(min=1e-300)) * (q > 0)
    rejected_mass = (q * (1 - accept)).sum()
    return q * accept + rejected_mass * residual(p, q)


@guarded
def check_residual(residual) -> None:
    """residual(p, q) == norm(max(0, p - q)) for probability vectors p (target) and q (draft), and
    with it one accept-or-resample step gives exactly p."""
    name = "residual"
    cases = [_distributions(s) for s in range(10)]
    cases.append((torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64),
                  torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)))
    cases.append((torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])))
    for p, q in cases:
        case = f"p={_as_list(p)}, q={_as_list(q)}"
        p_in, q_in = p.clone(), q.clone()
        got = call(name, case, residual, p_in, q_in)
        expected = residual_distribution(p, q)
        if not isinstance(got, torch.Tensor):
            kind = f"{type(got).__module__}.{type(got).__name__}".replace("builtins.", "")
            fail(name, case, _as_list(expected), got,
                 f"return a torch tensor (a probability vector like p), not a {kind}")
        if not (torch.equal(p_in, p) and torch.equal(q_in, q)):
            fail(name, case, "p and q left as they were", "p or q changed",
                 "this is what you get with in-place operations (p.sub_, clamp_, /=): they "
                 "change the caller's p and q; compute a new tensor")
        if got.shape != expected.shape or not got.is_floating_point():
            fail(name, case, f"a float tensor of shape {tuple(expected.shape)}",
                 f"a {got.dtype} tensor of shape {tuple(got.shape)}",
                 "one probability per token: the same shape as p")
        if not torch.allclose(got.double(), expected.double(), atol=1e-6):
            hint = next((h for wrong, h in RESIDUAL_MISTAKES
                         if torch.allclose(got.double(), wrong(p, q).double(), atol=1e-6)),
                        "the shortfall of p after acceptance, as a distribution: what p(x) still "
                        "lacks once acceptance gave min(p(x), q(x)), divided by its sum")
            fail(name, case, _as_list(expected), _as_list(got), hint)
    steps = [_distributions(s) for s in range(20, 30)]
    for p, q in steps:
        case = f"one speculative step with p={_as_list(p)}, q={_as_list(q)}"
        got = call(name, case, speculative_sample_distribution, p, q, residual)
        expect(torch.allclose(got.double(), p, atol=1e-9), name, case, _as_list(p),
               _as_list(got), "the residual decides where rejected draws go; it must fill "
               "exactly p's shortfall")
    passed(name, len(cases) + len(steps))


# --- exercise 3: α from a trace -----------------------------------------------------------------

def _verify_counts(trace) -> list[tuple[int, int]]:
    """(accepted, proposed) of each verification round."""
    return [(len(e.accepted), len(e.accepted) + len(e.rejected))
            for e in trace if e.kind == "verify"]


def _alpha_mistakes(trace) -> list[tuple[float, str]]:
    rounds = _verify_counts(trace)
    accepted = sum(a for a, _ in rounds)
    proposed = sum(p for _, p in rounds)
    rejections = sum(a < p for a, p in rounds)
    mistakes = []
    if proposed:
        mistakes.append((accepted / proposed,
                         "this is what you get with accepted / proposed: it counts the proposals "
                         "after a round's first rejection, which the target never judged, as "
                         "rejected, so it reads α too low (the more so the longer γ); divide by "
                         "accepted + rejections, a rejection being a round that ended in one"))
    if rounds:
        mistakes.append((accepted / max(accepted + len(rounds), 1),
                         "this is what you get when every round counts as a rejection: a fully "
                         "accepted round ends in the bonus token, not in a rejection; count only "
                         "the rounds with a rejected proposal"))
        mistakes.append((sum(a / p for a, p in rounds if p) / max(sum(p > 0 for _, p in rounds), 1),
                         "this is what you get when you average each round's rate: pool the "
                         "counts over the whole trace, accepted / (accepted + rejections)"))
        mistakes.append(((accepted + len(rounds)) / (accepted + len(rounds) + rejections),
                         "this is what you get when you count the target's own token as an "
                         "accepted proposal: only the draft's proposals are judged"))
        mistakes.append((1 - rejections / len(rounds),
                         "this is the fraction of rounds without a rejection, not of judged "
                         "proposals accepted"))
    return mistakes


def _alpha_cases():
    """(label, trace, the engine's stats.alpha)."""
    prompt = [3, 17, 200, 41, 9]
    for seed, gamma in ((0, 2), (1, 4), (2, 6)):
        target, draft = tiny_pair(seed)
        out = speculative_generate(target, draft, prompt, 40, gamma=gamma, trace=True)
        yield f"tiny pair {seed}, greedy, γ = {gamma}", out
    target, draft = tiny_pair(1)
    yield "tiny pair 1, temperature 1, γ = 4", speculative_generate(
        target, draft, [100, 7], 40, gamma=4, temperature=1.0, seed=3, trace=True)
    yield "tiny pair 2, adaptive γ from 2", speculative_generate(
        *tiny_pair(2), [5], 40, gamma=2, adaptive_gamma=True, max_gamma=8, trace=True)
    yield "a draft that is the target itself (never wrong), γ = 3", speculative_generate(
        target, target, prompt, 20, gamma=3, trace=True)
    yield "an unrelated random draft, γ = 3", speculative_generate(
        target, tiny_model(7), prompt, 20, gamma=3, trace=True)
    yield "1 new token: the prefill alone, no round", speculative_generate(
        target, draft, prompt, 1, gamma=3, trace=True)
    course_target, tok = load_course_model("target", "cpu")
    course_draft, _ = load_course_model("draft", "cpu")
    # a coin flip: the distilled draft agrees on the whole of a short story (α = 1 there), while
    # here it misses now and then, so a wrong estimator shows
    ids = tok.encode("A coin's state is heads. Alice flips")
    yield "the course pair, greedy, γ = 5", speculative_generate(
        course_target, course_draft, ids, 60, gamma=5, trace=True)
    yield "the course pair, temperature 0.8, γ = 3", speculative_generate(
        course_target, course_draft, ids, 60, gamma=3, temperature=0.8, seed=1, trace=True)


def _alpha_crash_hint(error: Exception) -> str:
    if isinstance(error, ZeroDivisionError):
        return ("a trace with no verification round judged nothing: return 0.0 then (as "
                "stats.alpha does), without dividing by zero")
    return "your function raised on this input"


@one_thread
@guarded
def check_alpha_from_trace(alpha_from_trace) -> None:
    """alpha_from_trace(trace) == the engine's stats.alpha: accepted / (accepted + rejections)
    over the trace's verify events."""
    name = "alpha_from_trace"
    n_cases = 0
    with torch.inference_mode():
        for label, out in _alpha_cases():
            want = out.stats.alpha
            got = call_hinted(name, label, _alpha_crash_hint, alpha_from_trace, list(out.trace))
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                kind = f"{type(got).__module__}.{type(got).__name__}".replace("builtins.", "")
                fail(name, label, want, got, f"return a Python float, not a {kind} (float(...))")
            if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
                hints = dict.fromkeys(h for wrong, h in _alpha_mistakes(out.trace)
                                      if not math.isclose(wrong, want, rel_tol=1e-9, abs_tol=1e-12)
                                      and math.isclose(got, wrong, rel_tol=1e-9, abs_tol=1e-12))
                hint = "; or ".join(hints) or (
                    "sum len(e.accepted) over the verify events, count the verify events with a "
                    "rejection (e.rejected not empty), and divide: accepted / (accepted + "
                    "rejections)")
                fail(name, label, want, got, hint)
            n_cases += 1
    passed(name, n_cases)


# --- exercise 4: choose γ -----------------------------------------------------------------------

def speedup(alpha: float, c: float, gamma: int) -> float:
    """The chapter's formula, (1 - α^(γ+1)) / ((1 - α)(γc + 1)); at α = 1 its limit."""
    tokens = gamma + 1 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def _argmax(values: list[float]) -> int:
    """1 + the index of the first maximum: the smallest γ on a tie."""
    return 1 + values.index(max(values))


def reference_best_gamma(alpha: float, c: float, max_gamma: int) -> int:
    return _argmax([speedup(alpha, c, g) for g in range(1, max_gamma + 1)])


# (α, c, max_gamma): the chapter's measured numbers, edges (α = 0 and 1, c = 0, ties) and small
# max_gamma; every case but the exact ties has a clear winner
GAMMA_CASES = [(0.9, 0.124, 16), (0.9, 0.085, 16), (0.8, 0.05, 16), (0.6, 0.2, 16),
               (0.95, 0.02, 16), (0.5, 0.5, 16), (0.7, 0.1, 8), (0.99, 0.01, 16),
               (0.97, 0.003, 16), (0.3, 0.3, 16), (0.75, 0.05, 16), (0.85, 0.15, 16),
               (0.9, 0.124, 3), (0.9, 0.1, 1), (0.0, 0.1, 16), (0.0, 0.0, 16), (1.0, 0.1, 16),
               (1.0, 0.1, 4), (1.0, 1.0, 16), (1.0, 2.0, 16), (0.9, 0.0, 16), (0.9, 0.0, 12)]


def _gamma_mistakes(alpha: float, c: float, max_gamma: int) -> list[tuple[int, str]]:
    values = [speedup(alpha, c, g) for g in range(1, max_gamma + 1)]
    right = _argmax(values)
    largest = max(g for g, v in enumerate(values, 1) if v == max(values))
    alpha_pow_gamma = [(1 - alpha ** g) / (1 - alpha) / (g * c + 1) if alpha != 1
                       else g / (g * c + 1) for g in range(1, max_gamma + 1)]
    tokens_only = [v * (g * c + 1) for g, v in enumerate(values, 1)]
    return [
        (right - 1, "this is what you get when you return the index of the best value (counted "
                    "from 0) or loop over range(1, max_gamma), which stops before max_gamma: γ "
                    "runs from 1 to max_gamma inclusive"),
        (largest, "on a tie return the SMALLER γ: update the best only on a strictly larger "
                  "speed-up (> not >=)"),
        (_argmax(tokens_only), "this is what you get when you maximise tokens per target pass "
                               "alone: every proposal costs a draft step, so divide by γc + 1"),
        (_argmax(alpha_pow_gamma), "this is what you get with α^γ: a round of γ proposals commits "
                                   "(1 - α^(γ+1)) / (1 - α) tokens, the exponent is γ + 1"),
        (right + 1, "one more than the best γ: this is what you get when you return the γ after "
                    "the best one (an index off by one)"),
    ]


def _gamma_crash_hint(error: Exception) -> str:
    if isinstance(error, ZeroDivisionError):
        return ("at α = 1 the formula is 0/0: every proposal is accepted, so a round commits "
                "its γ proposals and the bonus, γ + 1 tokens (the formula's limit)")
    return "your function raised on this input"


@guarded
def check_best_gamma(best_gamma) -> None:
    """best_gamma(alpha, c, max_gamma) == the γ in 1..max_gamma maximising the chapter's speed-up
    (the smaller on a tie), as an int."""
    name = "best_gamma"
    for alpha, c, max_gamma in GAMMA_CASES:
        case = f"alpha={alpha}, c={c}, max_gamma={max_gamma}"
        want = reference_best_gamma(alpha, c, max_gamma)
        got = call_hinted(name, case, _gamma_crash_hint, best_gamma, alpha, c, max_gamma)
        value = as_int(got)
        if value is None:
            kind = f"{type(got).__module__}.{type(got).__name__}".replace("builtins.", "")
            fail(name, case, want, got, f"return γ as an int, not a {kind}: γ counts proposals "
                 f"(e.g. int(...) of an index, never a float)")
        if value != want:
            if alpha == 1:
                hint = ("at α = 1 the formula is 0/0; its limit is γ + 1 tokens per round, so the "
                        "speed-up is (γ + 1) / (γc + 1)")
            else:
                hints = dict.fromkeys(h for wrong, h in _gamma_mistakes(alpha, c, max_gamma)
                                      if wrong != want and value == wrong)
                hint = "; or ".join(hints) or ("compute (1 - α^(γ+1)) / ((1 - α)(γc + 1)) for "
                                               "every γ in 1..max_gamma and return the γ of the "
                                               "largest")
            fail(name, case, want, value, hint)
    passed(name, len(GAMMA_CASES))

