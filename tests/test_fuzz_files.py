"""Every file the package reads, under a fuzzer: a checkpoint directory (config.json,
model.safetensors, training.json) written by save_checkpoint, the tokenizer's ranks, a notebook
for `python -m minikv run`/`grade`, and grade's cache entries. Each is truncated, bit-flipped,
overwritten, given wrong JSON types, huge numbers, deep nesting, added or missing keys, oversized
safetensors header claims, grown past any sane size (a sparse file: no disk used), replaced by a
directory or removed. Property: the read either returns exactly the original content or raises a
clear error (ValueError/TypeError/OSError saying what to do, never a bare KeyError, RecursionError,
JSONDecodeError, UnicodeDecodeError or torch RuntimeError), within a fixed memory budget that the
mutated file's size cannot raise, and nothing in the directory is written (grade's cache is the
one file rewritten: a damaged entry is ignored, the notebook run again, the entry written whole).

What is drawn (see `byte_mutation`, `json_mutation`, `header_mutation`):
  bytes   truncate at an offset, flip 1-4 bits, overwrite or insert bytes at an offset, empty the
          file, grow it (sparse) past the reader's size limit, a directory in its place, removed
  JSON    at any path of the document: a string, float (NaN and infinities included), bool, null,
          list, object, an int up to 2**70 either sign, a 5000-digit int, 100 000 nested lists;
          a key removed or one added
  header  model.safetensors' 8-byte header length; a tensor's shape (0, -1, 2**31, 2**40, 2**63,
          not a list), dtype, data_offsets; a tensor renamed or dropped; __metadata__ entries
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import re
import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import nbformat
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv import __main__ as cli
from minikv.course import grade, tokenizer
from minikv.course.checkpoint import (
    CONFIG_FILE,
    MAX_JSON_BYTES,
    METADATA_FILE,
    WEIGHTS_FILE,
    load_checkpoint,
    save_checkpoint,
)
from minikv.course.notebooks import MAX_NOTEBOOK_BYTES, exercise_names, read_notebook
from minikv.engine.config import LLAMA

pytestmark = pytest.mark.filterwarnings(  # a cell without an id: nbformat adds one, and warns
    "ignore::nbformat.warnings.MissingIDFieldWarning")
FUZZ = settings(derandomize=True, deadline=None, max_examples=100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# errors that are a crash, not a message: they are ValueErrors too, but say nothing to a user
UNCLEAR = (json.JSONDecodeError, UnicodeDecodeError)
# Python's allocations, and every page the process touches, while one file is read: a fixed
# amount plus a few times the size of the file the package wrote (never the mutated size)
SLACK = 4 << 20
RSS_SLACK = 48 << 20


# --- the harness --------------------------------------------------------------------------------

def _peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS mark (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def measured(call):
    """(result, error, Python peak bytes, peak RSS growth in bytes or None) of `call()`."""
    watch_rss = _peak_rss_reset()
    rss_before = _status_kb("VmRSS") if watch_rss else 0
    tracemalloc.start()
    try:
        result, error = call(), None
    except Exception as e:  # noqa: BLE001 - judged by the caller
        result, error = None, e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    rss = _status_kb("VmHWM") - rss_before if watch_rss else None
    return result, error, peak, rss


def assert_clear(error: BaseException, says: str) -> None:
    """A clear error: an error type a caller can catch for bad input, and a message that says
    what to do (`says`, a regex)."""
    assert isinstance(error, (ValueError, TypeError, OSError)), \
        f"{type(error).__name__}: {error}"
    assert not isinstance(error, UNCLEAR), f"{type(error).__name__}: {error}"
    assert re.search(says, str(error)), f"the message does not say what to do: {error}"


def assert_within(peak: int, rss: int | None, size: int) -> None:
    assert peak < SLACK + 4 * size, f"Python allocated {peak:,} bytes for a {size:,}-byte file"
    if rss is not None:
        assert rss < RSS_SLACK + 4 * size, f"resident memory grew {rss:,} bytes"


def fingerprint(root: Path) -> dict:
    """Every entry under `root`: kind, size, mtime and the sha256 of its first 4 MiB (a sparse
    file is gigabytes of nothing; a rewrite changes the mtime)."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = None
        if path.is_file():
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read(4 << 20)).hexdigest()
        out[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
    return out


@contextlib.contextmanager
def scratch(base: Path):
    """A fresh directory for one example, removed after it."""
    path = Path(tempfile.mkdtemp(dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- what is drawn ------------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_DIGITS = "9" * 5000  # past Python's int-from-string limit (4300 digits)
RAW = "\x00raw:"  # a JSON string holding this becomes the raw text after it (no quotes)

json_values = st.one_of(
    st.text(max_size=12), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.none(), st.integers(-(2 ** 70), 2 ** 70), st.just(-1), st.just(0),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.none(),
                                                               max_size=2),
    st.just(RAW + HUGE_DIGITS), st.just(RAW + "-" + HUGE_DIGITS), st.just(RAW + DEEP))


def json_paths(value, prefix=()):
    """Every path (keys and indices) into a JSON document, the document itself first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, prefix + (i,))


def dumps(doc) -> bytes:
    text = json.dumps(doc, indent=1)  # NaN and Infinity included, as Python's json writes them
    return re.sub(r'"\\u0000raw:([^"]*)"', lambda m: m.group(1), text).encode()


@st.composite
def json_mutation(draw, original: bytes):
    """A JSON file with one value replaced by a drawn one, or a key removed or added."""
    doc = json.loads(original)
    path = draw(st.sampled_from(list(json_paths(doc))))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    value = draw(json_values)
    if not path:
        doc = value
    elif action == "replace":
        parent[path[-1]] = value
    elif action == "remove":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = value
    else:
        parent.insert(path[-1], value)
    return dumps(doc)


@st.composite
def byte_mutation(draw, original: bytes, limit: int):
    """(how, new bytes or a marker): "dir", "remove" and ("grow", size) are applied by
    `write_mutated`; every other one is the file's new content."""
    n = len(original)
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "empty", "grow",
                                 "dir", "remove"]))
    if kind == "truncate":
        return kind, original[:draw(st.integers(0, n - 1))]
    if kind == "flip":
        data = bytearray(original)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, n - 1))] ^= 1 << draw(st.integers(0, 7))
        return kind, bytes(data)
    if kind in ("overwrite", "insert"):
        at, junk = draw(st.integers(0, n - 1)), draw(st.binary(min_size=1, max_size=16))
        return kind, original[:at] + junk + original[at + (len(junk) if kind == "overwrite"
                                                           else 0):]
    if kind == "empty":
        return kind, b""
    if kind == "grow":
        return kind, limit + draw(st.sampled_from([1, 4096, 8 << 20, 1 << 40]))
    return kind, None


def write_mutated(path: Path, mutation) -> None:
    kind, data = mutation
    if kind == "dir":
        path.unlink()
        path.mkdir()
    elif kind == "remove":
        path.unlink()
    elif kind == "grow":  # the original bytes, then zeros up to the claimed size: a sparse file
        with open(path, "r+b") as f:
            f.truncate(data)
    else:
        path.write_bytes(data)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Where each example makes its scratch directory."""
    return tmp_path_factory.mktemp("scratch")


# --- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint as save_checkpoint writes it (a model of a few KB, so each example is
    cheap), its files' bytes and its state dict."""
    torch.manual_seed(0)
    config = minikv.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = minikv.GPT(config).eval()
    base = tmp_path_factory.mktemp("fuzz")
    directory = save_checkpoint(model, base / "ckpt",
                                {"preset": "fuzz", "steps": 3, "losses": [4.1, 3.2, 2.5],
                                 "train": {"lr": 0.001, "bf16": False}})
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    load_checkpoint(directory, "cpu")  # first load: lazy imports happen outside the budget
    return Saved((base, files, model.state_dict()))


class Saved(tuple):
    def __repr__(self):  # Hypothesis prints the fixture with each failure: not every weight
        return f"Saved({self[0]})"


def check_load(base: Path, files: dict, state: dict, name: str, mutation) -> None:
    """Load a copy of the checkpoint with `name` mutated: the original content or a clear
    error, within budget, nothing written."""
    with scratch(base) as root:
        directory = root / "ckpt"
        directory.mkdir()
        for file, data in files.items():
            (directory / file).write_bytes(data)
        write_mutated(directory / name, mutation)
        before = fingerprint(root)
        model, error, peak, rss = measured(lambda: load_checkpoint(directory, "cpu"))
        assert fingerprint(root) == before, "loading wrote to the checkpoint's directory"
    if error is None:
        loaded = model.state_dict()
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], state[k]) for k in state), "loaded other weights"
    else:
        assert_clear(error, "save it again|retrain")
    assert_within(peak, rss, sum(map(len, files.values())))


@FUZZ
@given(data=st.data())
def test_a_damaged_checkpoint_file_is_refused_clearly(saved, data):
    base, files, state = saved
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    limit = MAX_JSON_BYTES if name != WEIGHTS_FILE else 1 << 30
    mutation = data.draw(byte_mutation(files[name], limit), label="mutation")
    check_load(base, files, state, name, mutation)


@FUZZ
@given(data=st.data())
def test_wrong_json_types_in_a_checkpoint_are_refused_clearly(saved, data):
    base, files, state = saved
    name = data.draw(st.sampled_from([CONFIG_FILE, METADATA_FILE]), label="file")
    mutated = data.draw(json_mutation(files[name]), label="json")
    check_load(base, files, state, name, ("json", mutated))


SHAPES = st.one_of(st.lists(st.sampled_from([0, 1, -1, 8, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 64]),
                            max_size=4),
                   st.sampled_from([5, "8", None, {}]))


@st.composite
def header_mutation(draw, original: bytes):
    """model.safetensors with its header edited: oversized or broken claims about the tensors
    (the tensor bytes after the header are kept)."""
    n = struct.unpack("<Q", original[:8])[0]
    header, body = json.loads(original[8:8 + n]), original[8 + n:]
    tensors = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(tensors))
    what = draw(st.sampled_from(["length", "shape", "dtype", "offsets", "rename", "drop",
                                 "metadata"]))
    if what == "length":
        return struct.pack("<Q", draw(st.sampled_from([0, 1, n - 1, n + 1, 1 << 27, 1 << 40,
                                                       2 ** 64 - 1]))) + original[8:]
    if what == "shape":
        header[name]["shape"] = draw(SHAPES)
    elif what == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(["F16", "BF16", "F64", "I64", "U8", "BOOL",
                                                      "F8", "", 5]))
    elif what == "offsets":
        header[name]["data_offsets"] = draw(st.lists(
            st.sampled_from([0, 4, len(body), len(body) + 4, 2 ** 40, 2 ** 63, 2 ** 64 - 1]),
            min_size=0, max_size=3))
    elif what == "rename":
        header[name.replace("h.0", "h.1") if "h.0" in name else name + "x"] = header.pop(name)
    elif what == "drop":
        del header[name]
    else:
        meta = header["__metadata__"]
        key = draw(st.sampled_from(sorted(meta) + ["extra"]))
        meta[key] = draw(st.sampled_from(["", "0" * 64, "minikv-checkpoint-1", 5, None]))
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@FUZZ
@given(data=st.data())
def test_oversized_or_broken_safetensors_header_claims_are_refused(saved, data):
    base, files, state = saved
    mutated = data.draw(header_mutation(files[WEIGHTS_FILE]), label="weights")
    check_load(base, files, state, WEIGHTS_FILE, ("header", mutated))


def test_save_refuses_metadata_that_loading_would_refuse(saved, tmp_path):
    """Saving is the other half of the contract: what it writes, loading reads back."""
    _, _, state = saved
    model = minikv.GPT(minikv.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2,
                                        n_embd=8))
    model.load_state_dict(state)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for metadata, says in (({"log": "x" * MAX_JSON_BYTES}, "more than the"),
                           ({"nested": deep}, "JSON-serialisable")):
        with pytest.raises(ValueError, match=says):
            save_checkpoint(model, tmp_path / "ckpt", metadata)
        assert not (tmp_path / "ckpt").exists()


# --- Hugging Face folders (minikv.from_pretrained) --------------------------------------------

@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """A tiny Qwen2 as a sharded Hugging Face folder (config.json, an index, two shards), its
    files' bytes and the names and shapes of its model's state dict."""
    from safetensors.torch import save_file

    from minikv.course.export import llama_state_dict
    torch.manual_seed(0)
    config = minikv.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8,
                              n_inner=16, qkv_bias=True, **LLAMA)
    model = minikv.GPT(config).eval()
    folder = tmp_path_factory.mktemp("hf") / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=32, hidden_size=8, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=8, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), indent=1))
    tensors = {k: v.contiguous() for k, v in llama_state_dict(model).items()}
    shards = {f"model-0000{i}-of-00002.safetensors": {k: v for k, v in tensors.items()
                                                      if ("layers.1." in k) == (i == 2)}
              for i in (1, 2)}
    for file, part in shards.items():
        save_file(part, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    minikv.from_pretrained(folder, "cpu")  # first load: lazy imports happen outside the budget
    return Saved((folder.parent, files, {k: v.shape for k, v in model.state_dict().items()}))


def check_hf_load(base: Path, files: dict, shapes: dict, name: str, mutation) -> None:
    """Load a copy of the folder with `name` mutated: a model of the original shapes (a Hugging
    Face folder has no checksum: changed weights of the right shapes load) or a clear error,
    within budget, nothing written."""
    with scratch(base) as root:
        folder = root / "qwen"
        folder.mkdir()
        for file, data in files.items():
            (folder / file).write_bytes(data)
        write_mutated(folder / name, mutation)
        before = fingerprint(root)
        out, error, peak, rss = measured(lambda: minikv.from_pretrained(folder, "cpu"))
        assert fingerprint(root) == before, "loading wrote to the model's folder"
    if error is None:
        assert {k: v.shape for k, v in out[0].state_dict().items()} == shapes
    else:
        assert_clear(error, "download|AutoModelForCausalLM")
    assert_within(peak, rss, sum(map(len, files.values())))


@FUZZ
@given(data=st.data())
def test_a_damaged_hugging_face_folder_is_refused_clearly(hf_saved, data):
    base, files, shapes = hf_saved
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    limit = 1 << 30 if name.endswith(".safetensors") else 1 << 24
    mutation = data.draw(byte_mutation(files[name], limit), label="mutation")
    check_hf_load(base, files, shapes, name, mutation)


@FUZZ
@given(data=st.data())
def test_wrong_json_types_in_a_hugging_face_folder_are_refused_clearly(hf_saved, data):
    base, files, shapes = hf_saved
    name = data.draw(st.sampled_from(["config.json", "model.safetensors.index.json"]),
                     label="file")
    mutated = data.draw(json_mutation(files[name]), label="json")
    check_hf_load(base, files, shapes, name, ("json", mutated))


@FUZZ
@given(data=st.data())
def test_broken_safetensors_header_claims_in_a_shard_are_refused(hf_saved, data):
    base, files, shapes = hf_saved
    name = data.draw(st.sampled_from(sorted(f for f in files if f.endswith(".safetensors"))))
    mutated = data.draw(header_mutation(files[name]), label="weights")
    check_hf_load(base, files, shapes, name, ("header", mutated))


# --- the tokenizer's ranks ------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
def test_a_damaged_tokenizer_file_is_refused_clearly(base, data):
    original = tokenizer.RANKS_PATH.read_bytes()
    mutation = data.draw(byte_mutation(original, tokenizer.MAX_RANKS_BYTES), label="mutation")
    with scratch(base) as root:
        path = root / "course.tiktoken"
        path.write_bytes(original)
        write_mutated(path, mutation)
        before = fingerprint(root)
        ranks, error, peak, rss = measured(lambda: tokenizer.load_ranks(path))
        assert fingerprint(root) == before
    if error is None:
        assert ranks == tokenizer.load_ranks()
    else:
        assert_clear(error, "restore it from git|regenerate it")
    assert_within(peak, rss, len(original))


# --- notebooks ----------------------------------------------------------------------------------

def small_notebook() -> bytes:
    """A valid exercise notebook: markdown, a solution cell, a check cell."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Exercise 1: add"),
        nbformat.v4.new_code_cell("def add(a, b):\n    return a + b"),
        nbformat.v4.new_code_cell("checks.check_add(add)", metadata={"tags": ["check"]}),
    ])
    return (nbformat.writes(nb) + "\n").encode()


def content(nb) -> tuple:
    return (nb.nbformat, nb.metadata,
            [(c.cell_type, c.source, c.metadata, c.get("outputs")) for c in nb.cells])


@functools.cache
def load_nbformat_schemas(base: Path) -> None:
    """nbformat loads each minor version's schema on first use (~9 MB of Python objects): a
    cost paid once per process, not per file, so it is paid before anything is measured."""
    raw = json.loads(small_notebook())
    with scratch(base) as root:
        for minor in (None, 0, 1, 2, 3, 4, 5):
            doc = {**raw, "nbformat_minor": minor} if minor is not None else {
                k: v for k, v in raw.items() if k != "nbformat_minor"}
            (root / "nb.ipynb").write_bytes(dumps(doc))
            with contextlib.suppress(ValueError):
                read_notebook(root / "nb.ipynb")


def check_read_notebook(base: Path, original: bytes, mutation) -> None:
    load_nbformat_schemas(base)
    with scratch(base) as root:
        path = root / "nb.ipynb"
        path.write_bytes(original)
        write_mutated(path, mutation)
        before = fingerprint(root)
        nb, error, peak, rss = measured(lambda: read_notebook(path))
        assert fingerprint(root) == before
        if error is None:  # no hash: any valid notebook is fine, and faithful to the file
            # nbformat gives a cell without an id a random one: compare what the cells hold
            assert content(nb) == content(nbformat.reads(path.read_text(), as_version=4))
            names = exercise_names(nb)  # what grade does next must not crash either
            assert all(isinstance(v, str) for v in names.values())
    if error is not None:
        assert_clear(error, "restore it from git|save it again")
    assert_within(peak, rss, len(original))


@FUZZ
@given(data=st.data())
def test_a_damaged_notebook_is_refused_clearly(base, data):
    original = small_notebook()
    mutation = data.draw(byte_mutation(original, MAX_NOTEBOOK_BYTES), label="mutation")
    check_read_notebook(base, original, mutation)


@FUZZ
@given(data=st.data())
def test_wrong_json_types_in_a_notebook_are_refused_clearly(base, data):
    original = small_notebook()
    mutated = data.draw(json_mutation(original), label="json")
    check_read_notebook(base, original, ("json", mutated))


BROKEN_NOTEBOOKS = {
    "truncated": lambda b: b[: len(b) // 2],
    "nbformat a string": lambda b: b.replace(b'"nbformat": 4', b'"nbformat": "4"'),
    "cells an object": lambda b: dumps({**json.loads(b), "cells": {}}),
    "tags a string": lambda b: b.replace(b'"tags": [\n     "check"\n    ]', b'"tags": "check"'),
}


@pytest.mark.parametrize("command", ["run", "grade"])
@pytest.mark.parametrize("broken", sorted(BROKEN_NOTEBOOKS))
def test_the_cli_refuses_a_broken_notebook_without_running_or_rewriting_it(tmp_path, command,
                                                                          broken):
    data = BROKEN_NOTEBOOKS[broken](small_notebook())
    assert data != small_notebook()
    path = tmp_path / "nb.ipynb"
    path.write_bytes(data)
    before = fingerprint(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main([command, str(path)])
    assert code == 2
    assert str(path) in err.getvalue() and "save it again" in err.getvalue(), err.getvalue()
    assert "Traceback" not in err.getvalue()
    assert fingerprint(tmp_path) == before


# --- grade's cache ------------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
def test_a_damaged_grade_cache_entry_is_run_again_never_trusted(base, data):
    """A cache entry that is not what cell_errors writes is ignored: the notebook runs again
    (here a stand-in for the kernel) and the entry is rewritten whole."""
    original = small_notebook()
    truth = [None, "CheckFailed: add: wrong"]
    with scratch(base) as root, pytest.MonkeyPatch.context() as mp:
        runs = []
        mp.setattr(grade, "run_cells", lambda path, timeout: runs.append(path) or list(truth))
        path, cache = root / "nb.ipynb", root / "cache"
        path.write_bytes(original)
        assert grade.cell_errors(path, cache=cache) == truth and len(runs) == 1
        (entry,) = cache.iterdir()
        kept = entry.read_bytes()
        is_json = data.draw(st.booleans(), label="json mutation")
        mutation = (("json", data.draw(json_mutation(entry.read_bytes()), label="json")) if is_json
                    else data.draw(byte_mutation(entry.read_bytes(), 3 << 20), label="bytes"))
        write_mutated(entry, mutation)
        try:  # (a grown entry is sparse: its size says it is not the one written)
            intact = (entry.stat().st_size < 1 << 20
                      and json.loads(entry.read_bytes()) == json.loads(kept))
        except (OSError, ValueError, RecursionError):
            intact = False
        notebook_before = path.read_bytes()
        errors, error, peak, rss = measured(lambda: grade.cell_errors(path, cache=cache))
        assert path.read_bytes() == notebook_before
        if mutation[0] == "dir":  # nothing can be written there: the rerun's result is lost
            assert isinstance(error, OSError) and errors is None, error
            return
        assert error is None, f"{type(error).__name__}: {error}"
        assert errors == truth
        assert json.loads(entry.read_bytes())["errors"] == truth  # kept, or rewritten
        assert len(runs) == 1 + (not intact)  # run again exactly when it is damaged
        assert_within(peak, rss, len(original))
