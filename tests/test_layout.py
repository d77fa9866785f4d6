"""The layout is the architecture: the engine is one folder that imports nothing from the course
tooling around it, small enough to read in an afternoon. (ruff runs in `make test`.)"""
import ast
from pathlib import Path

import minikv

PACKAGE = Path(minikv.__file__).parent
ENGINE = PACKAGE / "engine"
TOOLING = ("viz", "course", "bench")
# What the engine may weigh, line by line, docstrings included: each feature added after the
# layout issue brings its own allowance, so growth is a decision, not a drift.
ENGINE_LINE_BUDGET = sum({
    "the engine as the layout issue left it (13)": 1300,
    "prompt-lookup decoding: a proposer without a model (16)": 85,
    "static batching of ragged prompts with left padding (18)": 110,
    "a paged KV cache and a continuous-batching server with preemption (18)": 320,
    "attention read through block tables, packed prefill, freed blocks kept for reuse (18)": 100,
    "grouped-query attention: n_kv_head K/V heads in the model and every cache (19)": 40,
    "a quantized KV cache, int8 and int4 with per-token scales (19)": 110,
    "a sink-and-window cache that evicts, with absolute positions (19)": 125,
    "window_attention: the same window as one masked pass, to measure many texts (19)": 19,
    "why the target has 12 layers; admission holds a preempted request's recompute (14)": 5,
    "serve(max_running=), vLLM's max_num_seqs; alpha is None when nothing was judged (29)": 8,
}.values())


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute name) of everything `source`, a module of `package`, imports; relative
    imports resolved (`from ..viz import draw` in minikv.engine is minikv.viz.draw)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_engine_imports_nothing_from_the_tooling():
    offending = [f"{path.name}:{line} imports {name}"
                 for path in sorted(ENGINE.glob("*.py"))
                 for line, name in imported_modules(path.read_text(), "minikv.engine")
                 if name.startswith(tuple(f"minikv.{room}" for room in TOOLING))
                 or name in ("minikv", "minikv.load_course_model", "minikv.load_tokenizer")]
    assert not offending, ("the engine must not depend on the course tooling:\n"
                           + "\n".join(offending))


def test_the_boundary_check_sees_every_import_form():
    """The check above would pass vacuously if it missed a form of import."""
    source = ("from ..viz import draw\nfrom ..course.corpus import EOT\nimport minikv.bench\n"
              "from . import cache\nfrom .cache import KVCache\n")
    assert [name for _, name in imported_modules(source, "minikv.engine")] == [
        "minikv.viz.draw", "minikv.course.corpus.EOT", "minikv.bench", "minikv.engine.cache",
        "minikv.engine.cache.KVCache"]


def test_engine_fits_its_line_budget():
    lines = sum(len(p.read_text().splitlines()) for p in ENGINE.glob("*.py"))
    assert lines <= ENGINE_LINE_BUDGET, f"minikv/engine/ has {lines} lines"


def test_no_line_over_100_characters_in_the_package():
    long = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f"{len(long)} lines over 100 characters: {long[:10]}"
