"""Grade exercise notebooks by what they compute: one point per exercise.

    python -m minikv grade                                   # every notebook in exercises/
    python -m minikv grade exercises/05_deterministic_requests.ipynb
    python -m minikv grade exercises/05_deterministic_requests.ipynb --exercise choose
    python -m minikv grade --chapter 02 --verbose   # = make check-exercises CHAPTER=02 VERBOSE=1

Each notebook runs once, top to bottom, in a fresh kernel (its folder the working directory); a
cell that raises does not stop the cells after it. No saved output is compared (numbers differ in
their last bits from one CPU or GPU to another): an exercise passes exactly when its check cell
(tagged "check") runs without raising, since its checker raises on every wrong answer and the stub
raises NotImplementedError. The exercise's name is the checker the check cell calls
(`....check_choose(choose)` is exercise `choose`). The report is one line per exercise: its
chapter and number, its name, then ✓, "not started" (its stub still raises) or ✗ with what the
checker said (the input, expected and got, and the hint that names the mistake); a cell outside the
exercises that raised gets a line too; then the total. --verbose adds each failing cell's
traceback. The exit status is 0 only when every exercise graded passes (or was skipped) and no
other cell raised. A check cell that cannot grade on this machine (chapter 09's Triton kernel where
Triton does not install) prints a line starting "⊘" and raises nothing: its exercise is "skipped",
worth no point and failing nothing.

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

from . import arguments
from .files import claim_directory, mark_directory, read_at_most, write_atomically
from .notebooks import MAX_NOTEBOOK_BYTES, ROOT, STUB_MESSAGE, exercise_names, read_notebook

CACHE_FORMAT = 3  # bump when the cached cell results change meaning (2: with their sha256, 3:
#                  skipped check cells)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NOT_STARTED = f"NotImplementedError: {STUB_MESSAGE}"  # what a stub raises
SKIPPED = "Skipped: "  # a check cell that printed "⊘ ...": its exercise cannot be graded here
DETAIL = re.compile(r"^\s*(expected|got|hint):\s*(.*)$")


@dataclass(frozen=True)
class Result:
    notebook: Path
    exercise: str  # the checker's name; "cell N" for a cell outside the exercises that raised
    passed: bool
    message: str  # the check cell's exception, "Type: message"; "" when it passed
    number: int = 0  # the exercise's number in its chapter (1, 2, ...); 0 outside the exercises
    traceback: str = ""  # the failing cell's traceback, kept only when asked for (--verbose)

    @property
    def status(self) -> str:
        if self.passed:
            return "✓"
        if self.message.startswith(SKIPPED):
            return "skipped"
        return "not started" if self.message == NOT_STARTED else "✗"

    def line(self) -> str:
        """One line of the report: `02·3 cached_attention  ✗ <what the checker said>`."""
        where = self.notebook.name[:2] + (f"·{self.number}" if self.number else "")
        head = f"  {where:<5} {self.exercise:<26} {self.status}"
        if self.status == "skipped":  # the check's "⊘ name: skipped, not graded: why" → why
            why = self.message.removeprefix(SKIPPED).removeprefix(f"{self.exercise}: ")
            return f"{head} ({why.removeprefix('skipped, not graded: ')})"
        return head if self.status != "✗" else f"{head} {summary(self.message, self.exercise)}"


def _short(value: str, width: int = 40) -> str:
    return value if len(value) <= width else value[:width - 1] + "…"


def summary(message: str, exercise: str) -> str:
    """A checker's message on one line: which input, expected and got (each cut to 40
    characters), and the hint; any other error as its first line."""
    first, *rest = message.splitlines() or [""]
    first = first.removeprefix("CheckFailed: ").removeprefix(f"{exercise}: ")
    found = {m.group(1): m.group(2).strip() for m in map(DETAIL.match, rest) if m}
    if "expected" in found and "got" in found:
        first += f": expected {_short(found['expected'])}, got {_short(found['got'])}"
    return first + (f" · hint: {found['hint']}" if "hint" in found else "")


def _error_of(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return ANSI.sub("", f"{out.get('ename', 'Error')}: {out.get('evalue', '')}").strip()
    return None


def _skipped_of(cell) -> str | None:
    """SKIPPED + why, for a cell that printed a line starting "⊘ " (a check that cannot run
    here, and says so), else None."""
    for out in cell.get("outputs", []):
        for line in out.get("text", "").splitlines() if out.get("output_type") == "stream" else ():
            if line.startswith("⊘ "):
                return SKIPPED + line.removeprefix("⊘ ").strip()
    return None


def _traceback_of(cell) -> str:
    return "\n".join(line for out in cell.get("outputs", []) if out.get("output_type") == "error"
                     for line in out.get("traceback", []))


def run_cells(path: Path, timeout: int = 300,
              tracebacks: dict[int, str] | None = None) -> list[str | None]:
    """Execute the notebook at `path` (not saved) and return, per code cell, None if it ran
    without raising, else its error ("Type: message"); a cell left unrun (the kernel died) gets
    an error saying so. `tracebacks`, when given, receives each failing cell's traceback by its
    index among the code cells."""
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
                errors.append(_error_of(cell) or _skipped_of(cell))
                if tracebacks is not None and errors[-1] is not None:
                    tracebacks[len(errors) - 1] = _traceback_of(cell)
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
          cache: Path | None = None, verbose: bool = False) -> list[Result]:
    """Every exercise of the notebook at `path` (or only `exercise`), passed or not; when
    grading them all, also every other cell that raised (a stub raises only in its check cell, so
    such a cell is a real error). `verbose` runs the notebook afresh to keep tracebacks."""
    names = exercise_names(read_notebook(path))
    if exercise is not None and exercise not in names.values():
        raise ValueError(f"{path}: no exercise {exercise!r}; its exercises: "
                         f"{', '.join(names.values())}")
    tracebacks: dict[int, str] = {}
    errors = run_cells(path, timeout, tracebacks) if verbose else cell_errors(path, timeout, cache)
    results = [Result(path, name, errors[i] is None, errors[i] or "", number, tracebacks.get(i, ""))
               for number, (i, name) in enumerate(names.items(), 1) if exercise in (None, name)]
    if exercise is None:
        results += [Result(path, f"cell {i}", False, error, 0, tracebacks.get(i, ""))
                    for i, error in enumerate(errors) if error is not None and i not in names
                    and not error.startswith(SKIPPED)]
    return results


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m minikv grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=arguments.notebook,
                        help="exercise notebooks to grade (default: every one in exercises/)")
    parser.add_argument("--chapter", metavar="NN",
                        help="grade exercises/NN_*.ipynb (make check-exercises CHAPTER=NN)")
    parser.add_argument("--exercise", metavar="NAME",
                        help="grade only this exercise (its checker's name without check_); "
                             "exit 0 exactly when it passes")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="reuse a notebook's results from DIR (keyed by its bytes), so each "
                             "notebook runs once however many times it is graded")
    parser.add_argument("--verbose", action="store_true",
                        help="print each failing cell's traceback too (runs without --cache)")
    parser.add_argument("--timeout", type=arguments.integer(1, 86_400), default=300,
                        help="seconds per cell (default 300)")
    return parser.parse_args(argv)


def _paths(args: argparse.Namespace) -> list[Path]:
    """The notebooks to grade; ValueError naming what is wrong with the arguments."""
    exercises = sorted((ROOT / "exercises").glob("*.ipynb"))
    if args.chapter is not None:
        if args.notebooks:
            raise ValueError("give notebooks or --chapter, not both")
        chosen = [p for p in exercises if p.name[:2] == args.chapter]
        if not chosen:
            raise ValueError(f"no chapter {args.chapter!r} in exercises/; chapters: "
                             f"{' '.join(p.name[:2] for p in exercises)}")
        return chosen
    paths = args.notebooks or exercises
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no such notebook: {', '.join(missing)}")
    return paths


def _print_tracebacks(results: list[Result]) -> None:
    for result in results:
        if not result.passed and result.traceback:
            print(f"── {_shown(result.notebook)}: {result.exercise} ──")
            print(result.traceback)


def _total(results: list[Result]) -> str:
    graded = [r for r in results if r.number or r.passed]
    counts = {s: sum(r.status == s for r in graded) for s in ("✓", "✗", "not started", "skipped")}
    other = len(results) - len(graded)
    return (f"total: {counts['✓']} / {len(graded) - counts['skipped']} exercises passed · "
            f"{counts['✗']} wrong · {counts['not started']} not started"
            + (f" · {counts['skipped']} skipped (cannot be graded here)" if counts["skipped"]
               else "")
            + (f" · {other} other cell{'s' * (other != 1)} raised" if other else ""))


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:  # every notebook checked before any runs: a broken one is a message, not a traceback
        paths = _paths(args)
        notebooks = {p: read_notebook(p) for p in paths}
        if args.cache is not None:  # new, empty, or a grade cache: not a folder of other files
            claim_directory(args.cache, "grade --cache", own=r"[0-9a-f]{64}\.json")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.exercise is not None:
        paths = [p for p in paths if args.exercise in exercise_names(notebooks[p]).values()]
        if not paths:
            print(f"error: no exercise {args.exercise!r} in the notebooks given", file=sys.stderr)
            return 2
    if args.cache is not None:
        mark_directory(args.cache, "grade --cache")
    results: list[Result] = []
    for path in paths:
        print(f"running {_shown(path)}", flush=True)  # a chapter takes seconds to a minute
        results += grade(path, args.exercise, args.timeout, args.cache, args.verbose)
        if args.verbose:
            _print_tracebacks([r for r in results if r.notebook == path])
    print("\n".join(["", "grade report", *(r.line() for r in results), _total(results)]))
    return 0 if results and all(r.passed or r.status == "skipped" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
