"""Chapter 10's checkers beyond their tables (tests/test_checks_table.py feeds every named
mistake): the engine's own tree helpers refused, wrong return forms, arguments changed in place,
and the solutions agreeing with the engine on many random trees."""
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
        # siblings distinct, as a proposer gives them: the walk is then one path
        if all(len({tokens[c] for c in range(n) if parents[c] == p})
               == sum(parents[c] == p for c in range(n)) for p in range(-1, n)):
            assert ch10.path_by_hand(parents, tokens, choices) == ch10._path_reference(
                parents, tokens, choices)


def test_speculation_pays_at_small_batches_and_not_at_large_ones_under_the_cost_model():
    """The exercise's model: a pass costs `fixed` up to `spare` rows; past them each row costs.
    With tau = 3.2 and γ = 3, the speed-up falls below 1 once the verify pass's rows leave the
    spare compute far behind."""
    cost = ch10.Cost(0.010, 0.0002, 16)
    ups = {b: ch10.speedup_by_hand(3.2, 3, b, cost, cost, 0.0) for b in (1, 4, 16, 64, 256)}
    assert ups[1] > 3 and ups[4] > 3 and ups[256] < 1
    assert all(ups[a] >= ups[b] for a, b in zip((1, 4, 16, 64), (4, 16, 64, 256)))
