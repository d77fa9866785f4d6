"""Exercises are graded by what they compute, never by saved outputs (nbval-lax and `python -m
minikv grade`): every generated exercise notebook fails exactly at its check cells (each stub makes
its own check fail, and no other cell depends on the learner's code), a solved one passes on any
CPU's kernels, and the grader gives one point per exercise."""
import contextlib
import importlib.util
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


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem[:2])
def test_no_exercise_shows_the_solutions_answers(path):
    """A cell that holds or calls a function the student writes keeps no saved output: the
    exercise must not print the solution's answer (or its ✓) before the student writes it."""
    solution = nbformat.read(course.ROOT / "solutions" / path.name, as_version=4)
    written = course.solution_functions(solution)
    assert written, "every chapter has functions to write"
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code" and any(f"{name}(" in cell.source for name in written):
            assert not cell.outputs, cell.source[:200]


def test_the_generator_finds_what_a_cell_calls():
    solution = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("def mine(x):\n    ### BEGIN SOLUTION\n    return x\n"
                                  "    ### END SOLUTION\n"),
        nbformat.v4.new_code_cell("print(mine(3))", outputs=[nbformat.v4.new_output(
            "stream", text="3\n")]),
        nbformat.v4.new_code_cell("print(s.mine(3))", outputs=[nbformat.v4.new_output(
            "stream", text="3\n")])])
    exercise = course.exercise_from_solution(solution)
    assert course.solution_functions(solution) == {"mine"}
    assert [len(c.outputs) for c in exercise.cells] == [0, 0, 1]  # s.mine is someone else's


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_fails_exactly_at_its_check_cells(path, stub_cells):
    checks = check_cells(path)
    assert len(checks) >= 2, (f"{path.name}: every chapter needs at least two exercises, "
                              "each with a check cell")
    cells = stub_cells[path.name]
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    assert len(cells) == len(code), "every cell runs, those after a failing one included"
    if importlib.util.find_spec("triton") is None:  # chapter 09's kernel: its check skips
        checks -= {f"Cell {i}" for i, c in enumerate(code) if ".check_walk_kernel(" in c.source}
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


def lines(output: str) -> list[tuple[str, str]]:
    """The report's exercise lines as (name, what follows the name)."""
    report = output.split("\ngrade report\n", 1)[1].splitlines()[:-1]
    return [(line.split()[1], line.split(None, 2)[2]) for line in report]


def total(output: str) -> str:
    return output.splitlines()[-1]


def test_grader_passes_every_exercise_of_a_solution(graded):
    (code, out), names = graded[0]["solution"], NAMES
    assert code == 0, out
    assert lines(out) == [(name, "✓") for name in names]
    assert total(out) == (f"total: {len(names)} / {len(names)} exercises passed · 0 wrong · "
                          "0 not started")


def test_grader_reports_every_stub_as_not_started(graded):
    """The whole report on a chapter as handed out: its exercises in order, numbered, each "not
    started", in fewer than 40 lines (no tracebacks)."""
    code, out = graded[0]["exercise"]
    assert code == 1
    assert lines(out) == [(name, "not started") for name in NAMES]
    report = out.split("\ngrade report\n", 1)[1].splitlines()
    assert [line.split()[0] for line in report[:-1]] == [
        f"{CHAPTER[:2]}·{i}" for i in range(1, len(NAMES) + 1)]
    assert total(out) == f"total: 0 / {len(NAMES)} exercises passed · 0 wrong · " \
                         f"{len(NAMES)} not started"
    assert len(out.splitlines()) <= 40 and "Traceback" not in out


def test_every_chapters_unsolved_report_fits_in_40_lines():
    """running…, a blank line, "grade report", one line per exercise and the total."""
    for path in EXERCISES:
        n = len(course.exercise_names(nbformat.read(path, as_version=4)))
        assert 4 + n <= 40, f"{path.name}: {n} exercises make a {4 + n}-line report"


def test_grader_gives_partial_credit(graded):
    code, out = graded[0]["partial"]
    assert code == 1
    assert lines(out) == [(name, "✓" if name == SOLVED else "not started") for name in NAMES]
    assert total(out).startswith(f"total: 1 / {len(NAMES)} exercises passed · 0 wrong · ")


def test_grader_grades_one_exercise_from_the_cache(graded):
    _, paths, cache = graded
    assert len(list(Path(cache).glob("*.json"))) == 3  # one run per notebook, not per exercise
    code, out = run_grader(str(paths["partial"]), "--exercise", SOLVED, "--cache", cache)
    assert code == 0 and lines(out) == [(SOLVED, "✓")]
    assert total(out) == "total: 1 / 1 exercises passed · 0 wrong · 0 not started"
    code, out = run_grader(str(paths["partial"]), "--exercise", "choose", "--cache", cache)
    assert code == 1 and lines(out) == [("choose", "not started")]
    assert run_grader(str(paths["partial"]), "--exercise", "nope")[0] == 2


def tiny_notebook(path: Path) -> Path:
    """A crashing cell outside the exercises (it does not stop the cells after it), a check cell
    raising CheckFailed, a passing check, and a stub's check."""
    nb = nbformat.v4.new_notebook()
    fail = ("from minikv.course.checks import fail\n"
            "fail('add', 'add(1, 2)', 3, 4, 'add, do not multiply')  # .check_add(add)")
    stub = f"{course.STUB}  # .check_mul(mul)"
    nb.cells = [nbformat.v4.new_code_cell("1 / 0"),
                nbformat.v4.new_code_cell(fail, metadata={"tags": ["check"]}),
                nbformat.v4.new_code_cell("print('ok')  # .check_sub(sub)",
                                          metadata={"tags": ["check"]}),
                nbformat.v4.new_code_cell(stub, metadata={"tags": ["check"]})]
    nbformat.write(nb, path)
    return path


def test_grader_reports_a_wrong_answer_with_the_checkers_message(tmp_path):
    """✗ with the input, expected, got and hint on one line; a cell outside the exercises that
    raised is reported and fails the run, without counting as an exercise."""
    path = tiny_notebook(tmp_path / "99_tiny.ipynb")
    code, out = run_grader(str(path), "--cache", str(tmp_path / "cache"))
    assert code == 1
    assert out.split("\ngrade report\n")[1] == (
        "  99·1  add                        ✗ wrong for add(1, 2): expected 3, got 4 · "
        "hint: add, do not multiply\n"
        "  99·2  sub                        ✓\n"
        "  99·3  mul                        not started\n"
        "  99    cell 0                     ✗ ZeroDivisionError: division by zero\n"
        "total: 1 / 3 exercises passed · 1 wrong · 1 not started · 1 other cell raised\n")
    assert "Traceback" not in out
    errors = grade.cell_errors(path, cache=tmp_path / "cache")  # read back, not run again
    assert errors[0] == "ZeroDivisionError: division by zero" and errors[2] is None


def test_a_check_that_cannot_run_here_is_skipped_not_passed(tmp_path):
    """Chapter 09's Triton kernel where Triton does not install: its check cell prints "⊘ ..."
    and raises nothing; the grader says skipped, gives no point and fails nothing."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('✓ add: all 2 cases pass')  # .check_add(add)",
                                          metadata={"tags": ["check"]}),
                nbformat.v4.new_code_cell("print('⊘ kern: skipped, not graded: no Triton')"
                                          "  # .check_kern(kern)", metadata={"tags": ["check"]})]
    nbformat.write(nb, tmp_path / "99_skip.ipynb")
    code, out = run_grader(str(tmp_path / "99_skip.ipynb"))
    assert code == 0, out
    assert lines(out) == [("add", "✓"), ("kern", "skipped (no Triton)")]
    assert total(out) == ("total: 1 / 1 exercises passed · 0 wrong · 0 not started · 1 skipped "
                          "(cannot be graded here)")


def test_grader_verbose_adds_the_failing_cells_tracebacks(tmp_path):
    path = tiny_notebook(tmp_path / "99_tiny.ipynb")
    code, out = run_grader(str(path), "--verbose")
    assert code == 1
    head, report = out.split("\ngrade report\n")
    for name in ("add", "mul", "cell 0"):
        assert f": {name} ──" in head
    assert head.count("Traceback") == 3 and "ZeroDivisionError" in head and "✓" not in head
    assert report.splitlines()[-1].startswith("total: 1 / 3 exercises passed")


def test_make_check_exercises_grades_one_chapter(tmp_path):
    """`make check-exercises CHAPTER=02`: the report, no tracebacks, a failing status; an unknown
    chapter is refused by name."""
    make = ["make", "-s", "-o", ".venv/.installed", f"PY={sys.executable}", "check-exercises"]
    run = subprocess.run([*make, "CHAPTER=02"], cwd=course.ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert run.stdout.startswith("running exercises/02_kv_cache_guide.ipynb\n"), run.stdout
    names = course.exercise_names(nbformat.read(course.ROOT / "exercises/02_kv_cache_guide.ipynb",
                                                as_version=4)).values()
    assert lines(run.stdout) == [(name, "not started") for name in names]
    assert "Traceback" not in run.stdout + run.stderr and len(run.stdout.splitlines()) <= 40
    bad = subprocess.run([*make, "CHAPTER=99"], cwd=course.ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "no chapter '99' in exercises/; chapters: 00 01" in bad.stderr


def test_grade_is_a_command_with_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grade", "-h"])
    assert exit_.value.code == 0 and "--exercise" in capsys.readouterr().out
    cli.main(["-h"])
    assert "grade" in capsys.readouterr().out
