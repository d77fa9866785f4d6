"""Commands write only their own folders, and every value on their command line is checked before
any work (issue 51). A folder a command writes must be new, empty, or marked as that command's
output (a .minikv-output file); `export --force` replaces only such a folder. The repository, a
folder holding the package, a folder with a user's file, a file where a folder goes, another
command's folder: each is refused by name (exit 2), and the tree is byte for byte as it was. Then
a table of every command's numeric and path options with wrong values: each ends in argparse's
`error: argument ...` (or the command's own message), exit 2, before anything is loaded."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from minikv.course import notebooks
from minikv.course.files import MARKER, claim_directory, mark_directory

from conftest import cli_exit

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".venv"}
NOTEBOOK = str(sorted((ROOT / "exercises").glob("00_*.ipynb"))[0])


def tree(top: Path) -> dict:
    """Every file and folder under `top` (caches of the tools running this test aside) with its
    size, modification time and inode: a file rewritten, even atomically with the same bytes,
    changes its inode; one added or removed changes the keys."""
    found = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP]
        for name in dirs + files:
            path = Path(folder, name)
            info = path.lstat()
            found[str(path.relative_to(top))] = (info.st_mode, info.st_size, info.st_mtime_ns,
                                                 info.st_ino)
    return found


# every command that writes a folder, and the arguments that point it at `out`
WRITERS = {
    "export": lambda out: ["export", "--model", "draft", "--out", out, "--force"],
    "train": lambda out: ["train", "--preset", "draft", "--steps", "1", "--out", out],
    "train-head": lambda out: ["train-head", "--steps", "1", "--out", out],
    "figures": lambda out: ["figures", "--out", out],
    "bench": lambda out: ["bench", "--quick", "--out", out],
    "bench-load": lambda out: ["bench-load", "--quick", "--out", out],
    "bench-spec": lambda out: ["bench-spec", "--quick", "--out", out],
    "bench-sessions": lambda out: ["bench-sessions", "--quick", "--out", out],
    "bench-tp": lambda out: ["bench-tp", "--quick", "--out", out],
    "bench-weights": lambda out: ["bench-weights", "--quick", "--out", out],
    "bench-batch": lambda out: ["bench-batch", "--quick", "--out", out],
    "bench-disagg": lambda out: ["bench-disagg", "--quick", "--out", out],
    "bench-peers": lambda out: ["bench-peers", "--quick", "--without-llama-cpp", "--out", out],
    "bench-compile": lambda out: ["bench-compile", "--quick", "--out", out],
    "bench-syncs": lambda out: ["bench-syncs", "--quick", "--out", out],
    "grade --cache": lambda out: ["grade", NOTEBOOK, "--cache", out],
}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    """The folders no command may write: a user's, one holding a package, a file, another
    command's output."""
    top = tmp_path_factory.mktemp("places")
    (top / "mine").mkdir()
    (top / "mine" / "notes.txt").write_text("a user's file\n")
    (top / "site" / "minikv").mkdir(parents=True)
    (top / "site" / "minikv" / "__init__.py").write_text("# a package\n")
    (top / "a-file").write_text("not a folder\n")
    mark_directory(top / "another's", "bench-load")
    (top / "another's" / "results.json").write_text("{}\n")
    return {"mine": top / "mine", "site": top / "site", "a-file": top / "a-file",
            "another's": top / "another's"}


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_the_repository_is_never_a_commands_output(command, monkeypatch):
    before = tree(ROOT)
    monkeypatch.chdir(ROOT)
    for out in (str(ROOT), "."):  # `--out .` from the repository: the everyday slip
        code, err = cli_exit(*WRITERS[command](out))
        assert code == 2, (command, out, err)
        assert "holds the minikv package" in err, err
    assert tree(ROOT) == before


PLACES = [("mine", "did not write (notes.txt)"), ("site", "holds the minikv package"),
          ("a-file", "exists and is not a directory"),
          ("another's", "is `python -m minikv bench-load`'s output")]


@pytest.mark.parametrize("command, place, says", [
    (command, place, says) for command in sorted(WRITERS) for place, says in PLACES
    if (command, place) != ("bench-load", "another's")])  # that one is bench-load's own
def test_a_folder_not_the_commands_own_is_refused_by_name(command, place, says, places):
    top = places["mine"].parent
    before = tree(top)
    code, err = cli_exit(*WRITERS[command](str(places[place])))
    assert code == 2 and str(places[place]) in err and says in err, (command, err)
    assert tree(top) == before


def test_a_new_empty_or_marked_folder_is_the_commands_and_force_is_needed_to_replace(tmp_path):
    assert claim_directory(tmp_path / "new", "export", replace=True, force=False)
    (tmp_path / "empty").mkdir()
    assert claim_directory(tmp_path / "empty", "export", replace=True, force=False)
    mark_directory(tmp_path / "done", "export")
    (tmp_path / "done" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="pass --force to replace it"):
        claim_directory(tmp_path / "done", "export", replace=True, force=False)
    assert claim_directory(tmp_path / "done", "export", replace=True, force=True)
    with pytest.raises(ValueError, match="`python -m minikv export`'s output"):
        claim_directory(tmp_path / "done", "train", replace=True)
    (tmp_path / "done" / MARKER).write_text("python -m minikv export, or so I say\n")
    with pytest.raises(ValueError, match=r"did not write \(.minikv-output, config.json\)"):
        claim_directory(tmp_path / "done", "export", replace=True)  # not a marker it wrote
    with pytest.raises(ValueError, match="inside the minikv package"):
        claim_directory(ROOT / "minikv" / "course" / "new", "train")


def test_a_grade_cache_from_before_markers_is_still_its_own(tmp_path):
    (tmp_path / ("0" * 64 + ".json")).write_text("{}")
    assert claim_directory(tmp_path, "grade --cache", own=r"[0-9a-f]{64}\.json")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"did not write \(notes.txt\)"):
        claim_directory(tmp_path, "grade --cache", own=r"[0-9a-f]{64}\.json")


def test_the_committed_output_folders_are_marked_as_their_commands():
    """`make figures` and `make bench` write figures/ and benchmarks/ (and chapter 10's run
    benchmarks/speculation): each is marked as its command's, so they still may."""
    for folder, command in (("figures", "figures"), ("benchmarks", "bench"),
                            ("benchmarks/load", "bench-load"),
                            ("benchmarks/speculation", "bench-spec"),
                            ("benchmarks/sessions", "bench-sessions"),
                            ("benchmarks/tp", "bench-tp"),
                            ("benchmarks/weights", "bench-weights"),
                            ("benchmarks/batch-cpu", "bench-batch"),
                            ("benchmarks/disagg", "bench-disagg"),
                            ("benchmarks/compile", "bench-compile"),
                            ("benchmarks/peers", "bench-peers")):
        assert claim_directory(ROOT / folder, command) == ROOT / folder


def test_exercises_writes_only_in_the_course_repository(monkeypatch, tmp_path, capsys):
    """Installed from a wheel, the place above the package is site-packages' parent: exercises
    refuses to write a classroom workflow there."""
    monkeypatch.setattr(notebooks, "ROOT", tmp_path)
    assert notebooks.main(["exercises"]) == 2
    assert "is not one: run it in a clone" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- every number and path on every command line ------------------------------------------------
BAD = [  # (command and good arguments, option, wrong value, what the message says)
    *[(["generate", "--prompt", "a", "--preset", "tiny"], opt, value, says)
      for opt, value, says in [
        ("--max-new-tokens", "0", "at least 1"), ("--max-new-tokens", "-3", "at least 1"),
        ("--max-new-tokens", "x", "an integer"), ("--temperature", "-1", "at least 0.0"),
        ("--temperature", "nan", "at least 0.0"), ("--temperature", "inf", "at least 0.0"),
        ("--top-k", "0", "at least 1"), ("--top-k", "-2", "at least 1"),
        ("--seed", "-1", "from 0"), ("--seed", str(2**63), "from 0"),
        ("--init-seed", "-1", "from 0")]],
    *[(["train", "--preset", "draft"], opt, value, says) for opt, value, says in [
        ("--steps", "0", "at least 1"), ("--steps", "-5", "at least 1"),
        ("--seed", "-1", "from 0"), ("--init", "{file}", "is a file: give a directory"),
        ("--init", "{missing}", "is not there"), ("--out", "{file}", "not a directory")]],
    *[(["train-head"], opt, value, says) for opt, value, says in [
        ("--steps", "0", "at least 1"), ("--seed", "-1", "from 0"),
        ("--out", "{file}", "not a directory")]],
    *[(["bench", "--quick"], opt, value, says) for opt, value, says in [
        ("--repeats", "0", "at least 1"), ("--naive-max", "-1", "at least 1"),
        ("--out", "{file}", "not a directory")]],
    (["bench-load", "--quick"], "--out", "{file}", "not a directory"),
    (["bench-spec", "--quick"], "--out", "{file}", "not a directory"),
    *[(["bench-sessions", "--quick"], opt, value, says) for opt, value, says in [
        ("--repeats", "0", "at least 1"), ("--repeats", "-2", "at least 1"),
        ("--repeats", "x", "an integer"), ("--threads", "0", "at least 1"),
        ("--device", "tpu", "tpu"), ("--out", "{file}", "not a directory")]],
    *[(["bench-disagg", "--quick"], opt, value, says) for opt, value, says in [
        ("--repeats", "0", "at least 1"), ("--device", "cuda", "invalid choice"),
        ("--out", "{file}", "not a directory")]],
    (["figures"], "--out", "{file}", "not a directory"),
    *[(["grade", NOTEBOOK], opt, value, says) for opt, value, says in [
        ("--timeout", "0", "from 1 to"), ("--timeout", "-1", "from 1 to"),
        ("--cache", "{file}", "not a directory")]],
    *[(["grade"], None, value, says) for value, says in [
        ("{dir}", "is a directory: give a notebook"), ("{missing}", "is not there"),
        ("{file}", "not a .ipynb file")]],
    *[(["run"], None, value, says) for value, says in [
        ("{dir}", "is a directory: give a notebook"), ("{missing}", "is not there")]],
    *[(["mutants"], opt, value, says) for opt, value, says in [
        ("--cap", "0", "at least 1"), ("--timeout", "0", "more than 0"),
        ("--timeout", "-1", "more than 0"), ("--timeout", "nan", "more than 0"),
        ("--json", "{dir}", "is a directory"), ("--json", "{missing}/x.json", "does not exist")]],
    *[(["evaluate"], opt, value, says) for opt, value, says in [
        ("--out", "{dir}", "is a directory"), ("--out", "{missing}/x.md", "does not exist")]],
    *[(["export", "--model", "draft"], opt, value, says) for opt, value, says in [
        ("--out", "{file}", "not a directory")]],
    (["export"], "--checkpoint", "{file}", "is a file: give a directory"),
    *[(["serve-http"], opt, value, says) for opt, value, says in [
        ("--port", "0", "from 1 to 65,535"), ("--port", "-1", "from 1 to 65,535"),
        ("--port", "65536", "from 1 to 65,535"), ("--port", "http", "an integer"),
        ("--num-blocks", "0", "at least 1"), ("--page-size", "0", "at least 1"),
        ("--max-running", "0", "at least 1"), ("--max-queue", "-1", "at least 0"),
        ("--chunk-budget", "0", "at least 1"), ("--chunk-budget", "-4", "at least 1"),
        ("--memory-utilization", "0", "more than 0.0"),
        ("--memory-utilization", "1.5", "at most 1.0"),
        ("--memory-utilization", "nan", "more than 0.0")]],
    (["serve-http", "--num-blocks", "8"], "--memory-utilization", "0.5", "not allowed with"),
    *[(["bench-tp", "--quick"], opt, value, says) for opt, value, says in [
        ("--out", "{file}", "not a directory")]],
    (["bench-weights", "--quick"], "--out", "{file}", "not a directory"),
    *[(["bench-peers", "--quick", "--without-llama-cpp"], opt, value, says)
      for opt, value, says in [
          ("--out", "{file}", "not a directory"), ("--threads", "0", "at least 1"),
          ("--repeats", "0", "at least 1"), ("--prompt", "1", "from 2 to 200"),
          ("--new", "57", "from 2 to 56"), ("--new", "x", "integer")]],
    *[(["bench-compile", "--quick"], opt, value, says) for opt, value, says in [
        ("--out", "{file}", "not a directory"), ("--threads", "0", "at least 1"),
        ("--repeats", "0", "at least 1"), ("--device", "tpu", "tpu")]],
    *[(["bench-batch", "--quick"], opt, value, says) for opt, value, says in [
        ("--out", "{file}", "not a directory"), ("--repeats", "0", "at least 1"),
        ("--threads", "0", "at least 1"), ("--device", "tpu", "tpu")]],
    *[(["generate", "--prompt", "x"], opt, value, says) for opt, value, says in [
        ("--tp", "0", "from 1 to 64"), ("--tp", "-2", "from 1 to 64"), ("--tp", "x", "integer")]],
]


@pytest.mark.parametrize("argv, option, value, says", BAD,
                         ids=[f"{a[0]} {o or ''} {v}" for a, o, v, _ in BAD])
def test_every_bad_command_line_value_exits_2_with_a_message(argv, option, value, says,
                                                             tmp_path):
    (tmp_path / "a-file.txt").write_text("not a folder\n")
    (tmp_path / "dir").mkdir()
    value = value.format(file=tmp_path / "a-file.txt", dir=tmp_path / "dir",
                         missing=tmp_path / "missing")
    before = tree(tmp_path)
    code, err = cli_exit(*argv, *([option] if option else []), value)
    assert code == 2, err
    assert says in err, err
    assert "Traceback" not in err
    assert tree(tmp_path) == before  # refused before anything was written
