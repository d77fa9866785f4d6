"""Checkers for chapter 10 (speculation beyond a draft model), each against the engine (the recipe
in __init__.py), all tables: tree_mask_and_positions (what one target pass needs to read a token
tree: each node's mask row and position, against engine/tree.py), accepted_path (the walk down a
tree that the target's own choices take, against verify.accept_matching), predicted_speedup
(predict, then measure: what speculation earns a server at a batch size, from the cost of its
passes), keep_accepted (debug: keep the accepted path's K/V, against KVCache.compact) and
choose_tree (design: spend a budget of verify rows on a tree, measured by the engine). The hints
are in hints/ch10.toml."""
from __future__ import annotations

import functools
import math

import torch

from ...engine.cache import KVCache
from ...engine.eagle import feature_generate, tree_size
from ...engine.sampling import SamplingParams
from ...engine.tree import children, depths, tree_mask, tree_positions
from ...engine.verify import accept_matching
from ..checkpoint import load_course_model, load_feature_head
from ..tokenizer import load_tokenizer
from . import Exercise, Refused, as_int, hints, int_list, named, parts

H = hints("ch10")
TREE_HELPERS = (tree_mask, tree_positions, depths, children)


def _children(parents: list[int], at: int) -> list[int]:  # the engine's `children` is forbidden
    return [c for c, p in enumerate(parents) if p == at]


# --- exercise 1: the mask and positions of a token tree ---------------------------------------

def mask_and_positions_by_hand(parents: list[int], root_position: int):
    """The solution: each node's row is its parent's row plus itself; its position is its
    parent's plus one (the root's children: the root's plus one)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    positions = []
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
        positions.append((positions[parent] if parent >= 0 else root_position) + 1)
    return mask, positions


def _with(parents, root_position, mask=None, positions=None):
    """The solution's mask and positions, one of them replaced (a usual mistake)."""
    right_mask, right_positions = mask_and_positions_by_hand(parents, root_position)
    return (right_mask if mask is None else mask(right_mask),
            right_positions if positions is None else positions)


def _parent_only(parents, root_position):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i, parent] = True
    return _with(parents, root_position, mask=lambda right: mask)


def _bool_mask(mask, parents, root_position):  # a part of the answer: the (n, n) bool mask
    n = len(parents)
    ok = isinstance(mask, torch.Tensor) and tuple(mask.shape) == (n, n) and mask.dtype == torch.bool
    return mask if ok else None


def _n_ints(positions, parents, root_position):  # a part of the answer: n positions
    positions = int_list(positions)
    return positions if positions is not None and len(positions) == len(parents) else None


M = H["tree_mask_and_positions"]
MASK = Exercise(
    "tree_mask_and_positions",
    # (parents, root_position): the chapter's tree, a chain, a bush, deeper and wider ones
    cases=[([-1, -1, 0, 0], 9), ([-1, 0, 1, 2], 4), ([-1, -1, -1], 0), ([-1, 0, 0, 1, 1, 2], 17),
           ([-1, -1, 0, 1, 2, 3, 4, 5], 30), ([-1, 0, -1, 2, 1, 3, 3], 5), ([-1], 2),
           ([-1, -1, 1, 1, 2, 2, 3, 6], 11)],
    describe=lambda parents, root_position: (f"parents={parents}, the root at position "
                                             f"{root_position}"),
    reference=lambda parents, root: (tree_mask(parents, prefix=0), tree_positions(parents, root)),
    returns=parts(lambda parents, root: M["returns"].format(n=len(parents)), _bool_mask, _n_ints),
    same=lambda got, want: torch.equal(got[0], want[0]) and list(got[1]) == list(want[1]),
    show=lambda r: (r[0].int().tolist(), list(r[1])),
    mistakes=named(
        M, causal=lambda ps, root: _with(ps, root, mask=lambda right: right.new_ones(
            right.shape).tril()),
        parent_only=_parent_only,
        no_self=lambda ps, root: _with(ps, root, mask=lambda right: right & ~torch.eye(
            len(ps), dtype=torch.bool)),
        chain_positions=lambda ps, root: _with(ps, root, positions=[root + 1 + i for i in range(
            len(ps))]),
        depth_from_zero=lambda ps, root: mask_and_positions_by_hand(ps, root - 1)),
    otherwise=M["otherwise"], forbid=TREE_HELPERS, unchanged=M["unchanged"],
    solution=mask_and_positions_by_hand)
check_tree_mask_and_positions = MASK.check


# --- exercise 2: the accepted path ----------------------------------------------------------

def path_by_hand(parents: list[int], tokens: list[int], choices: list[int], pick: int = 0,
                 row: int = 1, under=None):
    """The solution: from the root, go down to the child holding the target's choice there,
    while there is one; the target's choice where the walk stops is its own token. (The knobs
    give the usual mistakes: `pick` which of several matching siblings, the engine taking the
    first; the choice after node i read at row i + `row`; `under(at, path)` the nodes the walk
    may go to, instead of the children of `at`.)"""
    path, at = [], -1
    while True:
        choice = choices[max(at + row, 0)]
        near = under(at, path) if under else _children(parents, at)
        match = [c for c in near if tokens[c] == choice]
        if not match:
            return path, choice
        path.append(match[pick])
        at = match[pick]


def _path_reference(parents, tokens, choices):
    """accept_matching on logits whose argmax at each row is the given choice."""
    logits = torch.full((len(choices), max(max(tokens), max(choices)) + 1), -1.0)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    verdict = accept_matching(logits, tokens, SamplingParams(), 0, parents)
    return list(verdict.path), verdict.token


def _by_depth(parents, tokens, choices):
    level = mask_and_positions_by_hand(parents, 0)[1]  # each node's depth, the root's children 1
    return path_by_hand(parents, tokens, choices, under=lambda at, path: [
        c for c, depth in enumerate(level) if depth == len(path) + 1])


def _proposal_token(parents, tokens, choices):
    path, token = path_by_hand(parents, tokens, choices)
    kids = _children(parents, path[-1] if path else -1)
    return path, tokens[kids[0]] if kids else token


def _path_case(parents, tokens, walk, seed):
    """choices that follow `walk` (node numbers) and then pick a token no child has."""
    g = torch.Generator().manual_seed(seed)
    choices = [int(t) for t in torch.randint(0, 50, (len(parents) + 1,), generator=g)]
    at = -1
    for node in walk:
        choices[at + 1] = tokens[node]
        at = node
    kids = [tokens[c] for c in _children(parents, at)]
    choices[at + 1] = next(t for t in range(60, 120) if t not in kids)
    return parents, tokens, choices


P = H["accepted_path"]
PATH = Exercise(
    "accepted_path",
    cases=[
        _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [0, 3], 1),         # down the first branch
        _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [1], 2),            # the root's second child
        _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [], 3),             # nothing accepted
        _path_case([-1, 0, 1, 2], [4, 4, 4, 4], [0, 1, 2], 4),        # a chain
        _path_case([-1, -1, 0, 1, 2, 3], [8, 9, 20, 21, 30, 31], [1, 3, 5], 5),  # to a leaf
        _path_case([-1, -1, 0, 1, 1], [8, 9, 20, 20, 22], [1, 3], 6),  # a cousin shares a token
        _path_case([-1, -1, -1, 2, 2, 4], [3, 6, 12, 1, 2, 7], [2, 4, 5], 7),
        _path_case([-1, -1, 0, 0, 3], [10, 11, 12, 13, 14], [0, 3], 8),
        # two siblings hold the same token (children drawn independently): the first one is taken
        _path_case([-1, -1, 0, 1], [5, 5, 9, 11], [0, 2], 9),
        _path_case([-1, 0, 0, 1, 2, 2], [7, 3, 3, 8, 6, 6], [0, 1, 3], 10)],
    describe=lambda parents, tokens, choices: (
        f"parents={parents}, tokens={tokens}; the target's choice at the root {choices[0]}, "
        f"after node i: {choices[1:]}"),
    reference=_path_reference,
    returns=parts(P["returns"], lambda path, *case: int_list(path),
                  lambda token, *case: as_int(token)),
    show=lambda r: (list(r[0]), r[1]),
    mistakes=named(
        P, first_child_only=lambda ps, ts, cs: path_by_hand(
            ps, ts, cs, under=lambda at, path: _children(ps, at)[:1]),
        by_depth=_by_depth,
        wrong_row=lambda ps, ts, cs: path_by_hand(ps, ts, cs, row=0),
        proposal_token=_proposal_token,
        last_match=lambda ps, ts, cs: path_by_hand(ps, ts, cs, pick=-1)),
    otherwise=P["otherwise"], forbid=(accept_matching, *TREE_HELPERS), unchanged=P["unchanged"],
    solution=path_by_hand)
check_accepted_path = PATH.check


# --- exercise 3: predict what speculation earns a server --------------------------------------

class Cost:
    """A pass's seconds as a function of the token rows it computes: `fixed` (reading the
    weights, launching the work) plus `per_row` once more rows than `spare` would be computed
    (a machine with spare compute does the first `spare` rows for free)."""

    def __init__(self, fixed: float, per_row: float, spare: int = 0):
        self.fixed, self.per_row, self.spare = fixed, per_row, spare

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * max(0, rows - self.spare)

    def __repr__(self) -> str:
        return f"Cost(fixed={self.fixed}, per_row={self.per_row}, spare={self.spare})"


def speedup_by_hand(tau: float, gamma: int, batch: int, decode_seconds, verify_seconds,
                    draft_seconds: float, fed: int = 1) -> float:
    """The solution: plain decoding commits `batch` tokens per decode pass of `batch` rows;
    speculation commits batch × tau per step: its drafting, then ONE verify pass of
    batch × (1 + gamma) rows. (`fed`: the tokens a row's verify pass feeds besides its
    proposals; 0 is a usual mistake.)"""
    plain = batch / decode_seconds(batch)
    speculative = batch * tau / (draft_seconds + verify_seconds(batch * (fed + gamma)))
    return speculative / plain


def _as_float(got, *case):
    if isinstance(got, bool) or not isinstance(got, (int, float, torch.Tensor)) or (
            isinstance(got, torch.Tensor) and got.numel() != 1):
        raise Refused(H["predicted_speedup"]["returns"])
    return float(got)


S = H["predicted_speedup"]
SPEEDUP = Exercise(
    "predicted_speedup",
    cases=[(3.2, 3, 1, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0002, 16), 0.002),
           (3.2, 3, 8, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0002, 16), 0.004),
           (3.2, 3, 32, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0003, 16), 0.010),
           (2.5, 4, 4, Cost(0.005, 0.0010), Cost(0.004, 0.0010), 0.0),
           (1.4, 2, 16, Cost(0.020, 0.0005, 64), Cost(0.020, 0.0005, 64), 0.001),
           (4.0, 5, 2, Cost(0.001, 0.0001, 4), Cost(0.002, 0.0001, 4), 0.0003),
           (3.0, 3, 64, Cost(0.004, 0.0003, 8), Cost(0.003, 0.0004, 8), 0.020)],
    describe=lambda tau, gamma, batch, decode, verify, draft: (
        f"tau={tau} tokens a row commits per step, gamma={gamma}, batch={batch}, "
        f"decode_seconds={decode!r}, verify_seconds={verify!r}, draft_seconds={draft}"),
    reference=speedup_by_hand,
    returns=_as_float,
    same=lambda got, want: math.isclose(got, want, rel_tol=1e-6),
    show=lambda x: round(x, 4),
    mistakes=named(
        S, rows_gamma=lambda *case: speedup_by_hand(*case, fed=0),
        no_tau=lambda tau, *rest: speedup_by_hand(1.0, *rest),
        tau_minus_one=lambda tau, *rest: speedup_by_hand(tau - 1, *rest),
        no_draft=lambda *case: speedup_by_hand(*case[:5], 0.0),
        inverted=lambda *case: 1 / speedup_by_hand(*case),
        decode_for_verify=lambda tau, gamma, batch, decode, verify, draft: speedup_by_hand(
            tau, gamma, batch, decode, decode, draft)),
    otherwise=S["otherwise"], solution=speedup_by_hand)
check_predicted_speedup = SPEEDUP.check


# --- exercise 4 (debug): keep the accepted path's K/V -------------------------------------

def keep_as_reported(kv: torch.Tensor, n_committed: int, path: list[int]) -> torch.Tensor:
    """The bug report's function: it keeps the slots right after the committed ones, one per
    accepted node, as chapter 04's crop does for a chain."""
    keep = list(range(n_committed)) + [n_committed + depth for depth in range(len(path))]
    return kv[:, :, keep]


def keep_by_hand(kv: torch.Tensor, n_committed: int, path: list[int], first: int = 0,
                 order: int = 1) -> torch.Tensor:
    """The solution: the committed slots, then each accepted node's own slot (node i was
    written at n_committed + i), in the path's order. (`first` and `order` give the usual
    mistakes: node i's slot off by one, the path reversed.)"""
    keep = list(range(n_committed)) + [n_committed + first + node for node in path[::order]]
    return kv[:, :, keep]


def _keep_reference(kv, n_committed, path):
    """The engine's KVCache.compact on a cache holding kv as its keys (and its values)."""
    b, h, t, d = kv.shape
    cache = KVCache(1, b, h, d, t, dtype=kv.dtype)
    cache.update(kv, kv, 0)
    cache.compact([n_committed + node for node in path], n_committed)
    return cache.keys[0][:, :, :cache.get_seq_length()].clone()


def _keep_case(n_committed, parents, path):
    """kv (B=1, heads=2, T, head_dim=4): slot t holds t + head / 4 + dim / 16, so that a
    returned tensor says which slots it kept (exact in floating point)."""
    t = n_committed + len(parents)
    kv = (torch.arange(t, dtype=torch.float32)[None, None, :, None]
          + torch.arange(2.0)[None, :, None, None] / 4 + torch.arange(4.0) / 16)
    return kv, n_committed, path


def _keep_answer(got, kv, n_committed, path):
    b, h, _, d = kv.shape
    shape = (b, h, n_committed + len(path), d)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape:
        raise Refused(K["returns"].format(shape=shape, n_committed=n_committed,
                                          accepted=len(path)))
    return got


K = H["keep_accepted"]
KEEP = Exercise(
    "keep_accepted",
    cases=[
        _keep_case(5, [-1, -1, 0, 0], [1]),                      # the second child of the root
        _keep_case(9, [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4], [1, 4, 8]),  # the chapter's round
        _keep_case(3, [-1, -1, 0, 1, 2, 3], [0, 2, 4]),          # first children, a 2-wide tree
        _keep_case(6, [-1, 0, 1, 2], [0, 1, 2, 3]),              # a chain, all accepted
        _keep_case(4, [-1, -1, -1, 2, 2, 4], [2, 4, 5]),
        _keep_case(7, [-1, -1, 0, 0], [])],                      # nothing accepted
    describe=lambda kv, n, path: (
        f"{n} committed positions (slots 0 to {n - 1}), then a tree of {kv.shape[2] - n} "
        f"nodes written after them (node i at slot {n} + i); accepted path {path}"),
    reference=_keep_reference,
    returns=_keep_answer,
    same=torch.equal,
    show=lambda kept: f"the slots {[int(x) for x in kept[0, 0, :, 0].floor()]}",
    mistakes=named(K, as_reported=keep_as_reported,
                   off_by_one=lambda kv, n, path: keep_by_hand(kv, n, path, first=-1),
                   reversed=lambda kv, n, path: keep_by_hand(kv, n, path, order=-1)),
    otherwise=K["otherwise"], forbid=(KVCache.compact,), unchanged=K["unchanged"],
    solution=keep_by_hand)
check_keep_accepted = KEEP.check


# --- exercise 5 (design): spend a budget of verify rows on a tree -------------------------

# The prompts and length the engine measures a tree shape on (the chapter's prompts)
DESIGN_PROMPTS = ("Once upon a time", "The color of dog", "A coin's state is heads. Alice flips",
                  "A coin's state is tails. Bob doesn't flip it. Carol flips")
DESIGN_TOKENS = 48
DESIGN_BUDGETS = (6, 12)
T = H["choose_tree"]


@functools.cache
def _models() -> tuple:  # the course target, its feature head and the tokenizer, loaded once
    target = load_course_model("target", "cpu")[0]
    return target, load_feature_head(target), load_tokenizer()


@functools.cache
def tokens_per_pass(gamma: int, width: int, branch: int) -> float:
    """Tokens the course target commits per target pass, greedy, with the feature head
    proposing a tree γ deep (`tree=(width, branch)`; (1, 1): a chain), over the chapter's 4
    prompts and 48 new tokens each: the engine's measurement (cached)."""
    target, head, tok = _models()
    tree = None if (width, branch) == (1, 1) else (width, branch)
    with torch.inference_mode():
        outs = [feature_generate(target, head, tok.encode(p), DESIGN_TOKENS, gamma=gamma,
                                 tree=tree) for p in DESIGN_PROMPTS]
    return sum(o.stats.new_tokens for o in outs) / sum(o.stats.target_passes for o in outs)


def rows_of(gamma: int, width: int, branch: int) -> int:
    """The most proposals a tree γ deep holds: `branch` at depth 1, then `width` growing
    nodes of `branch` children at each further depth (engine/eagle.py's tree_size)."""
    return tree_size(gamma, width, branch)


def _design_answer(got, budget):
    values = int_list(got) if isinstance(got, (tuple, list)) else None
    if values is None or len(values) != 3 or min(values) < 1:
        raise Refused(T["returns"])
    rows = rows_of(*values)
    if rows > budget:
        raise Refused(T["over_budget"].format(shape=tuple(values), rows=rows, budget=budget),
                      expected=f"at most {budget} rows")
    return tuple(values)


def _design_best(budget):
    return (budget, 1, 1)  # the deepest chain; tests/test_checks_ch10.py proves it is the best


def _design_same(got, want) -> bool:
    return tokens_per_pass(*got) >= 0.97 * tokens_per_pass(*want)


def _design_otherwise(runs) -> str:
    """Each wrong choice named by its kind, with the engine's numbers for it and the best."""
    lines = []
    for (budget,), got in runs:
        best = _design_best(budget)
        if _design_same(got, best):
            continue
        gamma, width, branch = got
        kind = ("chain" if (width, branch) == (1, 1) else "bush" if gamma == 1 else "tree")
        lines.append(T["verdict"].format(
            budget=budget, shape=tuple(got), mine=tokens_per_pass(*got), best_shape=best,
            best=tokens_per_pass(*best), kind=T[kind].format(
                gamma=gamma, spare=budget - gamma, width=width, branch=branch)))
    return "; ".join(lines) + ". " + T["why"]


DESIGN = Exercise(
    "choose_tree",
    cases=[(b,) for b in DESIGN_BUDGETS],
    describe=lambda budget: (f"a budget of {budget} proposed rows per round, per request "
                             f"(the feature head proposing, greedy)"),
    reference=_design_best,
    returns=_design_answer,
    same=_design_same,
    show=lambda t: f"{tuple(t)}: {tokens_per_pass(*t):.2f} tokens per target pass",
    otherwise=_design_otherwise,
)
check_choose_tree = DESIGN.check

EXERCISES = (MASK, PATH, SPEEDUP, KEEP, DESIGN)
