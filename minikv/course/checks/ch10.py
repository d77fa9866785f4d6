"""Checkers for chapter 10 (speculation beyond a draft model), each against the engine (the recipe
in __init__.py): tree_mask_and_positions (what one target pass needs to read a token tree: each
node's mask row and position, against engine/tree.py), accepted_path (the walk down a tree that
the target's own choices take, against verify.accept_matching) and predicted_speedup (predict,
then measure: what speculation earns a server at a batch size, from the cost of its passes).
"""
from __future__ import annotations

import math

import torch

from ...engine.cache import KVCache
from ...engine.sampling import SamplingParams
from ...engine.tree import children, depths, tree_mask, tree_positions
from ...engine.verify import accept_matching
from . import Exercise, Refused, int_list

TREE_HELPERS = (tree_mask, tree_positions, depths, children)

# (parents, root_position): the chapter's tree, a chain, a bush, deeper and wider ones
TREES = [([-1, -1, 0, 0], 9), ([-1, 0, 1, 2], 4), ([-1, -1, -1], 0), ([-1, 0, 0, 1, 1, 2], 17),
         ([-1, -1, 0, 1, 2, 3, 4, 5], 30), ([-1, 0, -1, 2, 1, 3, 3], 5), ([-1], 2),
         ([-1, -1, 1, 1, 2, 2, 3, 6], 11)]


def _describe_tree(parents, root_position) -> str:
    return f"parents={parents}, the root at position {root_position}"


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


def _mask_reference(parents, root_position):
    return tree_mask(parents, prefix=0), tree_positions(parents, root_position)


def _mask_answer(got, parents, root_position):
    n = len(parents)
    hint = (f"return (mask, positions): mask a ({n}, {n}) bool tensor, mask[i, j] True when "
            f"node i sees node j; positions a list of {n} ints")
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Refused(hint)
    mask, positions = got
    positions = int_list(positions)
    if not (isinstance(mask, torch.Tensor) and tuple(mask.shape) == (n, n)
            and mask.dtype == torch.bool) or positions is None or len(positions) != n:
        raise Refused(hint)
    return mask, positions


def _same_mask(got, want) -> bool:
    return torch.equal(got[0], want[0]) and list(got[1]) == list(want[1])


def _causal(parents, root_position):
    n = len(parents)
    positions = mask_and_positions_by_hand(parents, root_position)[1]
    return torch.ones(n, n, dtype=torch.bool).tril(), positions


def _parent_only(parents, root_position):
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i, parent] = True
    return mask, mask_and_positions_by_hand(parents, root_position)[1]


def _no_self(parents, root_position):
    mask, positions = mask_and_positions_by_hand(parents, root_position)
    return mask & ~torch.eye(len(parents), dtype=torch.bool), positions


def _chain_positions(parents, root_position):
    return (mask_and_positions_by_hand(parents, root_position)[0],
            [root_position + 1 + i for i in range(len(parents))])


def _depth_from_zero(parents, root_position):
    mask, positions = mask_and_positions_by_hand(parents, root_position)
    return mask, [p - 1 for p in positions]


MASK = Exercise(
    "tree_mask_and_positions",
    cases=TREES,
    describe=_describe_tree,
    reference=_mask_reference,
    returns=_mask_answer,
    same=_same_mask,
    show=lambda r: (r[0].int().tolist(), list(r[1])),
    mistakes={
        "that is a chain's causal mask: node i sees every node before it, a sibling's branch "
        "too. In a tree a node sees only its ancestors (and itself)": _causal,
        "a node sees its parent, and its parent's parent, up to the root: copy the parent's "
        "whole row, not just the parent": _parent_only,
        "a node sees itself (the diagonal is True), as a token sees its own key in any "
        "causal pass": _no_self,
        "positions go by depth, not by node number: siblings share a position (each is a "
        "guess for the same next token), the root's children at root_position + 1":
            _chain_positions,
        "a child of the root is the token right after it: root_position + depth, depth 1 for "
        "the root's children": _depth_from_zero,
    },
    otherwise="for each node i (parents come first): its row = its parent's row (none for the "
              "root's children), then mask[i, i] = True; position = root_position + its depth",
    forbid=TREE_HELPERS,
    unchanged="read parents, don't change them",
    solution=mask_and_positions_by_hand,
)
check_tree_mask_and_positions = MASK.check


# --- exercise 2: the accepted path ----------------------------------------------------------

def path_by_hand(parents: list[int], tokens: list[int], choices: list[int], pick: int = 0):
    """The solution: from the root, go down to the child holding the target's choice there,
    while there is one; the target's choice where the walk stops is its own token. (`pick`:
    which of several matching siblings; the first, as the engine takes.)"""
    path, at = [], -1
    while True:
        choice = choices[0 if at < 0 else 1 + at]
        match = [c for c, p in enumerate(parents) if p == at and tokens[c] == choice]
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


def _path_answer(got, parents, tokens, choices):
    hint = ("return (path, token): path the list of accepted node numbers, root first "
            "([] when none), token the target's choice where the walk stops (an int)")
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Refused(hint)
    path, token = int_list(got[0]), int_list([got[1]])
    if path is None or token is None:
        raise Refused(hint)
    return list(path), token[0]


def _first_child_only(parents, tokens, choices):
    path, at = [], -1
    while True:
        choice = choices[0 if at < 0 else 1 + at]
        kids = [c for c, p in enumerate(parents) if p == at]
        if not kids or tokens[kids[0]] != choice:
            return path, choice
        path.append(kids[0])
        at = kids[0]


def _by_depth(parents, tokens, choices):
    path, at, d = [], -1, 1
    level = []
    for parent in parents:
        level.append(1 if parent < 0 else level[parent] + 1)
    while True:
        choice = choices[0 if at < 0 else 1 + at]
        match = [c for c in range(len(parents)) if level[c] == d and tokens[c] == choice]
        if not match:
            return path, choice
        path.append(match[0])
        at, d = match[0], d + 1


def _wrong_row(parents, tokens, choices):
    path, at = [], -1
    while True:
        choice = choices[max(at, 0)]
        match = [c for c, p in enumerate(parents) if p == at and tokens[c] == choice]
        if not match:
            return path, choice
        path.append(match[0])
        at = match[0]


def _last_match(parents, tokens, choices):
    return path_by_hand(parents, tokens, choices, pick=-1)


def _proposal_token(parents, tokens, choices):
    path, token = path_by_hand(parents, tokens, choices)
    at = path[-1] if path else -1
    kids = [c for c, p in enumerate(parents) if p == at]
    return path, tokens[kids[0]] if kids else token


def _path_case(parents, tokens, walk, seed):
    """choices that follow `walk` (node numbers) and then pick a token no child has."""
    g = torch.Generator().manual_seed(seed)
    choices = [int(t) for t in torch.randint(0, 50, (len(parents) + 1,), generator=g)]
    at = -1
    for node in walk:
        choices[0 if at < 0 else 1 + at] = tokens[node]
        at = node
    kids = [tokens[c] for c, p in enumerate(parents) if p == at]
    choices[0 if at < 0 else 1 + at] = next(t for t in range(60, 120) if t not in kids)
    return parents, tokens, choices


PATH_CASES = [
    _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [0, 3], 1),         # down the first branch
    _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [1], 2),            # the second child of the root
    _path_case([-1, -1, 0, 0], [5, 7, 9, 11], [], 3),             # nothing accepted
    _path_case([-1, 0, 1, 2], [4, 4, 4, 4], [0, 1, 2], 4),        # a chain
    _path_case([-1, -1, 0, 1, 2, 3], [8, 9, 20, 21, 30, 31], [1, 3, 5], 5),  # to a leaf
    _path_case([-1, -1, 0, 1, 1], [8, 9, 20, 20, 22], [1, 3], 6),  # a cousin shares a token
    _path_case([-1, -1, -1, 2, 2, 4], [3, 6, 12, 1, 2, 7], [2, 4, 5], 7),
    _path_case([-1, -1, 0, 0, 3], [10, 11, 12, 13, 14], [0, 3], 8),
    # two siblings hold the same token (children drawn independently): the first one is taken
    _path_case([-1, -1, 0, 1], [5, 5, 9, 11], [0, 2], 9),
    _path_case([-1, 0, 0, 1, 2, 2], [7, 3, 3, 8, 6, 6], [0, 1, 3], 10),
]


def _describe_path(parents, tokens, choices) -> str:
    return (f"parents={parents}, tokens={tokens}; the target's choice at the root "
            f"{choices[0]}, after node i: {choices[1:]}")


PATH = Exercise(
    "accepted_path",
    cases=PATH_CASES,
    describe=_describe_path,
    reference=_path_reference,
    returns=_path_answer,
    show=lambda r: (list(r[0]), r[1]),
    mistakes={
        "you tried only the first child of each node: a tree offers several guesses for the same "
        "position; go down to the child (any of them) whose token is the target's choice":
            _first_child_only,
        "a token at the right depth is not enough: it must be a child of the node the walk is "
        "at (a cousin's branch assumed other tokens before it)": _by_depth,
        "the target's choice after node i is choices[1 + i] (choices[0] is the root's, the "
        "last committed token's)": _wrong_row,
        "where the walk stops, the token committed is the target's own choice there, not a "
        "proposal it refused": _proposal_token,
        "two siblings may hold the same token (a sampling proposer draws children "
        "independently): take the FIRST child that holds the target's choice, as the engine "
        "does (its subtree is the one the walk then reads), not the last": _last_match,
    },
    otherwise="at = root; loop: choice = the target's choice after `at`; find the first child "
              "of `at` whose token == choice; if there is one, append it and go down; else "
              "return (path, choice)",
    forbid=(accept_matching, *TREE_HELPERS),
    unchanged="read the tree and the choices, don't change them",
    solution=path_by_hand,
)
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
                    draft_seconds: float) -> float:
    """The solution: plain decoding commits `batch` tokens per decode pass of `batch` rows;
    speculation commits batch × tau per step: its drafting, then ONE verify pass of
    batch × (1 + gamma) rows."""
    plain = batch / decode_seconds(batch)
    speculative = batch * tau / (draft_seconds + verify_seconds(batch * (1 + gamma)))
    return speculative / plain


SPEEDUP_CASES = [(3.2, 3, 1, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0002, 16), 0.002),
                 (3.2, 3, 8, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0002, 16), 0.004),
                 (3.2, 3, 32, Cost(0.010, 0.0002, 16), Cost(0.011, 0.0003, 16), 0.010),
                 (2.5, 4, 4, Cost(0.005, 0.0010), Cost(0.004, 0.0010), 0.0),
                 (1.4, 2, 16, Cost(0.020, 0.0005, 64), Cost(0.020, 0.0005, 64), 0.001),
                 (4.0, 5, 2, Cost(0.001, 0.0001, 4), Cost(0.002, 0.0001, 4), 0.0003),
                 (3.0, 3, 64, Cost(0.004, 0.0003, 8), Cost(0.003, 0.0004, 8), 0.020)]


def _rows_gamma(tau, gamma, batch, decode, verify, draft):
    return batch * tau / (draft + verify(batch * gamma)) / (batch / decode(batch))


def _no_tau(tau, gamma, batch, decode, verify, draft):
    return speedup_by_hand(1.0, gamma, batch, decode, verify, draft)


def _tau_minus_one(tau, gamma, batch, decode, verify, draft):
    return speedup_by_hand(tau - 1, gamma, batch, decode, verify, draft)


def _no_draft(tau, gamma, batch, decode, verify, draft):
    return speedup_by_hand(tau, gamma, batch, decode, verify, 0.0)


def _inverted(tau, gamma, batch, decode, verify, draft):
    return 1 / speedup_by_hand(tau, gamma, batch, decode, verify, draft)


def _decode_for_verify(tau, gamma, batch, decode, verify, draft):
    return speedup_by_hand(tau, gamma, batch, decode, decode, draft)


def _as_float(got, *case):
    if isinstance(got, bool) or not isinstance(got, (int, float, torch.Tensor)) or (
            isinstance(got, torch.Tensor) and got.numel() != 1):
        raise Refused("return one number: the speed-up (above 1: speculation pays)")
    return float(got)


SPEEDUP = Exercise(
    "predicted_speedup",
    cases=SPEEDUP_CASES,
    describe=lambda tau, gamma, batch, decode, verify, draft: (
        f"tau={tau} tokens a row commits per step, gamma={gamma}, batch={batch}, "
        f"decode_seconds={decode!r}, verify_seconds={verify!r}, draft_seconds={draft}"),
    reference=speedup_by_hand,
    returns=_as_float,
    same=lambda got, want: math.isclose(got, want, rel_tol=1e-6),
    show=lambda x: round(x, 4),
    mistakes={
        "a row's verify pass feeds its last committed token AND its gamma proposals: "
        "batch × (1 + gamma) rows, not batch × gamma": _rows_gamma,
        "speculation's gain is tau tokens per row per step (plain decoding: 1): multiply by "
        "tau": _no_tau,
        "tau already counts the target's own token (a step commits the accepted proposals and "
        "one more): use tau, not tau - 1": _tau_minus_one,
        "a speculative step also pays its drafting: draft_seconds + the verify pass": _no_draft,
        "the speed-up is speculative throughput over plain throughput (tokens per second): "
        "above 1 when speculation pays": _inverted,
        "time the verify pass with verify_seconds, the decode pass with decode_seconds: a "
        "server may run them on different kernels (this engine's own decode step reads the "
        "paged cache, its verify pass is a packed pass with a mask)": _decode_for_verify,
    },
    otherwise="plain: batch tokens per decode_seconds(batch); speculative: batch × tau tokens "
              "per (draft_seconds + verify_seconds(batch × (1 + gamma))); return their ratio",
    solution=speedup_by_hand,
)
check_predicted_speedup = SPEEDUP.check


# --- exercise 4 (debug): keep the accepted path's K/V -------------------------------------

def keep_as_reported(kv: torch.Tensor, n_committed: int, path: list[int]) -> torch.Tensor:
    """The bug report's function: it keeps the slots right after the committed ones, one per
    accepted node, as chapter 04's crop does for a chain."""
    keep = list(range(n_committed)) + [n_committed + depth for depth in range(len(path))]
    return kv[:, :, keep]


def keep_by_hand(kv: torch.Tensor, n_committed: int, path: list[int]) -> torch.Tensor:
    """The solution: the committed slots, then each accepted node's own slot (node i was
    written at n_committed + i), in the path's order."""
    keep = list(range(n_committed)) + [n_committed + node for node in path]
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


def _slots(kept: torch.Tensor) -> str:
    return f"the slots {[int(x) for x in kept[0, 0, :, 0].floor()]}"


KEEP_CASES = [
    _keep_case(5, [-1, -1, 0, 0], [1]),                      # the second child of the root
    _keep_case(9, [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4], [1, 4, 8]),  # the chapter's round
    _keep_case(3, [-1, -1, 0, 1, 2, 3], [0, 2, 4]),          # first children, a 2-wide tree
    _keep_case(6, [-1, 0, 1, 2], [0, 1, 2, 3]),              # a chain, all accepted
    _keep_case(4, [-1, -1, -1, 2, 2, 4], [2, 4, 5]),
    _keep_case(7, [-1, -1, 0, 0], []),                       # nothing accepted
]


def _keep_answer(got, kv, n_committed, path):
    b, h, _, d = kv.shape
    shape = (b, h, n_committed + len(path), d)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape:
        raise Refused(f"return one tensor of shape {shape}: the {n_committed} committed "
                      f"positions, then the {len(path)} accepted nodes', on dim 2 (positions)")
    return got


def _off_by_one(kv, n_committed, path):
    return torch.cat([kv[:, :, :n_committed], kv[:, :, [n_committed - 1 + n for n in path]]], 2)


def _path_reversed(kv, n_committed, path):
    keep = list(range(n_committed)) + [n_committed + node for node in reversed(path)]
    return kv[:, :, keep]


KEEP = Exercise(
    "keep_accepted",
    cases=KEEP_CASES,
    describe=lambda kv, n, path: (
        f"{n} committed positions (slots 0 to {n - 1}), then a tree of {kv.shape[2] - n} "
        f"nodes written after them (node i at slot {n} + i); accepted path {path}"),
    reference=_keep_reference,
    returns=_keep_answer,
    same=torch.equal,
    show=_slots,
    mistakes={
        "that is the report's bug: it keeps the slots right after the committed ones, one per "
        "accepted node, as a chain's crop does. A tree's verify pass wrote node i at slot "
        "n_committed + i, whatever its depth: a second child's K/V is not in slot "
        "n_committed + its depth. Gather each accepted NODE's slot": keep_as_reported,
        "node i sits at slot n_committed + i (the root, the last committed token, is slot "
        "n_committed - 1, already kept): an accepted node's slot is off by one":
            _off_by_one,
        "the path goes root first: the node at depth 1 goes to position n_committed, the next "
        "one after it, in the path's order": _path_reversed,
    },
    otherwise="keep the committed slots 0 .. n_committed - 1, then slot n_committed + node for "
              "each node of the path, in order: kv[:, :, keep] on the positions' dim",
    forbid=(KVCache.compact,),
    unchanged="return a new tensor; leave kv as the pass wrote it",
    solution=keep_by_hand,
)
check_keep_accepted = KEEP.check


# --- exercise 5 (design): spend a budget of verify rows on a tree -------------------------

# The prompts and length the engine measures a tree shape on (the chapter's prompts)
DESIGN_PROMPTS = ("Once upon a time", "The color of dog", "A coin's state is heads. Alice flips",
                  "A coin's state is tails. Bob doesn't flip it. Carol flips")
DESIGN_TOKENS = 48
DESIGN_BUDGETS = (6, 12)
_measured: dict = {}


def tokens_per_pass(gamma: int, width: int, branch: int) -> float:
    """Tokens the course target commits per target pass, greedy, with the feature head
    proposing a tree γ deep (`tree=(width, branch)`; (1, 1): a chain), over the chapter's 4
    prompts and 48 new tokens each: the engine's measurement (cached)."""
    key = (gamma, width, branch)
    if key not in _measured:
        from ...course.checkpoint import load_course_model, load_feature_head
        from ...course.tokenizer import load_tokenizer
        from ...engine.eagle import feature_generate
        if "models" not in _measured:
            target = load_course_model("target", "cpu")[0]
            _measured["models"] = (target, load_feature_head(target), load_tokenizer())
        target, head, tok = _measured["models"]
        tree = None if (width, branch) == (1, 1) else (width, branch)
        with torch.inference_mode():
            outs = [feature_generate(target, head, tok.encode(p), DESIGN_TOKENS, gamma=gamma,
                                     tree=tree) for p in DESIGN_PROMPTS]
        _measured[key] = (sum(o.stats.new_tokens for o in outs)
                          / sum(o.stats.target_passes for o in outs))
    return _measured[key]


def rows_of(gamma: int, width: int, branch: int) -> int:
    """The most proposals a tree γ deep holds: `branch` at depth 1, then `width` growing
    nodes of `branch` children at each further depth (engine/eagle.py's tree_size)."""
    from ...engine.eagle import tree_size
    return tree_size(gamma, width, branch)


def _design_answer(got, budget):
    hint = ("return (gamma, width, branch): three positive ints, the tree feature_generate "
            "grows with gamma=gamma, tree=(width, branch); (gamma, 1, 1) is a chain")
    values = int_list(got) if isinstance(got, (tuple, list)) else None
    if values is None or len(values) != 3 or min(values) < 1:
        raise Refused(hint)
    rows = rows_of(*values)
    if rows > budget:
        raise Refused(f"over budget: {tuple(values)} holds up to {rows} proposals, the budget "
                      f"is {budget} rows per round; shrink it", expected=f"at most {budget} rows")
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
        if tokens_per_pass(*got) >= 0.97 * tokens_per_pass(*best):
            continue
        gamma, width, branch = got
        if (width, branch) == (1, 1):
            kind = (f"a chain of {gamma}, {budget - gamma} rows unspent: each position deeper "
                    f"adds the chance that every guess so far was right")
        elif gamma == 1:
            kind = ("a bush: every row a guess for the NEXT position only, so a round commits "
                    "at most 2 tokens")
        else:
            kind = (f"a tree ({width} growing nodes of {branch} children, {gamma} deep), like "
                    f"the chapter's: its second guesses hedge a position the first guess "
                    f"usually gets, and cost rows that depth would have used")
        lines.append(f"budget {budget}: your {tuple(got)} is {kind}; it commits "
                     f"{tokens_per_pass(*got):.2f} tokens a pass, the engine measured "
                     f"{tokens_per_pass(*best):.2f} for {best}")
    why = ("the head's first guess is right about 9 times in 10 here (the chapter's α), so a "
           "row spent one position deeper earns more than a row spent on a second guess; "
           "measure shapes with tokens_per_pass before you choose")
    return "; ".join(lines) + ". " + why


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
