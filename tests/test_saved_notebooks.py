"""What the committed notebooks hold. Every figure a notebook shows is saved as a picture, not
only as its text `<Figure size …>` (what IPython writes for a Figure it has no image formatter
for), and minikv.viz's own figures give IPython a PNG whatever the backend. And every nbval marker
is one nbval honours: only a comment line that is exactly the marker (`# NBVAL_IGNORE_OUTPUT`);
`# NBVAL_IGNORE_OUTPUT: why` is an ordinary comment, so the cell's host-specific output would be
compared after all, passing on the machine that saved it and failing on every other one."""
import json
import re
from pathlib import Path

import pytest

from minikv.viz.draw import NotebookFigure, draw_window

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))
MARKER = re.compile(r"^\s*#+\s*(NBVAL_[A-Z_]+|PYTEST_VALIDATE_[A-Z_]+)(.*)$")


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 3 * 8


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_saved_figure_has_its_picture(path):
    cells = json.loads(path.read_text())["cells"]
    textless = [f"cell {i}: {''.join(data['text/plain']).strip()}"
                for i, cell in enumerate(cells) for output in cell.get("outputs", [])
                for data in [output.get("data", {})]
                if "".join(data.get("text/plain", "")).startswith("<Figure size")
                and "image/png" not in data]
    assert not textless, f"{path.name}: figures saved as text only:\n" + "\n".join(textless)


def test_a_figure_drawn_outside_pyplot_shows_as_png():
    from IPython.core.formatters import DisplayFormatter

    fig = draw_window([[0], [0, 1], [0, 1, 2], [0, 2, 3]], [11, 12, 13, 14], sinks=1)
    assert isinstance(fig, NotebookFigure)
    data, _ = DisplayFormatter().format(fig)  # a fresh formatter: no pyplot backend registered
    assert data["image/png"].startswith(b"\x89PNG")
    assert data["text/plain"].startswith("<Figure size")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_nbval_marker_is_a_line_of_its_own(path):
    cells = json.loads(path.read_text())["cells"]
    bad = [(i, line) for i, cell in enumerate(cells) if cell["cell_type"] == "code"
           for line in "".join(cell["source"]).splitlines()
           if (m := MARKER.match(line)) and m.group(2).strip()]
    assert not bad, (f"{path.name}: nbval ignores these markers (put the marker alone on its "
                     f"line, the reason on the next): {bad}")
