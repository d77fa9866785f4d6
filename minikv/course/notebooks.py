"""Course tooling: exercises are generated from solutions, never edited by hand.

    python -m minikv exercises           # rewrite exercises/ (each chapter's exercise list, and
                                         # the classroom workflow)
    python -m minikv exercises --check   # exit 1 if either is out of date
    python -m minikv run notebooks/01_prefill_decode.ipynb ...   # execute, save with outputs

A solution region is the code between `### BEGIN SOLUTION` and `### END SOLUTION` (nbgrader's
markers), always inside a function body, so the stub only raises when the check cell calls it.
Other cells keep the solution's outputs; check cells are saved without any, so an exercise notebook
shows no success before the student writes a line. Exercises are graded by what they compute, never
by saved outputs (`--nbval-lax`, or `python -m minikv grade`): a check cell passes exactly when it
runs without raising, since the checker raises on every wrong answer and the stub raises
NotImplementedError.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

import nbformat

from . import arguments
from .files import read_at_most, write_atomically

ROOT = Path(__file__).resolve().parents[2]
MAX_NOTEBOOK_BYTES = 64 << 20  # the biggest chapter, figures and all, is ~0.6 MB
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB_MESSAGE = "your turn: replace this line with your code"
STUB = f"raise NotImplementedError(\"{STUB_MESSAGE}\")"


def strip_solutions(source: str) -> str:
    """Replace each solution region (markers included) by a stub at the marker's indentation."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f"{indent}{STUB}")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out)


def exercise_from_solution(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Solution regions become stubs; check cells lose their outputs, as does every cell that
    holds or calls a function the student writes: an exercise notebook shows neither "✓ all
    cases pass" nor the solution's answers before the student has written a line."""
    exercise = nbformat.from_dict(solution)
    written = solution_functions(solution)
    for cell in exercise.cells:
        if cell.cell_type != "code":
            continue
        calls = any(re.search(rf"(?<![\w.]){name}\(", cell.source) for name in written)
        if BEGIN in cell.source or calls or "check" in cell.metadata.get("tags", []):
            cell.outputs, cell.execution_count = [], None
        if BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
    return exercise


def solution_functions(notebook: nbformat.NotebookNode) -> set[str]:
    """The names of the functions whose body holds a solution region: the student's."""
    names = set()
    for cell in notebook.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            defs = [(d.start(), d.group(1)) for d in re.finditer(
                r"^(?:class|def) (\w+)\b", cell.source, re.MULTILINE)]  # top level
            for marker in re.finditer(re.escape(BEGIN), cell.source):
                names.add(max(d for d in defs if d[0] < marker.start())[1])
    return names


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """The nbformat-4 notebook at `path`, checked against its schema, or a ValueError that says
    what is wrong and what to do: nbformat.read lets a broken file through (cells as a dict) or
    fails deep inside as an AttributeError, AssertionError, RecursionError or jsonschema error."""
    path = Path(path)
    fix = "restore it from git, or open it in Jupyter and save it again"
    data = read_at_most(path, MAX_NOTEBOOK_BYTES, "notebook", fix)
    try:
        raw = json.loads(data.decode())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a 5000-digit int, [[[[...
        raise ValueError(f"{path} is not a notebook: it is not valid JSON ({e}); {fix}") from None
    version = raw.get("nbformat") if isinstance(raw, dict) else None
    if type(version) is not int or version != 4:
        raise ValueError(f"{path} is not an nbformat 4 notebook (its \"nbformat\" is "
                         f"{version!r}); {fix}")
    try:  # validated as on disk first: nbformat.reads only logs what is wrong, and goes on
        nbformat.validate(nbformat.from_dict(raw))
        notebook = nbformat.reads(data.decode(), as_version=4)  # joins lists of lines
    except Exception as e:  # noqa: BLE001 - jsonschema's errors, and whatever else it raises
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a valid notebook ({reason}); {fix}") from None
    return notebook


def exercise_pairs() -> list[tuple[Path, Path]]:
    return [(path, ROOT / "exercises" / path.name)
            for path in sorted((ROOT / "solutions").glob("*.ipynb"))]


CLASSROOM = ROOT / ".github" / "workflows" / "classroom.yml"
CHECKER = re.compile(r"\.check_(\w+)\(")


def is_check(cell) -> bool:
    return cell.cell_type == "code" and "check" in cell.metadata.get("tags", [])


def check_cells(notebook: nbformat.NotebookNode) -> int:
    return sum(is_check(cell) for cell in notebook.cells)


def exercise_names(notebook: nbformat.NotebookNode) -> dict[int, str]:
    """{index among the code cells (nbval's "Cell N"): exercise name} for every check cell; the
    name is the checker it calls without `check_` (`....check_choose(choose)`: "choose"), or
    "cell N" when it calls none."""
    code = [c for c in notebook.cells if c.cell_type == "code"]
    names: dict[int, str] = {}
    for i, cell in enumerate(code):
        if is_check(cell):
            found = CHECKER.search(cell.source)
            name = found.group(1) if found else f"cell {i}"
            names[i] = name if name not in names.values() else f"{name} (cell {i})"
    return names


def classroom_workflow(solutions: dict[str, nbformat.NotebookNode]) -> str:
    """GitHub Classroom autograding: one test per exercise, worth one point, `python -m minikv
    grade --exercise` on its chapter's exercise notebook; `--cache` runs each notebook once for all
    its exercises."""
    steps, ids = [], []
    for name, solution in solutions.items():
        for exercise in exercise_names(solution).values():
            step_id = f"ch{name[:2]}-{exercise}"
            ids.append(step_id)
            steps.append(f"""\
      - name: {name} / {exercise}
        id: {step_id}
        uses: classroom-resources/autograding-command-grader@v1
        with:
          test-name: {name} / {exercise}
          command: .venv/bin/python -m minikv grade exercises/{name}.ipynb --exercise {exercise} \
--cache ${{{{ runner.temp }}}}/minikv-grade
          timeout: 10
          max-score: 1
""")
    results = "".join(f'          {i.upper()}_RESULTS: "${{{{steps.{i}.outputs.result}}}}"\n'
                      for i in ids)
    return f"""\
# Generated by `python -m minikv exercises` from solutions/ (one point per exercise): do not edit.
# GitHub Classroom: use a copy of this repository as the assignment's template; every push of a
# student's repository grades each exercise by what it computes (`python -m minikv grade`: its check
# cell must run without raising; no saved output is compared) and reports the points. Each chapter's
# notebook runs once, in its first exercise's step; the others, and the grade report at the end
# (the one `make check-exercises` prints), read its results from --cache.
name: classroom
on: [push, repository_dispatch, workflow_dispatch]

permissions:
  checks: write
  actions: read
  contents: read

env:
  PIP_EXTRA_INDEX_URL: https://download.pytorch.org/whl/cpu  # torch's CPU wheel, not CUDA's

jobs:
  autograding:
    runs-on: ubuntu-latest
    if: github.actor != 'github-classroom[bot]'
    timeout-minutes: 60
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      - name: install the course
        run: |
          python -m venv .venv
          .venv/bin/python -m pip install --quiet -r requirements.txt
          .venv/bin/python -m pip install --quiet --no-deps -e .
{"".join(steps)}\
      - name: grade report (every exercise, ✓ / ✗ with the checker's hint / not started)
        if: always()
        run: .venv/bin/python -m minikv grade --cache ${{{{ runner.temp }}}}/minikv-grade || true
      - name: report the points
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
{results}\
        with:
          runners: {",".join(ids)}
"""


HEADING = re.compile(r"^## Exercise (\d+)\s*[·:]\s*(.+)$", re.MULTILINE)


def exercise_list(stem: str, solution: nbformat.NotebookNode) -> str:
    """The chapter's "Exercises" cell, generated from its solutions notebook, so a chapter can
    never describe an exercise it does not have (or leave one out): each exercise's heading and
    the function its check cell grades, in order."""
    titles = [m.group(2).strip() for cell in solution.cells if cell.cell_type == "markdown"
              for m in HEADING.finditer(cell.source)]
    names = list(exercise_names(solution).values())
    if len(titles) != len(names):
        raise ValueError(f"solutions/{stem}.ipynb: {len(titles)} '## Exercise N: title' "
                         f"headings but {len(names)} check cells; give each exercise both")
    items = "\n".join(f"{i}. {title[0].upper() + title[1:]} (`{name}`)"
                      for i, (title, name) in enumerate(zip(titles, names), 1))
    lead = (f"[`exercises/{stem}.ipynb`](../exercises/{stem}.ipynb) has {len(names)} exercises, "
            f"each graded by what your code computes: `make check-exercises CHAPTER={stem[:2]}` "
            f"prints one line per exercise (✓, not started, or ✗ with the checker's hint); "
            f"`solutions/` has them solved:")
    return f"## Exercises\n\n{textwrap.fill(lead, 100)}\n\n{items}"


def chapter_with_exercise_list(chapter: nbformat.NotebookNode, text: str
                               ) -> nbformat.NotebookNode:
    """The chapter with its "Exercises" cell (metadata minikv: "exercises") set to `text`: put
    before the closing map cell when the chapter has none yet."""
    chapter = nbformat.from_dict(chapter)
    cells = [c for c in chapter.cells if c.metadata.get("minikv") == "exercises"]
    if cells:
        cells[0].source = text
    else:
        cell = nbformat.v4.new_markdown_cell(text, metadata={"minikv": "exercises"})
        close = [i for i, c in enumerate(chapter.cells) if c.metadata.get("minikv") == "map-close"]
        chapter.cells.insert(close[0] if close else len(chapter.cells), cell)
    return chapter


PYPROJECT = ROOT / "pyproject.toml"


def repository_url() -> str:
    """The course's public repository: `Repository` under [project.urls] in pyproject.toml, the
    one place to change it (the chapters' install cells and the README's badges follow it)."""
    found = re.search(r'^Repository\s*=\s*"(https://github\.com/[\w.-]+/[\w.-]+)"\s*$',
                      PYPROJECT.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError("pyproject.toml: no [project.urls] Repository = "
                         "\"https://github.com/OWNER/NAME\"")
    return found.group(1)


def install_cell(url: str) -> str:
    """Each chapter's first code cell: without the course (Colab, Binder, a bare Jupyter) it
    installs it, engine, models and tokenizer, from the repository (or from MINIKV_INSTALL: a
    wheel's path, say); with the course installed it does nothing and prints nothing."""
    return ("# On Colab, Binder or any Jupyter without the course, install it first (engine, "
            "models, tokenizer).\n"
            "import importlib.util\nimport os\n\n"
            'if importlib.util.find_spec("minikv") is None:\n'
            f'    default = "minikv[notebooks] @ git+{url}"\n'
            '    source = os.environ.get("MINIKV_INSTALL", default)\n'
            '    %pip install --quiet "$source"\n'
            '    importlib.invalidate_caches()\n'
            '    if importlib.util.find_spec("minikv") is None:  # %pip reports; it never raises\n'
            '        raise RuntimeError(f"could not install the course from {source}: see above")')


def with_install_cell(notebook: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    """The notebook with its install cell (metadata minikv: "install") set to `source`: put
    before its first code cell (after the title, and a chapter's map) when it has none yet."""
    notebook = nbformat.from_dict(notebook)
    cells = [c for c in notebook.cells if c.metadata.get("minikv") == "install"]
    if cells:
        cells[0].source = source
    else:
        first = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")
        cell = nbformat.v4.new_code_cell(source, metadata={"minikv": "install"})
        notebook.cells.insert(first, cell)
    return notebook


def _write_if_changed(path: Path, before: nbformat.NotebookNode, after: nbformat.NotebookNode,
                      check: bool, stale: list[Path]) -> None:
    if after != before:
        stale.append(path)
        if not check:
            write_atomically(path, nbformat.writes(after) + "\n")


def write_exercises(check: bool = False) -> list[Path]:
    """Regenerate exercises/, each chapter's install and "Exercises" cells and the classroom
    workflow; with `check`, only list the files that would change."""
    stale, solutions = [], {}
    install = install_cell(repository_url())
    for solution_path, exercise_path in exercise_pairs():
        before = read_notebook(solution_path)
        solution = with_install_cell(before, install)
        _write_if_changed(solution_path, before, solution, check, stale)
        solutions[solution_path.stem] = solution
        text = nbformat.writes(exercise_from_solution(solution)) + "\n"
        if not exercise_path.exists() or exercise_path.read_text() != text:
            stale.append(exercise_path)
            if not check:
                write_atomically(exercise_path, text)
        chapter_path = ROOT / "notebooks" / solution_path.name
        if chapter_path.exists():
            chapter = read_notebook(chapter_path)
            listed = chapter_with_exercise_list(with_install_cell(chapter, install),
                                                exercise_list(solution_path.stem, solution))
            _write_if_changed(chapter_path, chapter, listed, check, stale)
    workflow = classroom_workflow(solutions)
    if not CLASSROOM.exists() or CLASSROOM.read_text() != workflow:
        stale.append(CLASSROOM)
        if not check:
            write_atomically(CLASSROOM, workflow)
    return stale


def run_notebooks(paths: list[Path], timeout: int = 120) -> None:
    """Execute each notebook top to bottom in a fresh kernel and save it with its outputs. Every
    notebook is read and checked before the first one runs: a broken one is reported, not run."""
    from nbclient import NotebookClient
    notebooks = [(path, read_notebook(path)) for path in paths]
    for path, nb in notebooks:
        for cell in nb.cells:  # no timestamps: a re-run that changes nothing leaves no diff
            cell.metadata.pop("execution", None)
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        write_atomically(path, nbformat.writes(nb) + "\n")
        print(f"executed {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("exercises", help="generate exercises/ from solutions/")
    ex.add_argument("--check", action="store_true",
                    help="only report whether exercises/ is up to date")
    run = commands.add_parser("run", help="execute notebooks in place, saving outputs")
    run.add_argument("paths", nargs="+", type=arguments.notebook)
    args = parser.parse_args(argv)
    if args.command == "run":
        try:
            run_notebooks(args.paths)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if not (ROOT / "solutions").is_dir() or not (ROOT / "pyproject.toml").is_file():
        # installed from a wheel, ROOT is site-packages' parent: nothing there is ours to write
        print(f"error: exercises regenerates exercises/ from solutions/ in the course's "
              f"repository, and {ROOT} is not one: run it in a clone", file=sys.stderr)
        return 2
    stale = write_exercises(check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path.relative_to(ROOT)))
    if args.check and stale:
        print("regenerate with: python -m minikv exercises", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
