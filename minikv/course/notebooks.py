"""Course tooling: exercises are generated from solutions, never edited by hand.

    python -m minikv exercises           # rewrite exercises/ from solutions/
    python -m minikv exercises --check   # exit 1 if exercises/ is out of date
    python -m minikv run notebooks/01_prefill_decode.ipynb ...   # execute, save with outputs

A solution region is the code between `### BEGIN SOLUTION` and `### END SOLUTION` (nbgrader's
markers), always inside a function body, so the stub only raises when the check cell calls it.
Outputs are kept: nbval then compares a student's check cells with the solution's, and passes
exactly when they match.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

from .files import write_atomically

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = "raise NotImplementedError(\"your turn: replace this line with your code\")"


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
    """Solution regions become stubs, and check cells lose their outputs: an exercise notebook
    must not show "✓ all cases pass" before the student has written a line."""
    exercise = nbformat.from_dict(solution)
    for cell in exercise.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
        if cell.cell_type == "code" and "check" in cell.metadata.get("tags", []):
            cell.outputs, cell.execution_count = [], None
    return exercise


def exercise_pairs() -> list[tuple[Path, Path]]:
    return [(path, ROOT / "exercises" / path.name)
            for path in sorted((ROOT / "solutions").glob("*.ipynb"))]


def write_exercises(check: bool = False) -> list[Path]:
    """Regenerate exercises/; with `check`, only list the files that would change."""
    stale = []
    for solution_path, exercise_path in exercise_pairs():
        solution = nbformat.read(solution_path, as_version=4)
        text = nbformat.writes(exercise_from_solution(solution)) + "\n"
        if not exercise_path.exists() or exercise_path.read_text() != text:
            stale.append(exercise_path)
            if not check:
                write_atomically(exercise_path, text)
    return stale


def run_notebooks(paths: list[Path], timeout: int = 120) -> None:
    """Execute each notebook top to bottom in a fresh kernel and save it with its outputs."""
    from nbclient import NotebookClient
    for path in paths:
        nb = nbformat.read(path, as_version=4)
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
    run.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run_notebooks(args.paths)
        return 0
    stale = write_exercises(check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path.relative_to(ROOT)))
    if args.check and stale:
        print("regenerate with: python -m minikv exercises", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
