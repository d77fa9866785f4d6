"""Installable anywhere: the built wheel carries the engine, every shipped model, the tokenizer and
the committed benchmark results the chapters quote. Installed in a clean virtual environment
outside the repository, the course loads its models from that environment's site-packages (hash
checked as always) and runs a chapter; and a chapter's first cell installs the course where it is
missing (Colab, Binder, a bare Jupyter), here from the wheel.

Nothing is downloaded: the clean environments see this one's dependencies (torch, Jupyter) through
a .pth line, which adds a folder to sys.path without running the .pth files in it, so the
repository's editable install does not leak in (asserted before each install).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import nbformat
import pytest

from minikv.course import notebooks as course

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("notebooks", "solutions", "exercises")


def run(argv: list, cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def tracked(folder: str) -> list[str]:
    """The files git tracks under `folder`; without git (or outside a checkout), the files there
    less Python's caches, which in a clean clone are the same."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
    except OSError:
        listed = None
    if listed is not None and listed.returncode == 0 and listed.stdout:
        return listed.stdout.split("\0")[:-1]
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and ".git" not in p.parts
                  and not any(part.endswith(".egg-info") for part in p.parts))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the tracked files (so nothing untracked or stale in
    build/ can slip in), without network or build isolation."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    build = ["pyproject.toml", "setup.py", "MANIFEST.in"]  # and what they package:
    for name in build + tracked("minikv") + tracked("benchmarks"):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", tmp / "dist", source], tmp)
    (built,) = (tmp / "dist").glob("minikv-*-py3-none-any.whl")
    print(f"\nwheel: {built.name}, {built.stat().st_size / 2**20:.1f} MiB")
    return built


def test_the_wheel_carries_the_course(wheel):
    """Every tracked file of the package (the models and the tokenizer included) with the same
    bytes, the committed benchmark results under minikv/_benchmarks/, and nothing else."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.startswith("minikv-")]  # less its .dist-info
        package = tracked("minikv")
        assert any("models/feature-head/" in n for n in package)
        results = {f"minikv/_benchmarks/{Path(n).relative_to('benchmarks')}": n
                   for n in tracked("benchmarks") if n.endswith(".json")}
        assert sorted(names) == sorted(package + list(results)), "the wheel's files"
        for name in package:
            assert z.read(name) == (ROOT / name).read_bytes(), name
        for name, committed in results.items():
            assert z.read(name) == (ROOT / committed).read_bytes(), name
    size = wheel.stat().st_size
    # the course models' 80 MB budget (tests/test_checkpoint.py) and at most 4 MB besides
    assert 40 << 20 < size < 84e6, f"the wheel is {size / 2**20:.1f} MiB"


def site_packages(python: Path) -> Path:
    return Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    python.parent).strip())


def clean_venv(path: Path) -> Path:
    """A new virtual environment at `path` whose dependencies, pip included, are this one's (a
    pip of its own would bring an old setuptools that shadows the one torch needs); its python."""
    run([sys._base_executable, "-m", "venv", "--without-pip", path], path.parent, timeout=300)
    python = path / "bin" / "python"
    ours = sysconfig.get_paths()["purelib"]  # where this environment's dependencies are
    (site_packages(python) / "minikv_course_deps.pth").write_text(ours + "\n")
    missing = subprocess.run([python, "-c", "import minikv"], cwd=path.parent,
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "No module named 'minikv'" in missing.stderr, (
        "the clean environment sees the repository's minikv")
    return python


def execute(python: Path, notebook: Path, env: dict) -> list[str]:
    """Run `notebook` (a copy, in its own folder) in a kernel of `python`, a last cell added that
    prints where minikv was imported from; every cell must run; the printed path."""
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import minikv\nprint(minikv.__file__)"))
    nbformat.write(nb, notebook)
    script = textwrap.dedent(f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(notebook)!r}, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={{"metadata": {{"path": {str(notebook.parent)!r}}}}}).execute()
        print(nb.cells[-1].outputs[0]["text"].strip())
    """)
    return run([python, "-c", script], notebook.parent, env=env, timeout=900).splitlines()


def probe(names: list[str]) -> str:
    """A script: load every course model and the feature head, decode a little, say where from."""
    return textwrap.dedent(f"""
        import json, minikv
        from minikv.bench import RESULTS
        out = {{"file": minikv.__file__, "results": str(RESULTS), "tokens": {{}}}}
        for name in {names!r}:
            model, tok = minikv.load_course_model(name, "cpu")
            ids = tok.encode("Once upon a time")
            out["tokens"][name] = minikv.generate(model, ids, 8).tokens
            if name == "target":
                head = minikv.load_feature_head(model)
                out["head"] = sum(p.numel() for p in head.parameters())
        print(json.dumps(out))
    """)


@pytest.mark.slow
def test_the_installed_course_runs_outside_the_repository(wheel, tmp_path):
    import minikv
    python = clean_venv(tmp_path / "venv")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
         "--no-index", wheel], tmp_path)
    site = site_packages(python)
    names = sorted(p.name for p in (ROOT / "minikv/course/models").iterdir()
                   if (p / "config.json").is_file() and p.name != "feature-head")
    work = tmp_path / "elsewhere"
    work.mkdir()
    got = json.loads(run([python, "-c", probe(names)], work))
    assert Path(got["file"]).is_relative_to(site), got["file"]
    assert Path(got["results"]) == site / "minikv" / "_benchmarks"
    for name in names:  # the same weights: the same greedy tokens as the repository's models
        model, tok = minikv.load_course_model(name, "cpu")
        want = minikv.generate(model, tok.encode("Once upon a time"), 8).tokens
        assert got["tokens"][name] == want, name
    assert got["head"] == 518_784
    # chapter 10: the feature head, token trees, and the committed benchmark it quotes
    chapter = work / "10_speculation_beyond_a_draft.ipynb"
    shutil.copy(ROOT / "notebooks" / chapter.name, chapter)
    printed = execute(python, chapter, {**os.environ, "MPLBACKEND": "Agg"})
    assert Path(printed[-1]).is_relative_to(site), printed


@pytest.mark.slow
def test_a_chapters_first_cell_installs_the_course_where_it_is_missing(wheel, tmp_path):
    """What "Open in Colab" does: a Jupyter without the course opens chapter 00; its first code
    cell installs it (from MINIKV_INSTALL, here the wheel, where Colab takes the repository), and
    the chapter runs on."""
    python = clean_venv(tmp_path / "venv")
    chapter = tmp_path / "00_setup.ipynb"
    shutil.copy(ROOT / "notebooks" / chapter.name, chapter)
    env = {**os.environ, "MINIKV_INSTALL": str(wheel), "PIP_NO_INDEX": "1",
           "MPLBACKEND": "Agg"}
    printed = execute(python, chapter, env)
    site = site_packages(python)
    assert Path(printed[-1]).is_relative_to(site), printed
    assert list(site.glob("minikv-*.dist-info"))
    # where pip cannot install it, the cell stops the chapter with a message saying so
    python = clean_venv(tmp_path / "venv2")
    script = textwrap.dedent(f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell({course.install_cell(
            course.repository_url())!r})])
        NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True).execute()
        print([o.get("evalue") for o in nb.cells[0].outputs if o.output_type == "error"])
    """)
    env["MINIKV_INSTALL"] = str(tmp_path / "no-such.whl")
    said = run([python, "-c", script], tmp_path, env=env, timeout=300).splitlines()[-1]
    assert said == f"['could not install the course from {tmp_path / 'no-such.whl'}: see above']"


def test_every_chapter_opens_with_the_install_cell():
    """The same cell, generated from pyproject.toml's Repository, the first code cell of every
    chapter (after its title and map), solution and exercise notebook."""
    url = course.repository_url()
    want = course.install_cell(url)
    assert f'"minikv[notebooks] @ git+{url}"' in want  # with matplotlib and ipywidgets
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = nbformat.read(path, as_version=4).cells
            first = next(c for c in cells if c.cell_type == "code")
            assert first.source == want, f"{folder}/{path.name}"
            assert cells.index(first) == (2 if folder == "notebooks" else 1)  # title, map
            assert first.metadata.get("minikv") == "install" and not first.outputs


def test_the_readme_badges_open_the_course_at_the_repository():
    owner_name = course.repository_url().removeprefix("https://github.com/")
    readme = (ROOT / "README.md").read_text()
    colab = re.findall(r"https://colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/", readme)
    binder = re.findall(r"https://mybinder\.org/v2/gh/([\w.-]+/[\w.-]+)/", readme)
    assert colab and binder and set(colab) == set(binder) == {owner_name}
