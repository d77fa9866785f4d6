"""How many wrong solutions do the checkers catch? Mutation testing of the check cells.

    python -m minikv mutants                 # every solutions notebook, or: mutants 02 05
    python -m minikv mutants --json PATH     # the numbers, for a record

Each solutions notebook runs in-process, its code cells in order in one namespace, output kept
quiet. At each check cell, the solution regions (BEGIN/END SOLUTION) of the cells since the last
check cell are mutated one slip at a time (an operator, a comparison, an off-by-one, a negated
condition, a missing statement, swapped arguments); each mutant's cell runs again in a copy of the
namespace, then the check cell. A mutant is killed when the checker raises or runs past the time
limit, and survives when it prints its ✓. Survivors are printed as diffs, so a person can tell an
equivalent mutant (it computes the same thing) from a gap in the checker.

The score is the usual one: killed / (mutants - equivalent). A survivor judged equivalent is
written down, with why, in equivalent_mutants.toml beside this file (keyed by exercise, function
and diff, not by line, so an edited solution's mutants are judged again); every other survivor
counts against the checker and is printed as a gap to close.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import arguments
from .files import write_atomically
from .notebooks import BEGIN, END, ROOT, is_check, read_notebook

EQUIVALENT = Path(__file__).with_name("equivalent_mutants.toml")


def equivalent() -> dict[tuple[str, str], str]:
    """(exercise, "function: diff") -> why it computes what the solution computes."""
    import tomllib
    with EQUIVALENT.open("rb") as f:
        table = tomllib.load(f)
    return {(row["exercise"], row["mutant"]): row["why"] for row in table.get("mutant", [])}

# the slips: an operator for its neighbour (both ways), a comparison with or without its edge
OPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.FloorDiv: [ast.Div],
       ast.Div: [ast.Mult, ast.FloorDiv], ast.And: [ast.Or], ast.Or: [ast.And]}
COMPARES = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
            ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


# calls whose two arguments can be swapped without changing anything: such a mutant is noise
SYMMETRIC = {"min", "max", "transpose", "swapaxes"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@dataclass
class Mutant:
    line: int      # in the cell
    function: str  # the innermost def around it
    diff: str      # "original line → mutated line", for a person to judge a survivor
    source: str    # the whole cell, mutated (ast.unparse: comments gone, exec ignores them)


def regions(source: str) -> list[range]:
    """The line numbers (1-based, as in ast) strictly inside each solution region."""
    marks = [(n, line.strip()) for n, line in enumerate(source.splitlines(), 1)
             if line.strip() in (BEGIN, END)]  # they alternate: notebooks.py refuses otherwise
    return [range(a + 1, b) for (a, _), (b, _) in zip(marks[::2], marks[1::2])]


def _sites(tree: ast.AST, lines: list[range]):
    """(index of the node in ast.walk order, variant) for every mutation inside `lines`: the node
    is found again by its index in a fresh parse, so each mutant starts from the original."""
    def inside(node):
        return any(getattr(node, "lineno", 0) in r for r in lines)
    for i, node in enumerate(ast.walk(tree)):
        # drop one statement of a longer body; not a `return`: returning None is a stub,
        # caught by every checker, so it would only pad the score
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and len(body) > 1:
                yield from ((i, ("drop", field, k)) for k, s in enumerate(body)
                            if inside(s) and not isinstance(s, ast.Return))
        if not inside(node):
            continue
        if isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)):
            yield from ((i, ("op", new)) for new in OPS.get(type(node.op), []))
        elif isinstance(node, ast.Compare):
            yield from ((i, ("cmp", k)) for k, op in enumerate(node.ops) if type(op) in COMPARES)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            yield from ((i, ("const", d)) for d in (1, -1))
        elif isinstance(node, (ast.If, ast.IfExp)):
            yield i, ("not",)
        elif isinstance(node, ast.Call) and len(node.args) == 2 and _name(node.func) not in \
                SYMMETRIC and not any(isinstance(a, ast.Starred) for a in node.args):
            yield i, ("swap",)
        elif isinstance(node, ast.Slice):  # a constant bound is the constants' mutant already
            bounds = [b for b in ("lower", "upper") if getattr(node, b) is not None and any(
                isinstance(n, ast.Name) for n in ast.walk(getattr(node, b)))]
            yield from ((i, ("slice", bound, d)) for bound in bounds for d in (1, -1))


def _apply(node: ast.AST, variant: tuple):
    """Mutate `node` in place; return (the node whose text changed as it was, as it is now)."""
    kind, *args = variant
    if kind == "drop":
        field, k = args
        return getattr(node, field).pop(k), None
    before = copy.deepcopy(node)  # keeps the original's position, for the diff
    if kind == "op":
        node.op = args[0]()
    elif kind == "cmp":
        node.ops[args[0]] = COMPARES[type(node.ops[args[0]])]()
    elif kind == "const":
        node.value += args[0]
    elif kind == "not":
        before, node.test = node.test, ast.UnaryOp(ast.Not(), node.test)
        return before, node.test
    elif kind == "swap":
        node.args.reverse()
    elif kind == "slice":
        bound, d = args
        before = getattr(node, bound)
        setattr(node, bound, ast.BinOp(before, ast.Add() if d > 0 else ast.Sub(), ast.Constant(1)))
        return before, getattr(node, bound)
    return before, node


def _diff(source_lines: list[str], before: ast.AST, after: ast.AST | None) -> str:
    """One line: the original line → the line with the mutated text in place of the original."""
    line = source_lines[before.lineno - 1]
    if after is None:
        return f"{line.strip()}  → (dropped)"
    if before.end_lineno == before.lineno:  # splice the new text into the line as written
        new = line[:before.col_offset] + ast.unparse(after) + line[before.end_col_offset:]
        return f"{line.strip()}  → {new.strip()}"
    return f"{ast.unparse(before)}  → {ast.unparse(after)}"


def mutants(source: str, cap: int | None = None) -> list[Mutant]:
    """The distinct mutants of the solution regions in `source` (a mutant that unparses to the
    original, or to another mutant, is left out), in line order; at most `cap`, evenly spread."""
    lines, original = source.splitlines(), ast.unparse(ast.parse(source))
    defs = sorted((d.lineno, d.end_lineno, d.name) for d in ast.walk(ast.parse(source))
                  if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)))
    found, seen = [], {original}
    for index, variant in _sites(ast.parse(source), regions(source)):
        tree = ast.parse(source)
        before, after = _apply(list(ast.walk(tree))[index], variant)
        mutated = ast.unparse(tree)
        if mutated not in seen:
            seen.add(mutated)
            name = [n for a, b, n in defs if a <= before.lineno <= b][-1:] or ["?"]
            found.append(Mutant(before.lineno, name[0], _diff(lines, before, after), mutated))
    found.sort(key=lambda m: m.line)
    if cap is not None and len(found) > cap:  # deterministic: the same picks on every run
        found = [found[k * len(found) // cap] for k in range(cap)]
    return found


class TimeLimit(BaseException):
    """Not an Exception, so a checker's `except Exception` cannot swallow it."""


def _stop(signum, frame):
    raise TimeLimit()


def run_cell(source: str, namespace: dict, seconds: float = 600) -> tuple[str, str]:
    """("passed" | "raised" | "timeout", what it printed) for `source` run in `namespace`."""
    out, previous = io.StringIO(), signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(source, "<cell>", "exec"), namespace)
    except TimeLimit:
        return "timeout", out.getvalue()
    except BaseException as e:  # noqa: BLE001 - any failure of the cell, SystemExit included
        return "raised", out.getvalue() + f"\n{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return "passed", out.getvalue()


def verdict(solution: str, check: str, namespace: dict, seconds: float) -> str:
    """"survived" when the check cell prints its ✓ after `solution` runs in a copy of
    `namespace`; else "killed" (it raised, or said nothing) or "timeout". Random state is put back
    afterwards, so one mutant cannot change what the next one draws."""
    rng = torch.get_rng_state(), random.getstate()
    try:
        ns = dict(namespace)
        status, _ = run_cell(solution, ns, seconds)
        if status == "passed":
            status, printed = run_cell(check, ns, seconds)
            if status == "passed":
                return "survived" if "✓" in printed else "killed"
        return "timeout" if status == "timeout" else "killed"
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])


def run_notebook(path: Path, cap: int, seconds: float, log=print) -> list[dict]:
    """Run the notebook at `path`; at each check cell, grade its exercise's mutants."""
    nb, judged = read_notebook(path), equivalent()
    namespace: dict = {"__name__": "__main__"}
    results, pending = [], []  # pending: the solution cells since the last check cell
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        started = time.perf_counter()
        status, printed = run_cell(cell.source, namespace)
        if not is_check(cell):
            pending += [cell.source] if BEGIN in cell.source else []
            continue
        name = cell.source.split(".check_", 1)[-1].split("(", 1)[0]  # check_x(...) is x
        cells, pending = pending, []
        row = {"notebook": path.name, "exercise": name, "mutants": 0, "killed": 0, "timeouts": 0,
               "equivalent": 0, "survived": 0, "survivors": [], "note": "",
               "check_seconds": round(time.perf_counter() - started, 2)}
        if status != "passed":
            row["note"] = f"the solution fails its own check: {printed.strip()[-200:]}"
        else:
            # an endless loop costs the whole limit: a fast check gets less than a slow one
            limit = min(seconds, max(5.0, 10 * row["check_seconds"]))
            for source in cells:
                for m in mutants(source, cap // len(cells)):
                    v = verdict(m.source, cell.source, namespace, limit)
                    row["mutants"] += 1
                    row["killed"] += v != "survived"
                    row["timeouts"] += v == "timeout"
                    if v == "survived" and (name, f"{m.function}: {m.diff}") in judged:
                        row["equivalent"] += 1
                    elif v == "survived":
                        row["survived"] += 1
                        row["survivors"].append(f"{m.function} L{m.line}: {m.diff}")
            if verdict("\n\n".join(cells), cell.source, namespace, 600) != "survived":
                row["note"] = "the solution failed its check after the mutants ran (state changed)"
        results.append(row)
        log(_report(row))
    return results


def score(killed: int, mutants: int, equivalent: int) -> float:
    """Killed among the mutants that compute something else than the solution."""
    return killed / max(mutants - equivalent, 1)


def _report(row: dict) -> str:
    row_score = score(row["killed"], row["mutants"], row["equivalent"])
    return "\n".join([f"  {row['exercise']:<28} mutants {row['mutants']:>3}  killed "
                      f"{row['killed']:>3} (timeouts {row['timeouts']})  equivalent "
                      f"{row['equivalent']:>2}  survived {row['survived']:>3}  score "
                      f"{row_score:6.1%}"]
                     + [f"      survived {s}" for s in row["survivors"]]
                     + [f"      note: {row['note']}"] * bool(row["note"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", help="chapter numbers, e.g. 02 05 (default: all)")
    parser.add_argument("--cap", type=arguments.positive, default=40,
                        help="mutants per exercise (default 40)")
    parser.add_argument("--timeout", type=arguments.number(0, 86_400, above=True), default=20,
                        help="seconds per mutant; past it the mutant counts as killed (default 20)")
    parser.add_argument("--json", type=arguments.output_file, metavar="PATH",
                        help="write the numbers here")
    args = parser.parse_args(argv)
    paths = [p for p in sorted((ROOT / "solutions").glob("*.ipynb"))
             if not args.chapters or p.name[:2] in args.chapters]
    if not paths:
        print(f"error: no solutions notebook for {' '.join(args.chapters)}", file=sys.stderr)
        return 2
    start, rows, cwd = time.perf_counter(), [], os.getcwd()
    for path in paths:
        print(path.name, flush=True)
        os.chdir(path.parent)  # a notebook runs in its own folder, as under Jupyter
        try:
            rows += run_notebook(path, args.cap, args.timeout,
                                 log=lambda text: print(text, flush=True))
        finally:
            os.chdir(cwd)
    def totals(chosen) -> tuple[int, int, int]:
        return tuple(sum(r[k] for r in chosen) for k in ("killed", "mutants", "equivalent"))
    for chapter in dict.fromkeys(r["notebook"][:2] for r in rows):
        killed, n, same = totals([r for r in rows if r["notebook"][:2] == chapter])
        print(f"chapter {chapter}: {killed} / {n - same} killed ({same} equivalent of {n}), "
              f"score {score(killed, n, same):.1%}")
    (killed, n, same), seconds = totals(rows), time.perf_counter() - start
    print(f"total: {killed} / {n - same} killed ({same} equivalent of {n}), score "
          f"{score(killed, n, same):.1%} ({seconds:.0f} s)")
    if args.json:
        write_atomically(args.json, json.dumps({"score": score(killed, n, same), "killed": killed,
                                         "mutants": n, "equivalent": same,
                                         "seconds": round(seconds), "exercises": rows},
                                        indent=1, ensure_ascii=False))
    return 0
