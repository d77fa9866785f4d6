"""Checkers for chapter 04 (seed 004, speculative decoding: draft, verify, roll back).

- speculative_round: greedy rounds on tiny target/draft pairs, γ = 1..6, looped to 40+ tokens: each
  round's tokens against the chapter's, its passes, both caches whole; the engine's round forbidden.
- residual (a table): the distribution a refused draw is replaced from, for any acceptance a(x).
- alpha_from_trace (a table): α pooled and per proposal index, on real traces; None if unjudged.
- best_gamma (a table): the argmax of the chapter's speed-up formula, as an int.
- predict_perfect_draft (predict, then measure): four counts of a run whose draft is the target.
- accept_sampled (debug): one round of speculative sampling, by its outcomes' distribution.
- choose_gamma (design, a table): γ (0: none) for a batch under the stated cost model.
All on the CPU, in about a second, leaving the caller's random state alone.
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
import operator
from collections import UserList

import torch

from ...engine import GPT, GPTConfig, KVCache, generate, speculative_generate
from ...engine.verify import accept_matching, verify_and_commit
from ..checkpoint import load_course_model
from . import (
    Exercise,
    PassCounter,
    Refused,
    as_int,
    cache_state,
    call_hinted,
    chi_square_p,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    one_thread,
    passed,
    prediction,
    same_cache_prefix,
    tiny_model,
)


def _type(value) -> str:
    return f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")


def _crash_hint(error: type, hint: str, says: str = ""):
    return lambda e: (hint if isinstance(e, error) and says in str(e)
                      else "your function raised on this input")


# --- exercise 1: one speculative round ----------------------------------------------------------

@functools.cache
def tiny_pair(seed: int) -> tuple[GPT, GPT]:
    """A random 2-layer target and the 1-layer draft of its first block, its second block damped
    so that α is about 0.6-0.85. Built once per seed, without touching the caller's RNG."""
    target = tiny_model(seed)
    with torch.no_grad():
        for block in target.transformer.h[1:]:
            block.attn.c_proj.weight.mul_(0.3)
            block.mlp.c_proj.weight.mul_(0.3)
    with torch.random.fork_rng(devices=[]):
        draft = GPT(GPTConfig.preset("tiny", n_layer=1)).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()  # all but blocks 1..
                           if k.split(".")[:2] != ["transformer", "h"] or k.split(".")[2] == "0"})
    return target, draft


# (pair seed, prompt, γ): γ = 1..6, several prompts, each run to 40+ new tokens
ROUND_CASES = [(0, [3, 17, 200, 41, 9], 1), (1, [100, 7], 2), (2, [3, 17, 200, 41, 9], 3),
               (1, [55, 56, 57, 58, 59, 60, 61, 62], 4), (1, [5], 5), (2, [100, 7], 6),
               (0, [100, 7], 3)]
NEW_TOKENS = 40


def _matching(proposals, choices, shift=0):
    """Leading proposals equal to the target's choice `shift` rows later."""
    n = 0
    while n < len(proposals) and n + shift < len(choices) and proposals[n] == choices[n + shift]:
        n += 1
    return n


# hint -> what a wrong round commits, from the proposals and the target's choices: the ones it may
# commit ([] where the mistake changes nothing)
COMMIT_MISTAKES = {
    "this is what you get when you commit the DRAFT's token at the first mismatch: the target "
    "disagreed with it, so commit the target's own token there (its choice at that row)":
        lambda p, c: [p[:_matching(p, c) + 1]] if _matching(p, c) < len(p) else [],
    "this is what you get when you forget the bonus token: when all γ proposals are accepted, the "
    "target's last row (row γ) still gives one more token of its own, for free":
        lambda p, c: [list(p)] if _matching(p, c) == len(p) else [],
    "this is what you get when you are off by one in the target's rows: the pass fed seq[-1] + "
    "proposals, so row 0 (the output at the last committed token) scores proposal 1, row i scores "
    "proposal i + 1, and row γ gives the bonus": lambda p, c: [
        p[:_matching(p, c, 1)] + c[_matching(p, c, 1) + 1:][:1]] + (
        [p[:_matching(p, c)] + c[_matching(p, c) + 1:][:1]] if _matching(p, c) < len(p) else []),
    "this is what you get when you keep every proposal that matches: only the matching PREFIX is "
    "accepted, everything after the first mismatch is thrown away":
        lambda p, c: [[x for x, y in zip(p, c) if x == y] + [c[sum(map(operator.eq, p, c))]]],
}


CROP_WITHOUT_MIN = _crash_hint(  # the engine's message names the crop
    ValueError, "this is what you get when you roll back with crop(len(seq) - 1) without min(...): "
    "after a fully accepted round the draft's cache is SHORTER than len(seq) - 1 (it never fed its "
    "last proposal, nor the bonus token), and a cache cannot grow by a crop; crop each cache to "
    "min(its length, len(seq) - 1)", says="crop")


def _pass_hints(target_passes, draft_passes, gamma, first_draft_rows, seq_len):
    """(expected, got, hint) for the first wrong pass count or shape, or None."""
    want_t = [(1, gamma + 1)]
    if target_passes != want_t:
        hint = next(h for wrong, h in (
            (len(target_passes) > 1,
             "this is what you get when you score the proposals one target pass each: the point of "
             "speculative decoding is ONE target pass over seq[-1:] + proposals (γ + 1 rows), "
             "scoring every proposal at once"),
            (target_passes == [(1, gamma)],
             "this is what you get when you feed the target only the proposals: its cache holds "
             "everything but the last committed token, so feed seq[-1:] + proposals"),
            (target_passes == [(1, seq_len + gamma)],
             "this is what you get when you feed the target the whole sequence again: its cache "
             "already holds everything but the last committed token; feed seq[-1:] + proposals"),
            (not target_passes,
             "the target must score the proposals: one pass over seq[-1:] + proposals"),
            (True, "one target pass over seq[-1:] + proposals: shape (1, γ + 1)")) if wrong)
        return f"target passes of shape {want_t}", f"{target_passes}", hint
    want_d = [(1, first_draft_rows)] + [(1, 1)] * (gamma - 1)
    if draft_passes != want_d:
        hint = next(h for wrong, h in (
            (len(draft_passes) != gamma,
             f"one draft pass per proposal: γ = {gamma} passes, each feeding what the draft cache "
             f"has not seen yet, then proposing one token"),
            (draft_passes[:1] == [(1, 1)] and first_draft_rows > 1,
             "this is what you get when the draft's first pass feeds only the last committed "
             "token: it must feed everything its cache has not seen, "
             "seq[d_cache.get_seq_length():] (after a fully accepted round the draft never fed "
             "its last proposal, so that is 2 tokens)"),
            (draft_passes[:1] == [(1, seq_len)],
             "this is what you get when the draft re-feeds the whole sequence: feed only what its "
             "cache has not seen yet, seq[d_cache.get_seq_length():]"),
            (True, "pass 1 feeds seq[d_cache.get_seq_length():], then each pass feeds the previous "
                   "proposal (one token)")) if wrong)
        return f"draft passes of shape {want_d}", f"{draft_passes}", hint
    return None


def _cache_length_hint(name: str, got: int, want: int, after_pass: int, seq_len: int) -> str:
    return next(hint for wrong, hint in (
        (got == 0 and want > 0,
         f"this is what you get when you reset the {name} cache (or crop it to 0): a rollback "
         f"keeps everything up to the last committed token; only the rejected positions go"),
        (got == after_pass > want,
         f"this is what you get when you do not crop the {name} cache: it still holds K/V of "
         f"rejected proposals; crop it to min(its length, len(seq) - 1)"),
        (got == seq_len - 1 > want,
         f"the {name} cache grew: after a fully accepted round it is shorter than len(seq) - 1 "
         f"and must stay so; crop to min(its length, len(seq) - 1), never beyond its length"),
        (got == seq_len,
         "keep K/V up to the last committed token, not including it: the newest token has no K/V "
         "yet (it is fed next round), so at most len(seq) - 1 positions"),
        (True, "crop both caches to min(their length, len(seq) - 1) after committing")) if wrong)


def _check_round(name, case, round_fn, target, draft, seq, t_cache, d_cache, gamma) -> None:
    """Run one round of the learner's and check everything it did."""
    before_seq, t_before, d_before = list(seq), cache_state(t_cache), cache_state(d_cache)
    proposals, d_fork = [], d_cache.fork()  # the chapter's round, on forks of the caches
    for _ in range(gamma):
        pending = (before_seq + proposals)[d_fork.get_seq_length():]
        proposals.append(int(draft(torch.tensor([pending]), cache=d_fork, last_only=True)[0, -1]
                             .argmax()))
    choices = target(torch.tensor([seq[-1:] + proposals]), cache=t_cache.fork())[0].argmax(-1)
    choices = choices.tolist()  # the target's choice at each of its γ + 1 rows
    n = _matching(proposals, choices)
    expected = proposals[:n] + [choices[n]]
    case = f"{case}, round at len(seq) = {len(before_seq)}"
    with forbid(name, speculative_generate, verify_and_commit, accept_matching), \
            PassCounter(target) as t_passes, PassCounter(draft) as d_passes:
        got = call_hinted(name, case, CROP_WITHOUT_MIN, round_fn, target, draft, seq, t_cache,
                           d_cache, gamma)
    # what it returned, and what it did to seq
    tokens = int_list(got)
    if tokens is None:
        fail(name, case, expected, got,
             "your function returned None: return the tokens it appended to seq (a list of ints)"
             if got is None else f"return the tokens the round appended to seq as a list of "
             f"ints, not a {_type(got)}")
    expect(seq != before_seq, name, case, f"seq extended by {expected}", "seq unchanged",
           "append the committed tokens to seq in place (seq.extend(...)), then return them")
    expect(seq == before_seq + tokens, name, case, f"seq == seq before the round + the returned "
           f"tokens ({tokens})", f"seq grew by {seq[len(before_seq):]}",
           "append exactly the tokens you return, in place, and nothing else")
    # the passes it made
    wrong = _pass_hints(t_passes.passes, d_passes.passes, gamma, len(before_seq) - d_before[0],
                        len(before_seq))
    if wrong:
        fail(name, case, *wrong)
    # what it committed
    if tokens != expected:
        hints = [h for h, wrong in COMMIT_MISTAKES.items() if tokens in wrong(proposals, choices)]
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
        fresh = KVCache.for_model(model, max_len=max(want, 1))  # the committed tokens' K/V
        if want:
            model(torch.tensor([seq[:want]]), cache=fresh)
        if not same_cache_prefix(before, cache, min(before[0], want)) or not all(
                torch.allclose(a[:, :, :want], b[:, :, :want], atol=1e-4, rtol=1e-4)
                for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values)):
            fail(name, case, f"the {label} cache's K/V (every layer, keys and values) equal to a "
                 f"fresh computation of the first {want} committed tokens",
                 "different K/V",
                 "this is what you get when you zero, reset or overwrite cache entries: a "
                 "rollback only moves the length back (cache.crop), it never rewrites the K/V "
                 "it keeps; and every token must be fed at its own position, once")


@one_thread
@guarded
def check_speculative_round(speculative_round) -> None:
    """speculative_round(target, draft, seq, t_cache, d_cache, gamma) -> the tokens one greedy
    round commits (seq extended in place, both caches cropped), looped to 40+ tokens."""
    name = "speculative_round"
    with torch.inference_mode():
        for seed, prompt, gamma in ROUND_CASES:
            target, draft = tiny_pair(seed)
            case = f"prompt {prompt}, γ = {gamma}"
            t_cache, d_cache = (KVCache.for_model(m, max_len=len(prompt) + NEW_TOKENS + gamma + 2)
                                for m in (target, draft))
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
    p, q = (torch.rand(n, generator=g, dtype=torch.float64) ** 3 for _ in range(2))
    return p / p.sum(), q / q.sum()


def _normalised(t: torch.Tensor) -> torch.Tensor:
    return t / t.sum()


def chapter_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)), section 5's rule (1 where the draft never proposes x: q(x) = 0)."""
    return torch.where(q > 0, (p / q.clamp(min=1e-300)).clamp(max=1), torch.ones_like(p))


def reference_residual(p: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """What acceptance leaves of p, p(x) - q(x) a(x), as a distribution: the only r with which
    q a + (1 - Σ q a) r = p."""
    return _normalised((p - q * a).clamp(min=0))


# (label, the acceptance rule a(x) from p and q): the chapter's rule, then rules it does not answer
ACCEPTANCE_RULES = [
    ("section 5's rule a = min(1, p/q)", chapter_acceptance),
    ("a cautious rule that accepts half as often, a = min(1, p/q) / 2",
     lambda p, q: chapter_acceptance(p, q) / 2),
    ("a rule that never accepts, a = 0", lambda p, q: torch.zeros_like(p)),
    ("a stricter rule, a = min(1, p/q) squared", lambda p, q: chapter_acceptance(p, q) ** 2),
]


def _as_list(t) -> list:
    return [round(x, 4) for x in t.tolist()]


def _residual_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(p, q, a), a labelled with its rule; the rejection branch has a positive probability in
    every case (p differs from q). The last 8: one speculative step under each rule."""
    pairs = [_distributions(s) for s in range(8)]
    pairs.append((torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64),
                  torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)))
    pairs.append((torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])))
    labelled = [(label, p, q, rule) for i, (label, rule) in enumerate(ACCEPTANCE_RULES)
                for p, q in (pairs if i == 0 else pairs[2 * i:2 * i + 3] + pairs[-2:])]
    labelled += [(f"one speculative step under {label}", *_distributions(s), rule)
                 for s, (label, rule) in zip(range(20, 28), ACCEPTANCE_RULES * 2)]
    cases = []
    for label, p, q, rule in labelled:
        a = rule(p, q).to(p.dtype)
        a.label = label
        cases.append((p, q, a))
    return cases


def _as_distribution(got, p, q, a):
    if not isinstance(got, torch.Tensor):
        raise Refused(f"return a torch tensor (a probability vector like p), not a {_type(got)}")
    if got.shape != p.shape or not got.is_floating_point():
        raise Refused("one probability per token: the same shape as p",
                      f"a float tensor of shape {tuple(p.shape)}")
    return got


def _residual_otherwise(runs) -> str:
    p, q, a = next(case for case, got in runs if not RESIDUAL.same(got, reference_residual(*case)))
    if a.label.startswith("one speculative step"):
        return ("the residual decides where refused draws go; it must fill exactly what acceptance "
                "leaves of p")
    return ("what p(x) still lacks once acceptance has delivered its share of x (drafted, then "
            "accepted), divided by its sum")


RESIDUAL = Exercise(
    "residual", cases=_residual_cases(),
    describe=lambda p, q, a: f"{a.label}: p={_as_list(p)}, q={_as_list(q)}, a={_as_list(a)}",
    reference=reference_residual, returns=_as_distribution, show=_as_list,
    same=lambda got, want: torch.allclose(got.double(), want.double(), atol=1e-6),
    unchanged="this is what you get with in-place operations (p.sub_, clamp_, /=): they change "
              "the caller's tensors; compute a new tensor",
    mistakes={
        "this is what you get with norm(max(0, p - q)) whatever a is: that is the residual of "
        "section 5's rule only, a = min(1, p/q). Work out what acceptance delivers to each token "
        "x under THIS a (drafted with probability q(x), then accepted with probability a(x)), and "
        "what is left of p(x)": lambda p, q, a: _normalised((p - q).clamp(min=0)),
        "this is what you get when you forget to normalise: divide what is left of p by its sum, "
        "so the residual is a distribution": lambda p, q, a: (p - q * a).clamp(min=0),
        "this is what you get with |p - q|: it puts mass where the draft proposed too MUCH "
        "(q > p), which acceptance already over-serves; keep only what p still lacks":
            lambda p, q, a: _normalised((p - q).abs()),
        "this is what you get when you resample from p itself: the tokens the draft proposes "
        "often are then over-represented (accepted AND resampled)": lambda p, q, a: p,
        "this is what you get with max(0, q - p): that is where the draft over-proposes; the "
        "residual is where the TARGET wants more than acceptance gave":
            lambda p, q, a: _normalised((q - p).clamp(min=0)),
        "this is what you get when you resample from the draft's q": lambda p, q, a: q,
        "this is what you get with p(x)(1 - a(x)): a(x) is the chance of accepting x once the "
        "DRAFT proposed it, so acceptance delivers q(x)a(x) of x, not p(x)a(x)":
            lambda p, q, a: _normalised(p * (1 - a)),
        "this is what you get with q(x)(1 - a(x)), where the refused drafts came from: drawing "
        "there re-proposes the refused tokens instead of filling what p still lacks":
            lambda p, q, a: _normalised(q * (1 - a)),
    },
    otherwise=_residual_otherwise)
check_residual = RESIDUAL.check


# --- exercise 3: α from a trace -----------------------------------------------------------------

def _rounds(trace) -> list[tuple[int, bool, int]]:
    """(accepted, ended in a rejection?, proposals) of each verification round."""
    return [(len(e.accepted), bool(e.rejected), len(e.input_ids))
            for e in trace if e.kind == "verify"]


def reference_alpha(trace, index: int | None = None) -> float | None:
    """α pooled over the trace (index None), or of the index-th proposal of a round (0: the
    first): accepted / judged, None when nothing was judged. Proposal i of a round is judged when
    every proposal before it was accepted, and a round stops at its first rejection."""
    rounds = _rounds(trace)
    if index is None:
        accepted = sum(a for a, _, _ in rounds)
        judged = accepted + sum(r for _, r, _ in rounds)
    else:
        accepted = sum(a > index for a, _, _ in rounds)
        judged = accepted + sum(a == index and r for a, r, _ in rounds)
    return accepted / judged if judged else None


def _ratio(a, b):
    return a / b if b else None


def _pooled(wrong):
    """A wrong pooled α, of the rounds' (accepted, rejected?, proposed); right at every index."""
    return lambda trace, index=None: (wrong(_rounds(trace), sum(a for a, _, _ in _rounds(trace)))
                                      if index is None else reference_alpha(trace, index))


def _alpha_otherwise(runs) -> str:
    """The hint when no pooled mistake explains the answers: a per-index mistake names its index."""
    (trace, index), got = next((case, got) for case, got in runs
                               if not _same(got, reference_alpha(*case)))
    rounds, i = _rounds(trace), index or 0
    ok = sum(a > i for a, _, _ in rounds)
    mistakes = [] if index is None else [
        (_ratio(ok, sum(n > i for _, _, n in rounds)),
         f"this is what you get when every round that PROPOSED a proposal number {i} counts it as "
         f"judged: after a rejection earlier in its round it was never judged (a round stops at "
         f"its first rejection); count it only where every proposal before it was accepted"),
        (_ratio(ok, len(rounds)),
         "this is what you get when you divide by every round: only the rounds that judged this "
         "proposal count"),
        (reference_alpha(trace, None),
         "this is α pooled over every proposal: index asks about one position in the round"),
    ] + [(reference_alpha(trace, i + shift), f"this is the α of proposal {i + shift}: index "
          f"counts from 0 (index=0 is the first proposal of a round)")
         for shift in (1, -1) if i + shift >= 0]
    hints = [h for wrong, h in mistakes if wrong is not None and _same(got, wrong)]
    return "; or ".join(dict.fromkeys(hints)) or (
        "α = accepted / judged: a proposal is judged when every proposal before it in its round "
        "was accepted; the first rejection ends the round")


class _Trace(tuple):
    """A trace's events (which cannot be changed), labelled with the run they come from."""

    def __new__(cls, label: str, events):
        trace = super().__new__(cls, events)
        trace.label = label
        return trace

    def __reduce__(self):  # copy.deepcopy, which the runner gives the learner
        return _Trace, (self.label, tuple(self))


class _Lazy(UserList):
    """Cases made on first use: those that run the models wait for the check."""

    def __init__(self, make):  # not UserList's: `data` is made when first read
        self.make = make

    data = functools.cached_property(lambda self: self.make())


def _alpha_runs():
    """(label, the run)."""
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


def _alpha_cases() -> list[tuple]:
    """(trace, None) for every run, then (trace, index) up to past its longest round."""
    with torch.inference_mode():
        traces = [_Trace(label, out.trace) for label, out in _alpha_runs()]
    return [(t, None) for t in traces] + [
        (t, i) for t in traces for i in range(max((n for _, _, n in _rounds(t)), default=0) + 2)]


def _same(got, want) -> bool:
    return got is want if got is None or want is None else math.isclose(got, want, rel_tol=1e-9,
                                                                         abs_tol=1e-12)


def _as_alpha(got, trace, index):
    if reference_alpha(trace, index) is None:
        if got is not None:
            raise Refused("nothing was judged here: return None (n/a), not a number; 0.0 would "
                          "read as 'every proposal was rejected'")
        return None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise Refused("a proposal was judged here, so α is a number: return a Python float"
                      if got is None else f"return a Python float, not a {_type(got)} (float(...))")
    return got


ALPHA = Exercise(
    "alpha_from_trace", cases=_Lazy(_alpha_cases),
    describe=lambda trace, index: trace.label + ("" if index is None else f", index={index}"),
    reference=reference_alpha, returns=_as_alpha, same=_same,
    raised=_crash_hint(ZeroDivisionError, "nothing was judged: return None (n/a) then, without "
                       "dividing by zero"),
    mistakes={
        "this is what you get with accepted / proposed: it counts the proposals after a round's "
        "first rejection, which the target never judged, as rejected, so it reads α too low (the "
        "more so the longer γ)": _pooled(lambda r, ok: _ratio(ok, sum(n for _, _, n in r))),
        "this is what you get when every round counts as a rejection: a fully accepted round ends "
        "in the bonus token, not in a rejection": _pooled(lambda r, ok: _ratio(ok, ok + len(r))),
        "this is what you get when you average each round's rate: pool the judgements of the "
        "whole trace": _pooled(lambda r, ok: _ratio(sum(a / n for a, _, n in r if n),
                                                    sum(n > 0 for _, _, n in r))),
        "this is what you get when you count the target's own token as an accepted proposal: only "
        "the draft's proposals are judged": _pooled(lambda r, ok: _ratio(
            ok + len(r), ok + len(r) + sum(j for _, j, _ in r))),
        "this is the fraction of rounds without a rejection, not of judged proposals accepted":
            _pooled(lambda r, ok: _ratio(len(r) - sum(j for _, j, _ in r), len(r))),
    },
    otherwise=_alpha_otherwise)
check_alpha_from_trace = ALPHA.check


# --- exercise 4: choose γ -----------------------------------------------------------------------

def speedup(alpha: float, c: float, gamma: int) -> float:
    """The chapter's formula, (1 - α^(γ+1)) / ((1 - α)(γc + 1)); at α = 1 its limit."""
    tokens = gamma + 1 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def _argmax(values: list[float], lo: int = 1) -> int:
    """lo + the index of the first maximum: the smallest γ on a tie."""
    return lo + values.index(max(values))


def reference_best_gamma(alpha: float, c: float, max_gamma: int) -> int:
    return _argmax([speedup(alpha, c, g) for g in range(1, max_gamma + 1)])


def _as_gamma(got, *case):
    if as_int(got) is None:
        raise Refused(f"return γ as an int, not a {_type(got)}: γ counts proposals (e.g. int(...) "
                      f"of an index, never a float)")
    return as_int(got)


ALPHA_1 = ("at α = 1 the formula is 0/0; its limit is γ + 1 tokens per round, so the speed-up is "
           "(γ + 1) / (γc + 1)")
BEST_GAMMA = Exercise(
    "best_gamma",
    # the chapter's measured numbers, edges (α = 0 and 1, c = 0, ties) and small max_gamma; every
    # case but the exact ties has a clear winner
    cases=[(0.9, 0.124, 16), (0.9, 0.085, 16), (0.8, 0.05, 16), (0.6, 0.2, 16), (0.95, 0.02, 16),
           (0.5, 0.5, 16), (0.7, 0.1, 8), (0.99, 0.01, 16), (0.97, 0.003, 16), (0.3, 0.3, 16),
           (0.75, 0.05, 16), (0.85, 0.15, 16), (0.9, 0.124, 3), (0.9, 0.1, 1), (0.0, 0.1, 16),
           (0.0, 0.0, 16), (1.0, 0.1, 16), (1.0, 0.1, 4), (1.0, 1.0, 16), (1.0, 2.0, 16),
           (0.9, 0.0, 16), (0.9, 0.0, 12), (1.0, 0.7, 16)],
    describe=lambda alpha, c, max_gamma: f"alpha={alpha}, c={c}, max_gamma={max_gamma}",
    reference=reference_best_gamma, returns=_as_gamma,
    raised=_crash_hint(ZeroDivisionError, "at α = 1 the formula is 0/0: every proposal is "
                       "accepted, so a round commits its γ proposals and the bonus, γ + 1 tokens "
                       "(the formula's limit)"),
    mistakes={
        ALPHA_1: lambda alpha, c, m: 1 if alpha == 1 else reference_best_gamma(alpha, c, m),
        "this is what you get when you return the index of the best value (counted from 0) or "
        "loop over range(1, max_gamma), which stops before max_gamma: γ runs from 1 to max_gamma "
        "inclusive": lambda alpha, c, m: reference_best_gamma(alpha, c, m) - 1,
        "on a tie return the SMALLER γ: update the best only on a strictly larger speed-up (> not "
        ">=)": lambda alpha, c, m: m + 1 - _argmax([speedup(alpha, c, g) for g in range(m, 0, -1)]),
        "this is what you get when you maximise tokens per target pass alone: every proposal "
        "costs a draft step, so divide by γc + 1": lambda alpha, c, m: reference_best_gamma(
            alpha, 0.0, m),
        "this is what you get with α^γ: a round of γ proposals commits (1 - α^(γ+1)) / (1 - α) "
        "tokens, the exponent is γ + 1": lambda alpha, c, m: _argmax(
            [(g if alpha == 1 else (1 - alpha ** g) / (1 - alpha)) / (g * c + 1)
             for g in range(1, m + 1)]),
        "one more than the best γ: this is what you get when you return the γ after the best one "
        "(an index off by one)": lambda alpha, c, m: reference_best_gamma(alpha, c, m) + 1,
    },
    otherwise=lambda runs: ALPHA_1 if next(case for case, got in runs
                                           if got != reference_best_gamma(*case))[0] == 1 else (
        "compute (1 - α^(γ+1)) / ((1 - α)(γc + 1)) for every γ in 1..max_gamma and return the γ "
        "of the largest"))
check_best_gamma = BEST_GAMMA.check


# --- exercise 5 (predict, then measure): a draft that is never wrong ----------------------------

PERFECT_PROMPT, PERFECT_NEW, PERFECT_GAMMA = "Once upon a time", 30, 4
PREDICTED = {"target_passes": "target forward passes", "draft_passes": "draft forward passes",
             "target_kv": "K/V vectors the target computes (per layer)",
             "draft_kv": "K/V vectors the draft computes (per layer)"}


def perfect_draft_run() -> tuple[int, object, dict[str, int]]:
    """The run predicted, measured by the engine: (prompt length, its output, {quantity: count})."""
    target, tok = load_course_model("target", "cpu")
    ids = tok.encode(PERFECT_PROMPT)
    with torch.inference_mode():
        out = speculative_generate(target, target, ids, PERFECT_NEW, gamma=PERFECT_GAMMA,
                                   trace=True)
    kv = lambda *kinds: sum(e.kv_computed for e in out.trace if e.kind in kinds)  # noqa: E731
    return len(ids), out, {"target_passes": out.stats.target_passes,
                           "draft_passes": out.stats.draft_passes,
                           "target_kv": kv("prefill", "verify"), "draft_kv": kv("draft")}


def _prediction_mistakes(P: int, N: int, gamma: int, rounds: int, proposed: int,
                         draft_passes: int) -> dict[str, list[tuple[int, str]]]:
    """For each quantity, (a usual wrong prediction, the reasoning that gives it)."""
    R = rounds
    return {
        "target_passes": [
            (R, "you counted the rounds only: the prefill is a target pass too (it reads the "
                "prompt and commits the first new token by itself)"),
            (1 + math.ceil((N - 1) / gamma),
             "you let a round commit γ tokens: with every proposal accepted it commits γ + 1, "
             "the target's last row giving a bonus token of its own, for free"),
            (math.ceil(N / gamma), "you let a round commit γ tokens (it commits γ + 1: the "
                                   "bonus) and forgot the prefill's pass"),
            (N, "one target pass per token is target-only decoding: here each round commits "
                "several"),
        ],
        "draft_passes": [
            (R * gamma, "you gave every round γ proposals: the run stops at max_new_tokens, so "
                        "the last round proposes only what the budget leaves (the tokens left, "
                        "less the target's own token)"),
            (N - 1, "you gave every token after the first a draft pass: the bonus tokens come "
                    "from the target's verification pass, never from the draft"),
            (N, "one draft pass per token: the first token comes from the prefill and the "
                "bonus tokens from the target, so the draft proposes fewer"),
            ((R + 1) * gamma, "the prefill is the target's alone: the draft proposes only in "
                              "the rounds"),
        ],
        "target_kv": [
            (P + N, "the last committed token is never fed to the target (it is produced by "
                    "the last pass and nothing follows it), and the last round verifies fewer "
                    "rows: P + N counts one K/V too many"),
            (P + R * (gamma + 1), "you gave the last round γ + 1 rows: it has fewer proposals"),
            (N - 1, "you forgot the prompt: the prefill computes its K/V, one per prompt token"),
            (P + proposed, "a verification pass feeds the last committed token AND the "
                           "proposals: γ + 1 rows, not γ"),
            ((R + 1) * (gamma + 1), "the prefill feeds the prompt, not γ + 1 rows"),
        ],
        "draft_kv": [
            (draft_passes, "you counted one row per draft pass: a round's first draft pass "
                           "feeds everything the draft's cache has not seen: the prompt and the "
                           "first token in round 1, then two tokens after each fully accepted "
                           "round (its own last proposal, never fed, and the target's bonus)"),
            (draft_passes - 1 + P + 1, "you caught the draft up once, in round 1: after every "
                                       "fully accepted round its first pass feeds 2 tokens (its "
                                       "own last proposal and the target's bonus)"),
            (P + N - 1, "the draft's cache ends TWO behind the sequence, not one: after the "
                        "last round it has fed neither its last proposal nor the target's bonus"),
            (P + N, "the draft never sees the last two committed tokens (its last proposal and "
                    "the bonus): its cache ends two behind the sequence"),
        ],
    }


@one_thread
@guarded
def check_predict_perfect_draft(predict_perfect_draft) -> None:
    """predict_perfect_draft() -> {"target_passes", "draft_passes", "target_kv", "draft_kv"}: the
    counts of speculative_generate(target, target, "Once upon a time", 30, gamma=4)."""
    name = "predict_perfect_draft"
    case = (f"speculative_generate(target, target, tok.encode({PERFECT_PROMPT!r}), "
            f"{PERFECT_NEW}, gamma={PERFECT_GAMMA}): the target as its own draft, greedy")
    got = prediction(name, case, predict_perfect_draft, speculative_generate, generate,
                     verify_and_commit, GPT.forward)
    if not isinstance(got, dict) or set(got) != set(PREDICTED):
        fail(name, case, f"a dict with the keys {sorted(PREDICTED)}",
             sorted(got) if isinstance(got, dict) else got,
             "return your four predictions as a dict, one int per key"
             + (" (did you forget to return it?)" if got is None else ""))
    for key, value in got.items():
        expect(as_int(value) is not None, name, case, f"{key}: an int", f"{key}: {value!r}",
               "a count is a whole number: predict it, do not compute a fraction")
    P, out, measured = perfect_draft_run()
    assert out.stats.rejected == 0, ("this machine's target disagreed with itself at a near-tie "
                                     "(chapter 05): the run this prediction is about needs α = 1")
    mistakes = _prediction_mistakes(P, PERFECT_NEW, PERFECT_GAMMA, out.stats.rounds,
                                    out.stats.proposed, measured["draft_passes"])
    wrong = [key for key in PREDICTED if as_int(got[key]) != measured[key]]
    if wrong:
        key, you = wrong[0], as_int(got[wrong[0]])
        hints = [h for w, h in mistakes[key] if w != measured[key] and w == you]
        reason = "; or ".join(dict.fromkeys(hints)) or (
            "reason round by round: what each pass feeds, and what each round commits "
            "(chapter sections 1 and 2)")
        others = f" (and {len(wrong) - 1} more of your predictions)" if len(wrong) > 1 else ""
        fail(name, f"{case}: {PREDICTED[key]}{others}", measured[key], you,
             f"you predicted {you} {PREDICTED[key]}; the engine counted {measured[key]}: "
             f"{reason}")
    print(f"  measured: {measured['target_passes']} target and {measured['draft_passes']} draft "
          f"passes, {measured['target_kv']} and {measured['draft_kv']} K/V vectors per layer "
          f"for {PERFECT_NEW} new tokens after a {P}-token prompt")
    passed(name, len(PREDICTED))


# --- exercise 6 (debug): one round of speculative sampling ---------------------------------------

def accept_sampled_buggy(p, q, proposals, generator):
    """The notebook's broken round, verbatim: the bonus token is drawn from row γ - 1 (the loop
    variable left over from the loop), not from row γ."""
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * q[i, x] >= p[i, x]:           # refused: u >= p(x) / q(x)
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[i], 1, generator=generator))  # noqa: F821


def _chapter_accept(p, q):
    return min(1.0, p / q) if q > 0 else 1.0


def _norm_max(p_row, q_row):
    return _normalised((p_row - q_row).clamp(min=0))


RIGHT_RULE = (_chapter_accept, _norm_max, lambda p, q, g: p[g])
# ((accept, residual, bonus): the rule a usual mistake runs, the symptom and the mistake)
SAMPLED_MISTAKES = [
    ((_chapter_accept, _norm_max, lambda p, q, g: p[g - 1] if g else p[0]),
     "symptom: when every proposal is accepted, the token after them follows the distribution "
     "of the LAST PROPOSAL's position, not of the position after it. The bonus is drawn from "
     "row γ of p (the target's output after the last proposal); after the loop, i is γ - 1, "
     "the last proposal's row (and with no proposal at all it is not defined)"),
    ((_chapter_accept, _norm_max, lambda p, q, g: q[g - 1] if g else p[0]),
     "symptom: the bonus token follows the draft's distribution: draw it from the target's "
     "row γ"),
    ((_chapter_accept, lambda p_row, q_row: p_row, lambda p, q, g: p[g]),
     "symptom: after a refusal, the tokens the draft likes come out too often: a refused draw "
     "is replaced from the residual norm(max(0, p - q)), not from p"),
    ((lambda p, q: min(1.0, q / p) if p > 0 else 1.0, _norm_max, lambda p, q, g: p[g]),
     "symptom: proposals the target likes MORE than the draft are refused most: the chance "
     "to accept is min(1, p(x)/q(x)); u * q(x) >= p(x) means u >= p/q, a refusal"),
    ((lambda p, q: 1.0, _norm_max, lambda p, q, g: p[g]),
     "symptom: every proposal is accepted: the draft's distribution comes out, not the "
     "target's; refuse x with probability 1 - min(1, p(x)/q(x))"),
    ((_chapter_accept, lambda p_row, q_row: _normalised((p_row - q_row).abs()),
           lambda p, q, g: p[g]),
     "symptom: a refused draw can be replaced by a token the draft over-proposes: the residual "
     "is max(0, p - q), not |p - q|"),
]


def outcome_distribution(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                         rule: tuple) -> torch.Tensor:
    """Exact probability of every outcome (accepted k, token y) of one round by `rule` (accept,
    residual, bonus), as a tensor (γ + 1, vocab): k accepted, then y from row k's residual or the
    bonus."""
    (accept, residual, bonus), gamma, reach = rule, len(proposals), 1.0
    out = torch.zeros(gamma + 1, p.size(1), dtype=torch.float64)
    for i, x in enumerate(proposals):
        keep = accept(float(p[i, x]), float(q[i, x]))
        out[i] = reach * (1 - keep) * residual(p[i], q[i]).double()
        reach *= keep
    out[gamma] = reach * bonus(p, q, gamma).double()
    return out




def _sampled_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, list[int]]]:
    """(what the case is about, p (γ + 1, vocab), q (γ, vocab), proposals)."""
    rows = lambda *r: torch.tensor(r, dtype=torch.float32)  # noqa: E731
    return [
        ("γ = 2, both proposals always accepted (the bonus decides)",
         rows([.10, .40, .20, .20, .10], [.30, .10, .10, .40, .10], [.05, .05, .10, .10, .70]),
         rows([.20, .30, .20, .20, .10], [.25, .25, .20, .20, .10]), [1, 3]),
        ("γ = 1, the proposal accepted half the time",
         rows([.10, .20, .30, .40], [.70, .10, .10, .10]), rows([.10, .40, .30, .20]), [1]),
        ("γ = 3, the second proposal often refused",
         rows([.30, .30, .20, .20], [.10, .10, .40, .40], [.25, .25, .25, .25],
              [.60, .20, .10, .10]),
         rows([.30, .20, .30, .20], [.10, .60, .20, .10], [.20, .30, .20, .30]), [0, 1, 2]),
        ("γ = 2, a first proposal the target never makes (always refused)",
         rows([.50, .00, .30, .20], [.10, .20, .30, .40], [.25, .25, .25, .25]),
         rows([.20, .30, .30, .20], [.25, .25, .25, .25]), [1, 0]),
        ("no proposal at all (the last round when one token is left)",
         rows([.10, .60, .20, .10]), torch.zeros(0, 4), []),
    ]


TRIALS = 2400


@guarded
def check_accept_sampled(accept_sampled) -> None:
    """accept_sampled(p, q, proposals, generator) -> (accepted, token): one round of speculative
    sampling, whose outcomes over seeded trials follow the closed form of section 5's rule."""
    name, cases = "accept_sampled", _sampled_cases()
    crashed = _crash_hint((NameError, UnboundLocalError), "with no proposal the loop never runs, "
                          "so its variable i is not defined: the bonus comes from row "
                          "len(proposals) of p, which exists even then")
    for label, p, q, proposals in cases:
        case = f"{label}: p rows {[_as_list(r) for r in p]}, q rows " \
               f"{[_as_list(r) for r in q]}, proposals {proposals}, {TRIALS} seeded trials"
        p_in, q_in = p.clone(), q.clone()

        def outcome(g):
            got = call_hinted(name, case, crashed, accept_sampled, p_in, q_in, list(proposals), g)
            pair = int_list(got) if isinstance(got, (tuple, list)) else None
            expect(pair is not None and len(pair) == 2, name, case, "(accepted, token): two ints",
                   got, "return how many proposals are kept and the target's token after them")
            expect(0 <= pair[0] <= len(proposals) and 0 <= pair[1] < p.size(1), name, case,
                   f"accepted in 0..{len(proposals)}, a token in 0..{p.size(1) - 1}", tuple(pair),
                   "accepted counts proposals kept")
            return tuple(pair)
        seeds = [1_000 * t + len(proposals) for t in range(TRIALS)]  # one generator per trial
        results = [outcome(torch.Generator().manual_seed(s)) for s in seeds]
        expect(torch.equal(p_in, p) and torch.equal(q_in, q), name, case, "p and q left as they "
               "were", "they changed", "no in-place operations on p or q: other rounds read them")
        buggy = None  # the buggy round's outcomes, where it runs (it crashes with no proposal)
        with contextlib.suppress(NameError, UnboundLocalError):
            buggy = [accept_sampled_buggy(p, q, list(proposals), torch.Generator().manual_seed(s))
                     for s in seeds]
        counts = torch.zeros(len(proposals) + 1, p.size(1))
        for k, y in results:
            counts[k, y] += 1
        want = outcome_distribution(p, q, proposals, RIGHT_RULE)
        if chi_square_p(counts, want) < 1e-6:
            fits = [h for rule, h in SAMPLED_MISTAKES
                    if not torch.allclose(outcome_distribution(p, q, proposals, rule), want,
                                          atol=1e-9)
                    and chi_square_p(counts, outcome_distribution(p, q, proposals, rule)) > 1e-4]
            hint = ("this is accept_sampled_buggy unchanged, trial for trial: "
                    + SAMPLED_MISTAKES[0][1]) if results == buggy else "; or ".join(fits) or (
                "accept proposal i with probability min(1, p_i(x)/q_i(x)); at the first refusal "
                "draw from norm(max(0, p_i - q_i)); after all γ, the bonus from p_γ")
            fail(name, case, "outcomes distributed as the rule says: accepted 0..γ with "
                 f"frequencies near {_as_list(want.sum(1))}",
                 f"accepted 0..γ with frequencies {_as_list(counts.sum(1) / TRIALS)}", hint)
    passed(name, len(cases) * TRIALS)


# --- exercise 7 (design): γ for a batch -----------------------------------------------------------

def batch_speedup(alpha: float, c: float, batch: int, balance: float, gamma: int) -> float:
    """Tokens per unit of time over plain batched decoding (γ = 0: 1), when a target pass of n
    rows costs max(1, n / balance) decode steps and a draft pass c."""
    return 1.0 if gamma == 0 else speedup(alpha, 0.0, gamma) * max(1.0, batch / balance) / (
        gamma * c + max(1.0, batch * (gamma + 1) / balance))


MAX_GAMMA = 16


def _best(value, lo: int = 0) -> int:
    return _argmax([value(g) for g in range(lo, MAX_GAMMA + 1)], lo)


def reference_choose_gamma(alpha: float, c: float, batch: int, balance: float) -> int:
    return _best(lambda g: batch_speedup(alpha, c, batch, balance, g))  # the smaller γ on a tie


def _as_choice(got, *case):
    if as_int(got) is None or not 0 <= as_int(got) <= MAX_GAMMA:
        raise Refused(f"return γ as an int from 0 (no speculation) to {MAX_GAMMA}")
    return as_int(got)


DESIGN = Exercise(
    "choose_gamma",
    # (α, c, batch, balance): one request (the chapter's formula), batches below and past the
    # balance point, α = 1 (once with the best γ at the cap), a draft too dear, and an exact tie
    # between speculating and not
    cases=[(0.9, 0.05, 1, 64), (0.9, 0.05, 16, 64), (0.9, 0.05, 32, 64), (0.9, 0.05, 64, 64),
           (0.95, 0.02, 8, 64), (0.8, 0.1, 128, 64), (1.0, 0.1, 4, 16), (0.6, 0.3, 1, 64),
           (0.5, 0.5, 1, 64), (0.97, 0.01, 2, 16), (0.7, 0.02, 24, 32), (1.0, 0.6, 1, 64)],
    describe=lambda alpha, c, batch, balance: (f"alpha={alpha}, c={c}, batch={batch}, "
                                               f"balance={balance}"),
    reference=reference_choose_gamma, returns=_as_choice,
    explain=lambda *case: ", ".join(f"γ = {g}: {batch_speedup(*case, g):.3f}x"
                                    for g in (0, reference_choose_gamma(*case))),
    mistakes={
        "a tie: take the smaller γ (speculation that only breaks even is not worth it)":
            lambda *case: MAX_GAMMA - _argmax([batch_speedup(*case, g)
                                               for g in range(MAX_GAMMA, -1, -1)], 0),
        "this is the chapter's formula for ONE request: with a batch, the verification pass has "
        "batch × (γ + 1) rows, and past the balance point rows are not free any more":
            lambda alpha, c, batch, balance: reference_best_gamma(alpha, c, MAX_GAMMA),
        "speculation does not pay here at any γ: return 0 (plain batched decoding)":
            lambda *case: _best(lambda g: batch_speedup(*case, g), lo=1),
        "a round of γ proposals commits (1 - α^(γ+1)) / (1 - α) tokens on average: the exponent "
        "is γ + 1 (the bonus)": lambda alpha, c, batch, balance: _best(
            lambda g: 1.0 if g == 0 else (g + 1 if alpha == 1 else (1 - alpha ** g) / (1 - alpha))
            * max(1.0, batch / balance) / (g * c + max(1.0, batch * (g + 1) / balance))),
        "this ignores the draft's passes: γ of them a round, c each":
            lambda alpha, c, batch, balance: reference_choose_gamma(alpha, 0.0, batch, balance),
    },
    otherwise="price a round: γ draft passes at c, one verification pass of batch × (γ + 1) rows "
              "at max(1, rows / balance); it commits the chapter's expected tokens per request, "
              "against max(1, batch / balance) for one plain step")


def check_choose_gamma(choose_gamma) -> None:
    """DESIGN's check, with the best γ as the batch grows printed before its ✓ line."""
    with contextlib.redirect_stdout(io.StringIO()) as line:
        DESIGN.check(choose_gamma)
    print("  the best γ as the batch grows (α = 0.9, c = 0.05, balance = 64): " + ", ".join(
        f"{b} → {reference_choose_gamma(0.9, 0.05, b, 64)}" for b in (1, 4, 16, 32, 48, 64, 128)))
    print(line.getvalue(), end="")


EXERCISES = (BEST_GAMMA, RESIDUAL, ALPHA)
