"""Chapter 10's checkers beyond their tables (tests/test_checks_table.py feeds every named
mistake): the engine's own tree helpers refused, wrong return forms, arguments changed in place,
the solutions agreeing with the engine on many random trees, and the design exercise's answer
the best shape the engine measures within each budget."""
import random

import pytest
import torch

from minikv.course.checks import CheckFailed, ch10
from minikv.engine.tree import tree_mask, tree_positions


def test_the_engines_tree_helpers_are_refused():
    def mask_and_positions(parents, root_position):
        return tree_mask(parents, prefix=0), tree_positions(parents, root_position)
    with pytest.raises(CheckFailed, match="minikv.engine.tree.tree_mask"):
        ch10.check_tree_mask_and_positions(mask_and_positions)


@pytest.mark.parametrize("wrong, says", [
    (lambda parents, root: ch10.mask_and_positions_by_hand(parents, root)[0], "return \\(mask"),
    (lambda parents, root: (ch10.mask_and_positions_by_hand(parents, root)[0].int(),
                            ch10.mask_and_positions_by_hand(parents, root)[1]), "bool tensor"),
    (lambda parents, root: (ch10.mask_and_positions_by_hand(parents, root)[0],
                            [float(p) for p in ch10.mask_and_positions_by_hand(parents, root)[1]]),
     "a list of"),
])
def test_mask_answers_of_the_wrong_form_are_refused(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        ch10.check_tree_mask_and_positions(wrong)


def test_a_path_walk_that_changes_the_choices_is_caught():
    def in_place(parents, tokens, choices):
        out = ch10.path_by_hand(parents, tokens, choices)
        choices[0] = -1
        return out
    with pytest.raises(CheckFailed, match="don't change them"):
        ch10.check_accepted_path(in_place)


def test_random_trees_solutions_agree_with_the_engine():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        mask, positions = ch10.mask_and_positions_by_hand(parents, 7)
        assert torch.equal(mask, tree_mask(parents, prefix=0))
        assert positions == tree_positions(parents, 7)
        tokens = [rng.randint(0, 5) for _ in range(n)]
        choices = [rng.randint(0, 5) for _ in range(n + 1)]
        # siblings may share a token (a sampling proposer draws them independently): the first
        assert ch10.path_by_hand(parents, tokens, choices) == ch10._path_reference(
            parents, tokens, choices)
        path = ch10.path_by_hand(parents, tokens, choices)[0]
        kv, n_committed = ch10._keep_case(rng.randint(1, 9), parents, path)[:2]
        assert torch.equal(ch10.keep_by_hand(kv, n_committed, path),
                           ch10._keep_reference(kv, n_committed, path))


def test_speculation_pays_at_small_batches_and_not_at_large_ones_under_the_cost_model():
    """The exercise's model: a pass costs `fixed` up to `spare` rows; past them each row costs.
    With tau = 3.2 and γ = 3, the speed-up falls below 1 once the verify pass's rows leave the
    spare compute far behind."""
    cost = ch10.Cost(0.010, 0.0002, 16)
    ups = {b: ch10.speedup_by_hand(3.2, 3, b, cost, cost, 0.0) for b in (1, 4, 16, 64, 256)}
    assert ups[1] > 3 and ups[4] > 3 and ups[256] < 1
    assert all(ups[a] >= ups[b] for a, b in zip((1, 4, 16, 64), (4, 16, 64, 256)))


def test_the_reported_keep_is_right_for_chains_and_wrong_for_a_second_child():
    kv, n, path = ch10._keep_case(5, [-1, 0, 1], [0, 1, 2])
    assert torch.equal(ch10.keep_as_reported(kv, n, path), ch10._keep_reference(kv, n, path))
    kv, n, path = ch10._keep_case(5, [-1, -1, 0, 0], [1])
    assert not torch.equal(ch10.keep_as_reported(kv, n, path), ch10._keep_reference(kv, n, path))


def test_a_keep_that_writes_into_kv_is_caught():
    def in_place(kv, n_committed, path):
        kv[:, :, n_committed:n_committed + len(path)] = kv[:, :, [n_committed + i for i in path]]
        return kv[:, :, :n_committed + len(path)].clone()
    with pytest.raises(CheckFailed, match="leave kv"):
        ch10.check_keep_accepted(in_place)


def test_the_engines_compact_is_refused():
    def by_the_engine(kv, n_committed, path):
        return ch10._keep_reference(kv, n_committed, path)
    with pytest.raises(CheckFailed, match="KVCache.compact"):
        ch10.check_keep_accepted(by_the_engine)


@pytest.mark.slow
def test_the_design_answer_is_the_best_shape_within_each_budget():
    """Every (gamma, width, branch) with width and branch up to 4 within the budget, measured
    by the engine: none commits more than 3 % above the answer the checker grades against."""
    for budget in ch10.DESIGN_BUDGETS:
        best = ch10.tokens_per_pass(*ch10._design_best(budget))
        shapes = {(g, w, b) for g in range(1, budget + 1) for w in range(1, 5)
                  for b in range(1, 5) if ch10.rows_of(g, w, b) <= budget}
        shapes = {s for s in shapes if s[2] > 1 or s[1] == 1}  # branch 1: width changes nothing
        worst = max(shapes, key=lambda s: ch10.tokens_per_pass(*s))
        assert ch10.tokens_per_pass(*worst) <= best * 1.03, (budget, worst)


@pytest.mark.parametrize("choice, says", [
    (lambda budget: (budget + 1, 1, 1), "over budget"),
    (lambda budget: (1, 1, budget), "a bush"),
    (lambda budget: (budget // 2, 1, 1), "rows unspent"),
    (lambda budget: (2, 1, 2), "a tree"),
    (lambda budget: "chain", "return \\(gamma, width, branch\\)"),
])
def test_wrong_designs_are_named(choice, says):
    with pytest.raises(CheckFailed, match=says):
        ch10.check_choose_tree(choice)
