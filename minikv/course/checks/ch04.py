"""Chapter 04's checkers (speculative decoding), against the engine on the CPU, leaving the caller's
random state alone: speculative_round, predict_perfect_draft and accept_sampled (code); residual,
alpha_from_trace, best_gamma and choose_gamma (tables). The hints are in hints/ch04.toml."""
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
from .. import checks as ck
from ..checkpoint import load_course_model

H = ck.hints("ch04")
ROUND, RES, ALPHA_H, BEST, PERFECT, SAMPLED, DESIGN_H = (H[k] for k in (
    "speculative_round", "residual", "alpha_from_trace", "best_gamma", "predict_perfect_draft",
    "accept_sampled", "choose_gamma"))


# --- exercise 1: one speculative round -----------------------------------------------------------
@functools.cache
def tiny_pair(seed: int) -> tuple[GPT, GPT]:
    """A random 2-layer target, its second block damped (α about 0.6-0.85), and the 1-layer draft
    of its first block."""
    target = ck.tiny_model(seed)
    with torch.no_grad():
        for block in target.transformer.h[1:]:
            block.attn.c_proj.weight.mul_(0.3)
            block.mlp.c_proj.weight.mul_(0.3)
    with torch.random.fork_rng(devices=[]):
        draft = GPT(GPTConfig.preset("tiny", n_layer=1)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # blocks 1.. have no place in it
    return target, draft


# (pair seed, prompt, γ): γ = 1..6, several prompts, each run to NEW_TOKENS+ new tokens
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


# hint -> what a round with that mistake may commit, from the proposals and the target's choices
COMMIT_MISTAKES = {
    ROUND["draft_token"]: lambda p, c: [p[:_matching(p, c) + 1]] if _matching(p, c) < len(p)
    else [],
    ROUND["no_bonus"]: lambda p, c: [list(p)] if _matching(p, c) == len(p) else [],
    ROUND["rows_off_by_one"]: lambda p, c: [p[:_matching(p, c, 1)] + c[_matching(p, c, 1) + 1:][:1]]
    + ([p[:_matching(p, c)] + c[_matching(p, c) + 1:][:1]] if _matching(p, c) < len(p) else []),
    ROUND["every_match"]: lambda p, c: [[x for x, y in zip(p, c) if x == y]
                                        + [c[sum(map(operator.eq, p, c))]]],
}


CROP_CRASH = ck.raised_as(ValueError, ROUND["crop_without_min"], "crop")


def _pass_hints(target_passes, draft_passes, gamma, first_draft_rows, seq_len):
    """(expected, got, hint) for the first wrong pass count or shape, or None."""
    want_t, want_d = [(1, gamma + 1)], [(1, first_draft_rows)] + [(1, 1)] * (gamma - 1)
    if target_passes != want_t:
        return f"target passes of shape {want_t}", f"{target_passes}", ROUND[
            "target_pass_each" if len(target_passes) > 1 else "target_proposals_only"
            if target_passes == [(1, gamma)] else "target_whole_sequence"
            if target_passes == [(1, seq_len + gamma)] else "target_pass" if target_passes
            else "no_target_pass"]
    if draft_passes != want_d:
        first = draft_passes[:1]
        return f"draft passes of shape {want_d}", f"{draft_passes}", ROUND["draft_passes"].format(
            gamma=gamma) if len(draft_passes) != gamma else ROUND[
            "draft_last_token" if first == [(1, 1)] and first_draft_rows > 1 else
            "draft_whole_sequence" if first == [(1, seq_len)] else "draft_pass"]
    return None


def _check_round(name, case, round_fn, target, draft, seq, t_cache, d_cache, gamma) -> None:
    """Run one round of the learner's, and check what it returned, did to seq, ran, kept."""
    before_seq, t_before, d_before = list(seq), ck.cache_state(t_cache), ck.cache_state(d_cache)
    proposals, d_fork = [], d_cache.fork()  # the chapter's round, on forks of the caches
    for _ in range(gamma):
        pending = (before_seq + proposals)[d_fork.get_seq_length():]
        proposals.append(int(draft(torch.tensor([pending]), cache=d_fork, last_only=True)[0, -1]
                             .argmax()))
    choices = target(torch.tensor([seq[-1:] + proposals]), cache=t_cache.fork())[0].argmax(-1)
    choices = choices.tolist()  # the target's choice at each of its γ + 1 rows
    n = _matching(proposals, choices)
    expected, case = proposals[:n] + [choices[n]], f"{case}, round at len(seq) = {len(seq)}"
    with ck.forbid(name, speculative_generate, verify_and_commit, accept_matching), \
            ck.PassCounter(target) as t_passes, ck.PassCounter(draft) as d_passes:
        got = ck.call_hinted(name, case, CROP_CRASH, round_fn, target, draft, seq, t_cache,
                             d_cache, gamma)
    tokens = ck.int_list(got)
    if tokens is None:
        ck.fail(name, case, expected, got, ROUND["returned_none"] if got is None else
                ROUND["not_a_list"].format(type=ck.type_name(got)))
    ck.expect(seq != before_seq, name, case, f"seq extended by {expected}", "seq unchanged",
              ROUND["in_place"])
    ck.expect(seq == before_seq + tokens, name, case, f"seq == seq before the round + the "
              f"returned tokens ({tokens})", f"seq grew by {seq[len(before_seq):]}",
              ROUND["appended"])
    wrong = _pass_hints(t_passes.passes, d_passes.passes, gamma, len(before_seq) - d_before[0],
                        len(before_seq))
    if wrong:
        ck.fail(name, case, *wrong)
    if tokens != expected:
        hints = [h for h, wrong in COMMIT_MISTAKES.items() if tokens in wrong(proposals, choices)]
        ck.fail(name, case, f"{expected} (the draft proposed {proposals}; the target's rows chose "
                f"{choices})", tokens, "; or ".join(hints) or ROUND["commit"])
    for label, cache, model, before, after_pass in (  # both caches: lengths, then every K/V
            ("target", t_cache, target, t_before, len(before_seq) + gamma),
            ("draft", d_cache, draft, d_before, len(before_seq) + gamma - 1)):
        want, got_len = min(after_pass, len(seq) - 1), cache.get_seq_length()
        ck.expect(got_len == want, name, case, f"{label} cache length {want}",
                  f"{label} cache length {got_len}", ROUND[
                      "reset" if got_len == 0 and want > 0 else "no_crop" if got_len == after_pass
                      > want else "grew" if got_len == len(seq) - 1 > want else "newest"
                      if got_len == len(seq) else "crop"].format(cache=label))
        fresh = KVCache.for_model(model, max_len=max(want, 1))  # the committed tokens' K/V
        if want:
            model(torch.tensor([seq[:want]]), cache=fresh)
        ck.expect(ck.same_cache_prefix(before, cache, min(before[0], want)) and all(
            torch.allclose(a[:, :, :want], b[:, :, :want], atol=1e-4, rtol=1e-4)
            for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values)), name, case,
            f"the {label} cache's K/V (every layer, keys and values) equal to a fresh "
            f"computation of the first {want} committed tokens", "different K/V",
            ROUND["overwritten"])


@ck.one_thread
@ck.guarded
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
            new, alone = seq[len(prompt):], generate(target, prompt, len(seq) - len(prompt)).tokens
            ck.expect(new == alone, name, case, f"target-only greedy decoding: {alone}", new,
                      ROUND["target_only"])
    ck.passed(name, len(ROUND_CASES))


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
    """p(x) - q(x) a(x), normalised: the only r with which q a + (1 - Σ q a) r = p."""
    return _normalised((p - q * a).clamp(min=0))


ACCEPTANCE_RULES = [  # (label, a(x) from p and q): the chapter's rule, then others
    ("section 5's rule a = min(1, p/q)", chapter_acceptance),
    ("a cautious rule that accepts half as often, a = min(1, p/q) / 2",
     lambda p, q: chapter_acceptance(p, q) / 2),
    ("a rule that never accepts, a = 0", lambda p, q: torch.zeros_like(p)),
    ("a stricter rule, a = min(1, p/q) squared", lambda p, q: chapter_acceptance(p, q) ** 2),
]


def _as_list(t) -> list:
    return [round(x, 4) for x in t.tolist()]


def _residual_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(p, q, a), a labelled with its rule, p != q; the last 8: one speculative step per rule."""
    pairs = [_distributions(s) for s in range(8)] + [
        (torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64),
         torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)),
        (torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1]))]
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
        raise ck.Refused(RES["not_a_tensor"].format(type=ck.type_name(got)))
    if got.shape != p.shape or not got.is_floating_point():
        raise ck.Refused(RES["shape"], f"a float tensor of shape {tuple(p.shape)}")
    return got


RESIDUAL = ck.Exercise(
    "residual", cases=_residual_cases(),
    describe=lambda p, q, a: f"{a.label}: p={_as_list(p)}, q={_as_list(q)}, a={_as_list(a)}",
    reference=reference_residual, returns=_as_distribution, show=_as_list,
    same=lambda got, want: torch.allclose(got.double(), want.double(), atol=1e-6),
    unchanged=RES["in_place"],
    mistakes=ck.named(
        RES, any_rule=lambda p, q, a: _normalised((p - q).clamp(min=0)),
        unnormalised=lambda p, q, a: (p - q * a).clamp(min=0),
        absolute=lambda p, q, a: _normalised((p - q).abs()), p_itself=lambda p, q, a: p,
        reversed=lambda p, q, a: _normalised((q - p).clamp(min=0)), q_itself=lambda p, q, a: q,
        p_refused=lambda p, q, a: _normalised(p * (1 - a)),
        q_refused=lambda p, q, a: _normalised(q * (1 - a))),
    otherwise=lambda runs: RES["step" if next(
        a for (p, q, a), got in runs if not RESIDUAL.same(got, reference_residual(p, q, a))
    ).label.startswith("one speculative step") else "otherwise"])
check_residual = RESIDUAL.check


# --- exercise 3: α from a trace ------------------------------------------------------------------
def _rounds(trace) -> list[tuple[int, bool, int]]:
    """(accepted, ended in a rejection?, proposals) of each verification round."""
    return [(len(e.accepted), bool(e.rejected), len(e.input_ids))
            for e in trace if e.kind == "verify"]


def reference_alpha(trace, index: int | None = None) -> float | None:
    """accepted / judged, pooled (index None) or of a round's index-th proposal; None if unjudged.
    A proposal is judged when every one before it in its round was accepted."""
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
    """A per-index mistake, named with its index."""
    (trace, index), got = next((case, got) for case, got in runs
                               if not _same(got, reference_alpha(*case)))
    rounds, i = _rounds(trace), index or 0
    ok = sum(a > i for a, _, _ in rounds)
    mistakes = [] if index is None else [
        (_ratio(ok, sum(n > i for _, _, n in rounds)), ALPHA_H["proposed"].format(i=i)),
        (_ratio(ok, len(rounds)), ALPHA_H["every_round"]),
        (reference_alpha(trace, None), ALPHA_H["pooled"]),
    ] + [(reference_alpha(trace, i + shift), ALPHA_H["index"].format(i=i + shift))
         for shift in (1, -1) if i + shift >= 0]
    hints = [h for wrong, h in mistakes if wrong is not None and _same(got, wrong)]
    return "; or ".join(dict.fromkeys(hints)) or ALPHA_H["otherwise"]


class _Lazy(UserList):
    """Cases made on first use: those that run the models wait for the check."""

    def __init__(self, make):  # not UserList's: `data` is made when first read
        self.make = make

    data = functools.cached_property(lambda self: self.make())


def _alpha_runs():
    """(label, the run)."""
    (target, draft), prompt = tiny_pair(1), [3, 17, 200, 41, 9]
    (course_target, tok), (course_draft, _) = (load_course_model(m, "cpu")
                                               for m in ("target", "draft"))
    # a coin flip: the distilled draft agrees on the whole of a short story (α = 1 there), while
    # here it misses now and then, so a wrong estimator shows
    ids = tok.encode("A coin's state is heads. Alice flips")
    runs = [(f"tiny pair {seed}, greedy, γ = {gamma}", *tiny_pair(seed), prompt, 40,
             dict(gamma=gamma)) for seed, gamma in ((0, 2), (1, 4), (2, 6))] + [
        ("tiny pair 1, temperature 1, γ = 4", target, draft, [100, 7], 40,
         dict(gamma=4, temperature=1.0, seed=3)),
        ("tiny pair 2, adaptive γ from 2", *tiny_pair(2), [5], 40,
         dict(gamma=2, adaptive_gamma=True, max_gamma=8)),
        ("a draft that is the target itself (never wrong), γ = 3", target, target, prompt, 20,
         dict(gamma=3)),
        ("an unrelated random draft, γ = 3", target, ck.tiny_model(7), prompt, 20, dict(gamma=3)),
        ("1 new token: the prefill alone, no round", target, draft, prompt, 1, dict(gamma=3)),
        ("the course pair, greedy, γ = 5", course_target, course_draft, ids, 60, dict(gamma=5)),
        ("the course pair, temperature 0.8, γ = 3", course_target, course_draft, ids, 60,
         dict(gamma=3, temperature=0.8, seed=1))]
    for label, t, d, p, n, options in runs:
        yield label, speculative_generate(t, d, p, n, trace=True, **options)


def _alpha_cases() -> list[tuple]:
    """(trace, None) for every run, then (trace, index) up to past its longest round."""
    with torch.inference_mode():
        traces = [ck.Labelled(label, out.trace) for label, out in _alpha_runs()]
    return [(t, None) for t in traces] + [
        (t, i) for t in traces for i in range(max((n for _, _, n in _rounds(t)), default=0) + 2)]


def _same(got, want) -> bool:
    return got is want if got is None or want is None else math.isclose(got, want, rel_tol=1e-9,
                                                                         abs_tol=1e-12)


def _as_alpha(got, trace, index):
    if reference_alpha(trace, index) is None:
        if got is not None:
            raise ck.Refused(ALPHA_H["unjudged"])
        return None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ck.Refused(ALPHA_H["none"] if got is None else
                         ALPHA_H["not_a_float"].format(type=ck.type_name(got)))
    return got


ALPHA = ck.Exercise(
    "alpha_from_trace", cases=_Lazy(_alpha_cases),
    describe=lambda trace, index: trace.label + ("" if index is None else f", index={index}"),
    reference=reference_alpha, returns=_as_alpha, same=_same,
    raised=ck.raised_as(ZeroDivisionError, ALPHA_H["divided_by_zero"]),
    mistakes=ck.named(
        ALPHA_H, per_proposal=_pooled(lambda r, ok: _ratio(ok, sum(n for _, _, n in r))),
        every_round_rejects=_pooled(lambda r, ok: _ratio(ok, ok + len(r))),
        round_average=_pooled(lambda r, ok: _ratio(sum(a / n for a, _, n in r if n),
                                                   sum(n > 0 for _, _, n in r))),
        own_token=_pooled(lambda r, ok: _ratio(ok + len(r), ok + len(r) + sum(j for _, j, _ in r))),
        clean_rounds=_pooled(lambda r, ok: _ratio(len(r) - sum(j for _, j, _ in r), len(r)))),
    otherwise=_alpha_otherwise)
check_alpha_from_trace = ALPHA.check


# --- exercise 4: choose γ ------------------------------------------------------------------------
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
    if ck.as_int(got) is None:
        raise ck.Refused(BEST["not_an_int"].format(type=ck.type_name(got)))
    return ck.as_int(got)


BEST_GAMMA = ck.Exercise(
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
    raised=ck.raised_as(ZeroDivisionError, BEST["divided_by_zero"]),
    mistakes=ck.named(
        BEST, alpha_1=lambda a, c, m: 1 if a == 1 else reference_best_gamma(a, c, m),
        from_0=lambda a, c, m: reference_best_gamma(a, c, m) - 1,
        tie=lambda a, c, m: m + 1 - _argmax([speedup(a, c, g) for g in range(m, 0, -1)]),
        no_draft_cost=lambda a, c, m: reference_best_gamma(a, 0.0, m),
        exponent=lambda a, c, m: _argmax([(g if a == 1 else (1 - a ** g) / (1 - a)) / (g * c + 1)
                                          for g in range(1, m + 1)]),
        one_more=lambda a, c, m: reference_best_gamma(a, c, m) + 1),
    otherwise=lambda runs: BEST["alpha_1"] if next(
        case for case, got in runs if got != reference_best_gamma(*case))[0] == 1 else
    BEST["otherwise"])
check_best_gamma = BEST_GAMMA.check

# --- exercise 5 (predict, then measure): a draft that is never wrong -----------------------------
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


def _prediction_mistakes(P: int, N: int, gamma: int, R: int, proposed: int,
                         draft_passes: int) -> dict[str, list[tuple[int, str]]]:
    """Per quantity, (a usual wrong prediction, its hint), from the prompt's length P, the new
    tokens N, γ, the rounds R, the proposals and the draft's passes."""
    return {quantity: [(value, PERFECT[key]) for value, key in wrong] for quantity, wrong in {
        "target_passes": [(R, "rounds_only"), (1 + math.ceil((N - 1) / gamma), "gamma_per_round"),
                          (math.ceil(N / gamma), "gamma_no_prefill"), (N, "target_only")],
        "draft_passes": [(R * gamma, "full_last_round"), (N - 1, "draft_per_token"),
                         (N, "draft_every_token"), ((R + 1) * gamma, "draft_prefill")],
        "target_kv": [(P + N, "last_fed"), (P + R * (gamma + 1), "full_last_rows"),
                      (N - 1, "no_prompt"), (P + proposed, "gamma_rows"),
                      ((R + 1) * (gamma + 1), "prefill_rows")],
        "draft_kv": [(draft_passes, "row_per_pass"), (draft_passes - 1 + P + 1, "caught_up_once"),
                     (P + N - 1, "one_behind"), (P + N, "level")]}.items()}


@ck.one_thread
@ck.guarded
def check_predict_perfect_draft(predict_perfect_draft) -> None:
    """predict_perfect_draft() -> {"target_passes", "draft_passes", "target_kv", "draft_kv"}: the
    counts of speculative_generate(target, target, "Once upon a time", 30, gamma=4)."""
    name = "predict_perfect_draft"
    case = (f"speculative_generate(target, target, tok.encode({PERFECT_PROMPT!r}), "
            f"{PERFECT_NEW}, gamma={PERFECT_GAMMA}): the target as its own draft, greedy")
    got = ck.prediction(name, case, predict_perfect_draft, speculative_generate, generate,
                        verify_and_commit, GPT.forward)
    got = ck.predicted(name, case, got, list(PREDICTED), PERFECT["not_a_dict"],
                       PERFECT["fraction"])
    P, out, measured = perfect_draft_run()
    assert out.stats.rejected == 0, ("this machine's target disagreed with itself at a near-tie "
                                     "(chapter 05): the run this prediction is about needs α = 1")
    mistakes = _prediction_mistakes(P, PERFECT_NEW, PERFECT_GAMMA, out.stats.rounds,
                                    out.stats.proposed, measured["draft_passes"])
    ck.as_measured(name, case, got, measured, mistakes.get, PERFECT["wrong"], PERFECT["otherwise"],
                   PREDICTED.get)
    print(f"  measured: {measured['target_passes']} target and {measured['draft_passes']} draft "
          f"passes, {measured['target_kv']} and {measured['draft_kv']} K/V vectors per layer "
          f"for {PERFECT_NEW} new tokens after a {P}-token prompt")
    ck.passed(name, len(PREDICTED))


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


_norm_max = functools.partial(reference_residual, a=1)  # section 5's residual, norm(max(0, p - q))
RIGHT_RULE = (_chapter_accept, _norm_max, lambda p, q, g: p[g])  # (accept, residual, bonus)
SAMPLED_MISTAKES = [  # (the rule a usual mistake runs, its hint)
    ((_chapter_accept, _norm_max, lambda p, q, g: p[g - 1] if g else p[0]),
     SAMPLED["last_proposal_row"]),
    ((_chapter_accept, _norm_max, lambda p, q, g: q[g - 1] if g else p[0]), SAMPLED["draft_bonus"]),
    ((_chapter_accept, lambda p_row, q_row: p_row, lambda p, q, g: p[g]), SAMPLED["resample_p"]),
    ((lambda p, q: min(1.0, q / p) if p > 0 else 1.0, _norm_max, lambda p, q, g: p[g]),
     SAMPLED["q_over_p"]),
    ((lambda p, q: 1.0, _norm_max, lambda p, q, g: p[g]), SAMPLED["accept_all"]),
    ((_chapter_accept, lambda p_row, q_row: _normalised((p_row - q_row).abs()),
      lambda p, q, g: p[g]), SAMPLED["absolute"]),
]


def outcome_distribution(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                         rule: tuple) -> torch.Tensor:
    """Exact probability (γ + 1, vocab) of every outcome (k accepted, then token y) by `rule`."""
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


@ck.guarded
def check_accept_sampled(accept_sampled) -> None:
    """accept_sampled(p, q, proposals, generator) -> (accepted, token): one round of speculative
    sampling, whose outcomes over seeded trials follow the closed form of section 5's rule."""
    name, cases = "accept_sampled", _sampled_cases()
    crashed = ck.raised_as((NameError, UnboundLocalError), SAMPLED["no_proposal"])
    for label, p, q, proposals in cases:
        case = f"{label}: p rows {[_as_list(r) for r in p]}, q rows " \
               f"{[_as_list(r) for r in q]}, proposals {proposals}, {TRIALS} seeded trials"
        results, seeds = [], [1_000 * t + len(proposals) for t in range(TRIALS)]  # a generator
        for s in seeds:  # per trial
            got = ck.call_kept(name, case, SAMPLED["in_place"], accept_sampled, p, q,
                               list(proposals), torch.Generator().manual_seed(s), raised=crashed)
            pair = ck.int_list(got) if isinstance(got, (tuple, list)) else None
            ck.expect(pair is not None and len(pair) == 2, name, case, "(accepted, token): two "
                      "ints", got, SAMPLED["not_a_pair"])
            ck.expect(0 <= pair[0] <= len(proposals) and 0 <= pair[1] < p.size(1), name, case,
                      f"accepted in 0..{len(proposals)}, a token in 0..{p.size(1) - 1}",
                      tuple(pair), SAMPLED["out_of_range"])
            results.append(tuple(pair))
        buggy = None  # the buggy round's outcomes, where it runs (it crashes with no proposal)
        with contextlib.suppress(NameError, UnboundLocalError):
            buggy = [accept_sampled_buggy(p, q, list(proposals), torch.Generator().manual_seed(s))
                     for s in seeds]
        counts = torch.zeros(len(proposals) + 1, p.size(1))
        for k, y in results:
            counts[k, y] += 1
        want = outcome_distribution(p, q, proposals, RIGHT_RULE)
        if ck.chi_square_p(counts, want) < 1e-6:
            fits = [h for rule, h in SAMPLED_MISTAKES if not torch.allclose(
                wrong := outcome_distribution(p, q, proposals, rule), want, atol=1e-9)
                and ck.chi_square_p(counts, wrong) > 1e-4]
            ck.fail(name, case, "outcomes distributed as the rule says: accepted 0..γ with "
                    f"frequencies near {_as_list(want.sum(1))}",
                    f"accepted 0..γ with frequencies {_as_list(counts.sum(1) / TRIALS)}",
                    SAMPLED["buggy"] + SAMPLED_MISTAKES[0][1] if results == buggy else
                    "; or ".join(fits) or SAMPLED["otherwise"])
    ck.passed(name, len(cases) * TRIALS)


# --- exercise 7 (design): γ for a batch ----------------------------------------------------------
MAX_GAMMA = 16


def batch_speedup(alpha: float, c: float, batch: int, balance: float, gamma: int) -> float:
    """Tokens per unit of time over plain batched decoding (γ = 0: 1), when a target pass of n
    rows costs max(1, n / balance) decode steps and a draft pass c."""
    return 1.0 if gamma == 0 else speedup(alpha, 0.0, gamma) * max(1.0, batch / balance) / (
        gamma * c + max(1.0, batch * (gamma + 1) / balance))


def _best(value, lo: int = 0) -> int:
    return _argmax([value(g) for g in range(lo, MAX_GAMMA + 1)], lo)


def reference_choose_gamma(alpha: float, c: float, batch: int, balance: float) -> int:
    return _best(lambda g: batch_speedup(alpha, c, batch, balance, g))  # the smaller γ on a tie


def _as_choice(got, *case):
    if ck.as_int(got) is None or not 0 <= ck.as_int(got) <= MAX_GAMMA:
        raise ck.Refused(DESIGN_H["not_an_int"].format(max=MAX_GAMMA))
    return ck.as_int(got)


DESIGN = ck.Exercise(
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
    mistakes=ck.named(
        DESIGN_H, tie=lambda *case: MAX_GAMMA - _argmax(
            [batch_speedup(*case, g) for g in range(MAX_GAMMA, -1, -1)], 0),
        one_request=lambda a, c, batch, balance: reference_best_gamma(a, c, MAX_GAMMA),
        never_pays=lambda *case: _best(lambda g: batch_speedup(*case, g), lo=1),
        exponent=lambda a, c, batch, balance: _best(
            lambda g: 1.0 if g == 0 else (g + 1 if a == 1 else (1 - a ** g) / (1 - a))
            * max(1.0, batch / balance) / (g * c + max(1.0, batch * (g + 1) / balance))),
        no_draft_cost=lambda a, c, batch, balance: reference_choose_gamma(a, 0.0, batch, balance)),
    otherwise=DESIGN_H["otherwise"])


def check_choose_gamma(choose_gamma) -> None:
    """DESIGN's check, with the best γ as the batch grows printed before its ✓ line."""
    with contextlib.redirect_stdout(io.StringIO()) as line:
        DESIGN.check(choose_gamma)
    print("  the best γ as the batch grows (α = 0.9, c = 0.05, balance = 64): " + ", ".join(
        f"{b} → {reference_choose_gamma(0.9, 0.05, b, 64)}" for b in (1, 4, 16, 32, 48, 64, 128)))
    print(line.getvalue(), end="")


EXERCISES = (BEST_GAMMA, RESIDUAL, ALPHA)
