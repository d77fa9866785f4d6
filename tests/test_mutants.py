"""The mutation-score tool (minikv/course/mutants.py) on toy code: no notebook runs here."""
from minikv.course.mutants import mutants, regions, verdict

TOY = '''def f(a, b):
    """Docstrings and code outside the markers are the exercise's, never mutated."""
    ### BEGIN SOLUTION
    return a + b if a < b else a - 1
    ### END SOLUTION
'''
# a toy check cell: the checker raises on a wrong answer, prints its ✓ otherwise
CHECK = '''assert f(1, 2) == 3 and f(5, 2) == 4
print("✓ f: all 2 cases pass")
'''


def mutated_lines(source):
    return [m.diff.split("→")[1].strip() for m in mutants(source)]


def test_regions_are_the_lines_between_the_markers():
    assert regions(TOY) == [range(4, 5)]


def test_the_mutator_makes_the_expected_mutants():
    assert sorted(mutated_lines(TOY)) == sorted([
        "return a - b if a < b else a - 1",       # + -> -
        "return a + b if a <= b else a - 1",      # < -> <=
        "return a + b if not a < b else a - 1",   # the condition negated
        "return a + b if a < b else a + 1",       # - -> +
        "return a + b if a < b else a - 2",       # the constant + 1
        "return a + b if a < b else a - 0",       # the constant - 1
    ])
    assert {m.function for m in mutants(TOY)} == {"f"}


def test_statements_calls_and_slices():
    source = ("def g(xs, n):\n    ### BEGIN SOLUTION\n    ys = xs[1:n]\n"
              "    ys.append(max(n, 0))\n    ys.insert(n, 0)\n    return ys\n"
              "    ### END SOLUTION\n")
    lines = mutated_lines(source)
    assert lines.count("(dropped)") == 3           # any statement but the return
    assert "ys.insert(0, n)" in lines              # two positional arguments swapped
    assert "ys.append(max(0, n))" not in lines     # but not max's: they commute
    assert "ys = xs[1:n + 1]" in lines and "ys = xs[1:n - 1]" in lines  # a slice bound +- 1
    assert "ys = xs[2:n]" in lines and "ys = xs[1 + 1:n]" not in lines  # a constant bound once
    sources = [m.source for m in mutants(source)]
    assert len(sources) == len(set(sources))       # no mutant twice


def test_the_cap_spreads_its_picks_over_the_function():
    picked = mutants(TOY, cap=3)
    assert len(picked) == 3 and picked == mutants(TOY, cap=3)  # deterministic


def test_a_mutant_that_changes_the_answer_is_killed_and_an_equivalent_one_survives():
    namespace = {"__name__": "__main__"}
    exec(TOY, namespace)
    assert verdict(TOY, CHECK, namespace, 5) == "survived"   # the solution itself passes
    wrong = next(m for m in mutants(TOY) if "a - b" in m.diff.split("→")[1])
    assert verdict(wrong.source, CHECK, namespace, 5) == "killed"
    # a < b and a <= b differ only when a == b, which the toy check never tries: it survives
    same = next(m for m in mutants(TOY) if "a <= b" in m.diff)
    assert verdict(same.source, CHECK, namespace, 5) == "survived"
    assert namespace["f"](1, 2) == 3  # the notebook's namespace is left as it was


def test_an_endless_loop_is_stopped_and_counted_as_a_timeout():
    loop = "def h():\n    while True:\n        pass\n"
    assert verdict(loop, "h()\n", {}, 0.2) == "timeout"


def test_the_score_leaves_out_the_mutants_judged_equivalent():
    from minikv.course.mutants import equivalent, score
    assert score(killed=19, mutants=21, equivalent=1) == 19 / 20
    assert score(0, 0, 0) == 0.0
    for (exercise, mutant), why in equivalent().items():
        assert exercise and " → " in mutant and ": " in mutant, mutant
        assert len(why) > 20, f"say why {mutant} computes what the solution computes"
