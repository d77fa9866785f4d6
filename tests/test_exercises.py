"""Exercises are graded by what they compute, never by saved outputs (nbval-lax and `python -m
minikv grade`): every generated exercise notebook fails exactly at its check cells (each stub makes
its own check fail, and no other cell depends on the learner's code), a solved one passes on any
CPU's kernels, and the grader gives one point per exercise."""
import contextlib
import io
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from minikv import __main__ as cli
from minikv.course import grade
from minikv.course import notebooks as course

EXERCISES = sorted((course.ROOT / "exercises").glob("*.ipynb"))
LAX = ["--nbval-lax", "--nbval-current-env",
       "--nbval-sanitize-with", str(course.ROOT / "tests/nbval_sanitize.cfg")]
CHAPTER = "05_deterministic_requests.ipynb"  # graded below: six exercises, ~15 s a run
SOLVED = "invariant_split_sum"  # the one exercise solved in the partly solved notebook
NAMES = list(course.exercise_names(
    nbformat.read(course.ROOT / "solutions" / CHAPTER, as_version=4)).values())


def check_cells(path: Path) -> set[str]:
    """nbval's item names ("Cell N", N counting code cells) of the cells tagged "check"."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return {f"Cell {i}" for i, c in enumerate(code) if "check" in c.metadata.get("tags", [])}


def nbval_lax(paths: list[Path], report: Path, **env: str) -> dict[str, dict[str, bool]]:
    """Run nbval-lax on `paths` in one pytest; {notebook name: {"Cell N": passed}}."""
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    *map(str, paths), *LAX, f"--junitxml={report}"],
                   cwd=course.ROOT, capture_output=True, text=True, timeout=900,
                   env={**os.environ, **env})
    cells: dict[str, dict[str, bool]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        notebook = case.get("classname").split(".", 1)[1]  # "exercises.00_setup.ipynb"
        failed = case.find("failure") is not None or case.find("error") is not None
        cells.setdefault(notebook, {})[case.get("name")] = not failed
    return cells


@pytest.fixture(scope="module")
def stub_cells(tmp_path_factory):
    return nbval_lax(EXERCISES, tmp_path_factory.mktemp("nbval") / "exercises.xml")


def test_every_chapter_has_exercises():
    assert len(EXERCISES) == len(course.exercise_pairs()) >= 6


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_fails_exactly_at_its_check_cells(path, stub_cells):
    checks = check_cells(path)
    assert len(checks) >= 2, (f"{path.name}: every chapter needs at least two exercises, "
                              "each with a check cell")
    cells = stub_cells[path.name]
    n_code = sum(c.cell_type == "code" for c in nbformat.read(path, as_version=4).cells)
    assert len(cells) == n_code, "every cell runs, those after a failing one included"
    assert {name for name, passed in cells.items() if not passed} == checks


def test_a_solved_notebook_passes_lax_on_the_plainest_cpu_kernels(tmp_path):
    """ATEN_CPU_CAPABILITY=default: no AVX2/AVX-512 kernels, so other bits than the saved outputs'
    in this chapter about bits; lax grading must not care."""
    cells = nbval_lax([course.ROOT / "solutions" / CHAPTER], tmp_path / "solution.xml",
                      ATEN_CPU_CAPABILITY="default")
    assert cells[CHAPTER] and all(cells[CHAPTER].values()), cells


@pytest.mark.parametrize("solution", [p for p, _ in course.exercise_pairs()], ids=lambda p: p.name)
def test_every_check_cell_names_its_exercise(solution):
    """Each check cell, in the shared two-line form (a fresh copy of its chapter's checkers),
    checks what the solution cell just before it defines, and printed its ✓ there."""
    notebook = nbformat.read(solution, as_version=4)
    names = course.exercise_names(notebook)
    assert len(names) == course.check_cells(notebook) == len(set(names.values()))
    code = [c for c in notebook.cells if c.cell_type == "code"]
    for i, name in names.items():
        first, second = code[i].source.splitlines()
        assert first == "import importlib, minikv.course.checks as checks" and name.isidentifier()
        assert second.startswith(f'importlib.reload(checks).fresh("ch{solution.name[:2]}")'
                                 f'.check_{name}(')
        checked = second.split("(", 3)[-1].split(",")[0].rstrip(")")
        assert course.BEGIN in code[i - 1].source and f" {checked}(" in code[i - 1].source
        assert "✓" in str(code[i].outputs)


# --- the grader ----------------------------------------------------------------------------------

def partly_solved(directory: Path) -> Path:
    """CHAPTER with only exercise SOLVED solved: every other solution region stubbed, as
    `exercise_from_solution` does (each check cell follows its exercise's code cell)."""
    notebook = nbformat.read(course.ROOT / "solutions" / CHAPTER, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    keep = next(code[i - 1] for i, name in course.exercise_names(notebook).items()
                if name == SOLVED)
    for cell in code:
        if course.BEGIN in cell.source and cell is not keep:
            cell.source = course.strip_solutions(cell.source)
        if "check" in cell.metadata.get("tags", []):
            cell.outputs, cell.execution_count = [], None
    path = directory / CHAPTER
    nbformat.write(notebook, path)
    return path


def run_grader(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["grade", *argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The grader on CHAPTER solved, as handed out, and partly solved; each run once, into a
    cache that the --exercise runs then read."""
    tmp = tmp_path_factory.mktemp("grade")
    cache = str(tmp / "cache")
    paths = {"solution": course.ROOT / "solutions" / CHAPTER,
             "exercise": course.ROOT / "exercises" / CHAPTER, "partial": partly_solved(tmp)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATEN_CPU_CAPABILITY", "default")  # the kernels inherit it
        runs = {kind: run_grader(str(path), "--cache", cache) for kind, path in paths.items()}
    return runs, paths, cache


def lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.startswith("  ")]


def test_grader_passes_every_exercise_of_a_solution(graded):
    (code, out), names = graded[0]["solution"], NAMES
    assert code == 0, out
    assert lines(out) == [f"✓ {name}" for name in names]
    assert out.splitlines()[-1] == f"score: {len(names)} / {len(names)}"


def test_grader_fails_every_stub_with_its_message(graded):
    code, out = graded[0]["exercise"]
    assert code == 1
    assert [line.split(":")[0] for line in lines(out)] == [f"✗ {name}" for name in NAMES]
    assert all(line.endswith("NotImplementedError: your turn: replace this line with your code")
               for line in lines(out))
    assert out.splitlines()[-1] == f"score: 0 / {len(NAMES)}"


def test_grader_gives_partial_credit(graded):
    code, out = graded[0]["partial"]
    assert code == 1
    assert [line.split(":")[0] for line in lines(out)] == [
        f"✓ {name}" if name == SOLVED else f"✗ {name}" for name in NAMES]
    assert out.splitlines()[-1] == f"score: 1 / {len(NAMES)}"


def test_grader_grades_one_exercise_from_the_cache(graded):
    _, paths, cache = graded
    assert len(list(Path(cache).glob("*.json"))) == 3  # one run per notebook, not per exercise
    assert run_grader(str(paths["partial"]), "--exercise", SOLVED, "--cache", cache) == (
        0, f"  ✓ {SOLVED}\nscore: 1 / 1\n")
    code, out = run_grader(str(paths["partial"]), "--exercise", "choose", "--cache", cache)
    assert code == 1 and out.startswith("  ✗ choose: NotImplementedError: your turn")
    assert run_grader(str(paths["partial"]), "--exercise", "nope")[0] == 2


def test_grader_reports_a_wrong_answer_with_the_checkers_message(tmp_path):
    """A tiny notebook: a check cell raising CheckFailed, a crashing cell before it that does not
    stop it, and a passing check."""
    nb = nbformat.v4.new_notebook()
    fail = ("from minikv.course.checks import fail\n"
            "fail('add', 'add(1, 2)', 3, 4, 'add, do not multiply')  # .check_add(add)")
    nb.cells = [nbformat.v4.new_code_cell("1 / 0"),
                nbformat.v4.new_code_cell(fail, metadata={"tags": ["check"]}),
                nbformat.v4.new_code_cell("print('ok')  # .check_sub(sub)",
                                          metadata={"tags": ["check"]})]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    code, out = run_grader(str(path), "--cache", str(tmp_path / "cache"))
    assert code == 1
    assert out == ("  ✗ add: CheckFailed: add: wrong for add(1, 2)\n"
                   "      expected: 3\n      got:      4\n      hint: add, do not multiply\n"
                   "  ✓ sub\nscore: 1 / 2\n")
    errors = grade.cell_errors(path, cache=tmp_path / "cache")  # read back, not run again
    assert errors[0] == "ZeroDivisionError: division by zero" and errors[2] is None


def test_grade_is_a_command_with_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grade", "-h"])
    assert exit_.value.code == 0 and "--exercise" in capsys.readouterr().out
    cli.main(["-h"])
    assert "grade" in capsys.readouterr().out
