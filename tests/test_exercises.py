"""Every generated exercise notebook fails under nbval exactly at its check cells: each stub makes
its own check fail (so the checks can fail), and no other cell depends on the learner's code."""
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from minikv.course import notebooks as course

EXERCISES = sorted((course.ROOT / "exercises").glob("*.ipynb"))


def check_cells(path: Path) -> set[str]:
    """nbval's item names ("Cell N", N counting code cells) of the cells tagged "check"."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return {f"Cell {i}" for i, c in enumerate(code) if "check" in c.metadata.get("tags", [])}


def failing_cells(path: Path, tmp_path: Path) -> set[str]:
    report = tmp_path / "nbval.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path),
                    "--nbval", "--nbval-current-env",
                    "--nbval-sanitize-with", str(course.ROOT / "tests/nbval_sanitize.cfg"),
                    f"--junitxml={report}"],
                   cwd=course.ROOT, capture_output=True, text=True, timeout=600)
    cases = ET.parse(report).getroot().iter("testcase")
    return {case.get("name") for case in cases
            if case.find("failure") is not None or case.find("error") is not None}


def test_every_chapter_has_exercises():
    assert len(EXERCISES) == len(course.exercise_pairs()) >= 6


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_fails_exactly_at_its_check_cells(path, tmp_path):
    checks = check_cells(path)
    assert len(checks) >= 2, (f"{path.name}: every chapter needs at least two exercises, "
                              "each with a check cell")
    assert failing_cells(path, tmp_path) == checks
