"""Chapter 08's design checker (choose_long_window, code rather than a table): the solution passes,
and each plausible wrong choice fails with the hint that names it."""
import pytest

from minikv.course.checks import CheckFailed, ch08

PER = 12 * 2 * 8 * 24 * 4  # fp32 K/V bytes of one target-rope position


def _choice(sinks=4, window=None, rope="reindex", theta=10000.0, cap=255):
    def choose(budget):
        held = min(budget // PER, cap)
        return {"sinks": sinks, "window": held - sinks if window is None else window,
                "rope": rope, "rope_theta": theta}
    return choose


def test_the_solution_passes(capsys):
    ch08.check_choose_long_window(ch08.choose_long_window_by_hand)
    assert capsys.readouterr().out == "✓ choose_long_window: all 4 cases pass\n"


@pytest.mark.parametrize("choose, says", [
    (_choice(rope="true"), "at true positions the sinks stay at their true distance"),
    (_choice(cap=10**9), "the farthest distance is sinks \\+ window"),
    (_choice(theta=10000.0 * 4 ** (24 / 22)), "keep the trained rope_theta"),
    (_choice(sinks=0), "keep a few sinks"),
    (_choice(window=100), "over the budget"),
    (_choice(cap=40), "a longer window only helps"),
    (lambda budget: (4, 50), "return a dict"),
])
def test_each_wrong_choice_is_named(choose, says):
    with pytest.raises(CheckFailed, match=says):
        ch08.check_choose_long_window(choose)
