"""nbval honours a marker only as a comment line that is exactly the marker
(`# NBVAL_IGNORE_OUTPUT`): `# NBVAL_IGNORE_OUTPUT: why` is an ordinary comment, and the cell's
host-specific output would be compared after all, passing on the machine that saved it and
failing on every other one."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))
MARKER = re.compile(r"^\s*#+\s*(NBVAL_[A-Z_]+|PYTEST_VALIDATE_[A-Z_]+)(.*)$")


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 3 * 8


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_nbval_marker_is_a_line_of_its_own(path):
    cells = json.loads(path.read_text())["cells"]
    bad = [(i, line) for i, cell in enumerate(cells) if cell["cell_type"] == "code"
           for line in "".join(cell["source"]).splitlines()
           if (m := MARKER.match(line)) and m.group(2).strip()]
    assert not bad, (f"{path.name}: nbval ignores these markers (put the marker alone on its "
                     f"line, the reason on the next): {bad}")
