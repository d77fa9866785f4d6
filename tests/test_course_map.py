"""The course map (issue 29): every chapter opens with what the student will be able to do, what
to know first and how long it takes, and closes with concept questions, further reading and where
its mechanisms live in real engines; a glossary and the questions' answers exist and agree.

The map cells are markdown cells marked {"minikv": "map-open"} and {"minikv": "map-close"}. Set
MINIKV_COURSE_ROOT to check another copy of the course (a folder with notebooks/ and
solutions/), e.g. one the map cells were applied to."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("MINIKV_COURSE_ROOT", Path(__file__).resolve().parents[1]))
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
GLOSSARY = NOTEBOOKS / "glossary.md"
ANSWERS = ROOT / "solutions" / "concept-questions.md"
PARTS = ("Check your understanding", "Further reading", "In production")
VERBS = ("compute", "explain", "implement", "measure", "choose", "predict", "debug", "work out")
NUMBERED = re.compile(r"^\d+\. ", re.M)


def map_cells(path: Path, kind: str) -> list[tuple[int, object]]:
    import nbformat
    cells = nbformat.read(path, as_version=4).cells
    return [(i, c) for i, c in enumerate(cells) if c.metadata.get("minikv") == f"map-{kind}"]


def sections(markdown: str) -> dict[str, str]:
    """'## Heading' -> the text under it, up to the next '## '."""
    found = re.split(r"^## (.+)$", markdown, flags=re.M)
    return {title.strip(): body for title, body in zip(found[1::2], found[2::2])}


def questions(path: Path) -> int:
    closes = map_cells(path, "close")
    assert len(closes) == 1, f"{path.name}: {len(closes)} map-close cells (run the map's apply.py)"
    (_, close), = closes
    return len(NUMBERED.findall(sections(close.source)["Check your understanding"]))


def test_there_are_chapters():
    assert len(CHAPTERS) >= 8, f"no chapter notebooks under {NOTEBOOKS}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_opens_with_outcomes_prerequisites_and_time(path):
    opens = map_cells(path, "open")
    assert len(opens) == 1, f"{path.name}: {len(opens)} map-open cells (run the map's apply.py)"
    (index, cell), = opens
    assert index == 1 and cell.cell_type == "markdown", "map-open goes right after the title"
    text = cell.source
    outcomes = re.findall(r"^- .*", text, re.M)
    assert "you can" in text and len(outcomes) >= 3, "outcomes: at least three, as a list"
    assert all(any(f"**{v}**" in o for v in VERBS) for o in outcomes), "each outcome is a verb"
    assert "**Prerequisites:**" in text
    assert re.search(r"\*\*Study time:\*\*.*?\d+ min.*?\d+ min", text, re.S), \
        "study time: reading and running, then the exercises"
    assert "(glossary.md)" in text


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_closes_with_questions_reading_and_production(path):
    import nbformat
    closes = map_cells(path, "close")
    assert len(closes) == 1, f"{path.name}: {len(closes)} map-close cells (run the map's apply.py)"
    (index, cell), = closes
    assert index == len(nbformat.read(path, as_version=4).cells) - 1, "map-close is the last cell"
    parts = sections(cell.source)
    assert list(parts) == list(PARTS)
    assert 3 <= questions(path) <= 5
    assert "../solutions/concept-questions.md" in parts[PARTS[0]]
    cited = [item for item in re.findall(r"^- (.*(?:\n  .*)*)", parts[PARTS[1]], re.M)
             if re.search(r"\((19|20)\d\d\)", item)]
    assert len(cited) >= 2, "at least two citations with a year"
    assert re.findall(r"^- \*\*", parts[PARTS[2]], re.M), "at least one in-production item"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_map_lines_fit_in_100_columns(path):
    for kind in ("open", "close"):
        for _, cell in map_cells(path, kind):
            long = [line for line in cell.source.splitlines() if len(line) > 100]
            assert not long, f"{path.name} map-{kind}: {long[0]!r}"


def test_glossary_defines_the_terms_and_names_real_chapters():
    text = GLOSSARY.read_text(encoding="utf-8")
    entries = re.findall(r"^- \*\*(.+?)\*\*(.*(?:\n  .*)*)", text, re.M)
    assert len(entries) >= 40, f"{len(entries)} terms"
    assert len({term for term, _ in entries}) == len(entries), "a term is defined twice"
    for term, body in entries:
        assert re.search(r"\]\(\d\d_\w+\.ipynb\)", body), f"{term}: names no chapter"
    linked = set(re.findall(r"\]\((\d\d_\w+\.ipynb)\)", text))
    unknown = linked - {p.name for p in CHAPTERS}
    assert not unknown, f"no such chapter: {sorted(unknown)}"
    assert len({name[:2] for name in linked}) == len(CHAPTERS), "every chapter is in the glossary"


def test_every_chapter_has_its_answers():
    answers = sections(ANSWERS.read_text(encoding="utf-8"))
    by_number = {title[:2]: body for title, body in answers.items()}
    for path in CHAPTERS:
        number = path.name[:2]
        assert number in by_number, f"no section '## {number} · …' in {ANSWERS.name}"
        assert f"](../notebooks/{path.name})" in by_number[number]
        assert len(NUMBERED.findall(by_number[number])) == questions(path), \
            f"chapter {number}: as many answers as questions"
