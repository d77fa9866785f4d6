"""Grade exercise notebooks by what they compute: one point per exercise.

    python -m minikv grade                                   # every notebook in exercises/
    python -m minikv grade exercises/05_deterministic_requests.ipynb
    python -m minikv grade exercises/05_deterministic_requests.ipynb --exercise choose

Each notebook runs once, top to bottom, in a fresh kernel (its folder the working directory); a
cell that raises does not stop the cells after it. No saved output is compared (numbers differ in
their last bits from one CPU or GPU to another): an exercise passes exactly when its check cell
(tagged "check") runs without raising, since its checker raises on every wrong answer and the stub
raises NotImplementedError. The exercise's name is the checker the check cell calls
(`....check_choose(choose)` is exercise `choose`). One line per exercise, ✓ or ✗ with the
checker's message, then the score; the exit status is 0 only when every exercise graded passes.

--cache DIR keeps each notebook's cell results in DIR, keyed by the notebook's bytes, so that
grading its exercises one at a time (the classroom workflow: one step, one point, per exercise)
runs it once.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .files import read_at_most, write_atomically
from .notebooks import MAX_NOTEBOOK_BYTES, ROOT, exercise_names, read_notebook

CACHE_FORMAT = 2  # bump when the cached cell results change meaning (2: with their sha256)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class Result:
    notebook: Path
    exercise: str
    passed: bool
    message: str  # the check cell's exception, "Type: message"; "" when it passed


def _error_of(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return ANSI.sub("", f"{out.get('ename', 'Error')}: {out.get('evalue', '')}").strip()
    return None


def run_cells(path: Path, timeout: int = 300) -> list[str | None]:
    """Execute the notebook at `path` (not saved) and return, per code cell, None if it ran
    without raising, else its error ("Type: message"); a cell left unrun (the kernel died) gets
    an error saying so."""
    from nbclient import NotebookClient
    nb = read_notebook(path)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            interrupt_on_timeout=True, record_timing=False,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no TCP warning
                            resources={"metadata": {"path": str(path.resolve().parent)}})
    errors: list[str | None] = []
    stopped = ""  # why the kernel stopped answering, once it has
    client.reset_execution_trackers()
    with client.setup_kernel():
        for index, cell in code:
            if stopped:
                errors.append(f"not run: {stopped}")
                continue
            try:
                client.execute_cell(cell, index)
                errors.append(_error_of(cell))
            except Exception as e:  # noqa: BLE001 - the kernel died or stopped answering
                stopped = f"the kernel stopped in an earlier cell ({type(e).__name__})"
                errors.append(f"{type(e).__name__}: {e}".strip())
    return errors


def cell_errors(path: Path, timeout: int = 300, cache: Path | None = None) -> list[str | None]:
    """`run_cells`, or its result for the same notebook bytes from `cache` (written there when
    `cache` is given and had none)."""
    if cache is None:
        return run_cells(path, timeout)
    cells = sum(c.cell_type == "code" for c in read_notebook(path).cells)
    data = read_at_most(path, MAX_NOTEBOOK_BYTES, "notebook", "restore it from git")
    key = hashlib.sha256(f"{CACHE_FORMAT}\n{sys.executable}\n".encode() + data)
    entry = Path(cache) / f"{key.hexdigest()}.json"
    cached = _cached(entry, cells)
    if cached is not None:
        return cached
    errors = run_cells(path, timeout)
    write_atomically(entry, json.dumps({"errors": errors, "sha256": _sha256(errors)}))
    return errors


def _sha256(errors: list[str | None]) -> str:
    return hashlib.sha256(json.dumps(errors).encode()).hexdigest()


def _cached(entry: Path, cells: int) -> list[str | None] | None:
    """The cell results in the cache file `entry`, or None when it is absent or not what
    cell_errors writes (one str or None per code cell, and their sha256): a truncated, flipped or
    edited entry is run again, never trusted (a flipped byte could turn ✗ into ✓) nor a crash."""
    if not entry.exists():
        return None
    try:
        # an entry is one short message per cell: 1 MB per cell is far more than any holds
        doc = json.loads(read_at_most(entry, (cells + 1) << 20, "cache entry", "").decode())
    except (ValueError, RecursionError):
        return None
    errors = doc["errors"] if isinstance(doc, dict) and set(doc) == {"errors", "sha256"} else None
    ok = (isinstance(errors, list) and len(errors) == cells
          and all(e is None or isinstance(e, str) for e in errors)
          and doc.get("sha256") == _sha256(errors))
    return errors if ok else None


def grade(path: Path, exercise: str | None = None, timeout: int = 300,
          cache: Path | None = None) -> list[Result]:
    """Every exercise of the notebook at `path` (or only `exercise`), passed or not."""
    names = exercise_names(read_notebook(path))
    if exercise is not None and exercise not in names.values():
        raise ValueError(f"{path}: no exercise {exercise!r}; its exercises: "
                         f"{', '.join(names.values())}")
    errors = cell_errors(path, timeout, cache)
    return [Result(path, name, errors[i] is None, errors[i] or "")
            for i, name in names.items() if exercise in (None, name)]


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="exercise notebooks to grade (default: every one in exercises/)")
    parser.add_argument("--exercise", metavar="NAME",
                        help="grade only this exercise (its checker's name without check_); "
                             "exit 0 exactly when it passes")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="reuse a notebook's results from DIR (keyed by its bytes), so each "
                             "notebook runs once however many times it is graded")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "exercises").glob("*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:  # every notebook checked before any runs: a broken one is a message, not a traceback
        notebooks = {p: read_notebook(p) for p in paths}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.exercise is not None:
        paths = [p for p in paths if args.exercise in exercise_names(notebooks[p]).values()]
        if not paths:
            print(f"error: no exercise {args.exercise!r} in the notebooks given", file=sys.stderr)
            return 2
    results: list[Result] = []
    for path in paths:
        if len(paths) > 1:
            print(f"{_shown(path)}")
        for result in grade(path, args.exercise, args.timeout, args.cache):
            results.append(result)
            if result.passed:
                print(f"  ✓ {result.exercise}")
            else:
                first, *rest = result.message.splitlines() or [""]
                print(f"  ✗ {result.exercise}: {first}")
                for line in rest:
                    print(f"    {line}")
    passed = sum(r.passed for r in results)
    print(f"score: {passed} / {len(results)}")
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
