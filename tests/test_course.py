"""Exercises are generated from solutions: the generator strips exactly the solution regions, and
exercises/ is always what the generator makes of solutions/."""
import pytest

from minikv.course import notebooks as course


def test_strip_keeps_everything_but_the_solution():
    source = ("def area(w, h):\n    \"\"\"Doc.\"\"\"\n    ### BEGIN SOLUTION\n    a = w * h\n"
              "    return a\n    ### END SOLUTION\n\nx = 1")
    stub = course.strip_solutions(source)
    assert stub.splitlines() == ["def area(w, h):", '    """Doc."""', "    # YOUR CODE HERE",
                                 f"    {course.STUB}", "", "x = 1"]
    namespace = {}
    exec(stub, namespace)  # defining the stub is fine ...
    with pytest.raises(NotImplementedError):
        namespace["area"](2, 3)  # ... calling it is not


@pytest.mark.parametrize("broken", ["### BEGIN SOLUTION\nx", "x\n### END SOLUTION",
                                    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"])
def test_unbalanced_markers_are_refused(broken):
    with pytest.raises(ValueError):
        course.strip_solutions(broken)


def test_exercises_are_in_sync_with_solutions():
    stale = course.write_exercises(check=True)
    assert not stale, f"run `python -m minikv exercises`: {stale}"
    assert len(list((course.ROOT / "exercises").glob("*.ipynb"))) == len(course.exercise_pairs())


@pytest.mark.parametrize("folder", ["notebooks", "solutions"])
def test_notebooks_are_committed_executed(folder):
    """nbval compares outputs: a notebook saved without them would pass while checking nothing."""
    import nbformat
    for path in sorted((course.ROOT / folder).glob("*.ipynb")):
        unrun = [i for i, cell in enumerate(nbformat.read(path, as_version=4).cells)
                 if cell.cell_type == "code" and cell.execution_count is None]
        assert not unrun, (f"{path.name}: code cells {unrun} saved without running; "
                           f"run `python -m minikv run {folder}/{path.name}`")


@pytest.mark.parametrize("path", sorted((course.ROOT / "exercises").glob("*.ipynb")),
                         ids=lambda p: p.name)
def test_exercise_check_cells_show_no_result_before_the_student_runs_them(path):
    """An exercise must not show "✓ all cases pass" under a stub that raises."""
    import nbformat
    cells = nbformat.read(path, as_version=4).cells
    checks = [c for c in cells if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]
    assert checks and all(not c.outputs and c.execution_count is None for c in checks)
    assert not any("✓" in str(c.get("outputs", "")) for c in cells)


def test_the_classroom_workflow_grades_one_point_per_exercise():
    """GitHub Classroom's workflow: a grader per exercise, worth one point, its command `python -m
    minikv grade --exercise` on exactly that exercise of its notebook (lax: by what it computes),
    sharing one cache so each notebook runs once; the reporter reads every grader (a grader it does
    not list would score nothing)."""
    import nbformat
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(course.CLASSROOM.read_text())
    steps = workflow["jobs"]["autograding"]["steps"]
    graders = [s for s in steps if "autograding-command-grader" in s.get("uses", "")]
    reporter = next(s for s in steps if "autograding-grading-reporter" in s.get("uses", ""))
    expected = [(exercise, name) for solution, exercise in course.exercise_pairs()
                for name in course.exercise_names(nbformat.read(solution, as_version=4)).values()]
    assert len(graders) == len(expected) >= 3 * len(course.exercise_pairs())
    for grader, (exercise, name) in zip(graders, expected):
        assert grader["with"]["max-score"] == 1
        assert grader["with"]["command"].split() == [
            ".venv/bin/python", "-m", "minikv", "grade", f"exercises/{exercise.name}",
            "--exercise", name, "--cache", "${{", "runner.temp", "}}/minikv-grade"]
    assert "--nbval" not in course.CLASSROOM.read_text()  # no saved output compared
    ids = [g["id"] for g in graders]
    assert len(set(ids)) == len(ids)
    assert reporter["with"]["runners"].split(",") == ids
    assert set(reporter["env"]) == {f"{i.upper()}_RESULTS" for i in ids}
    # the whole grade report in the log, from the same cache, whatever the graders said
    report = steps[steps.index(reporter) - 1]
    assert report["if"] == "always()" and report["run"].split() == [
        ".venv/bin/python", "-m", "minikv", "grade", "--cache", "${{", "runner.temp",
        "}}/minikv-grade", "||", "true"]
