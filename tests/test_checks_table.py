"""Every exercise checked from data (a chapter's `EXERCISES`, see minikv/course/checks/__init__.py),
tested from the same data: its solution passes with the ✓ line and leaves the random state alone,
a stub's NotImplementedError goes through, and every named mistake, fed to the checker as the
learner's function, fails it with exactly its own hint. A chapter joins by listing its exercises."""
import importlib
import re
import sys

import pytest
import torch

import minikv
from minikv.course import checks
from minikv.course.checks import CheckFailed

from conftest import stub

CHAPTERS = {c: importlib.import_module(f"minikv.course.checks.{c}") for c in checks.CHAPTERS}
EXERCISES = [(c, ex) for c, module in CHAPTERS.items() for ex in getattr(module, "EXERCISES", ())]
MISTAKES = [(c, ex, hint, wrong) for c, ex in EXERCISES for hint, wrong in ex.mistakes.items()]


def _id(value):
    return value.name if isinstance(value, checks.Exercise) else (
        re.sub(r"\W+", "_", value[:40]) if isinstance(value, str) else "")


@pytest.mark.parametrize("chapter, ex", EXERCISES, ids=_id)
def test_the_solution_passes_and_the_random_state_stays(chapter, ex, capsys):
    assert getattr(CHAPTERS[chapter], f"check_{ex.name}") == ex.check  # what check cells call
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    ex.check(ex.solution or ex.reference)
    assert capsys.readouterr().out == f"✓ {ex.name}: all {len(ex.cases)} cases pass\n"
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("chapter, ex", EXERCISES, ids=_id)
def test_a_stub_goes_through(chapter, ex):
    with pytest.raises(NotImplementedError):
        ex.check(stub)


@pytest.mark.parametrize("chapter, ex, hint, wrong", MISTAKES, ids=_id)
def test_every_named_mistake_is_named(chapter, ex, hint, wrong):
    with pytest.raises(CheckFailed) as info:
        ex.check(wrong)
    assert str(info.value).endswith(f"\n  hint: {hint}"), str(info.value)


@pytest.mark.parametrize("chapter", sorted({c for c, _ in EXERCISES}))
def test_a_check_cell_runs_the_packaged_checker(chapter, monkeypatch):
    """What an exercise cell could do: replace a checker, or an engine function it compares with.
    The check cell's fresh copy runs the packaged checker, and refuses a replaced engine."""
    ex = next(ex for c, ex in EXERCISES if c == chapter and ex.mistakes)
    hint, wrong = next(iter(ex.mistakes.items()))
    monkeypatch.setattr(CHAPTERS[chapter], f"check_{ex.name}", lambda fn: print("✓ (patched)"))
    # a notebook's first check cell: the chapter's module not imported yet (a dataclass in it,
    # say, must not need it in sys.modules)
    monkeypatch.delitem(sys.modules, f"minikv.course.checks.{chapter}")
    with pytest.raises(CheckFailed, match=re.escape(hint)):
        getattr(checks.fresh(chapter), f"check_{ex.name}")(wrong)
    monkeypatch.setattr(minikv, "serve", lambda *args, **kwargs: [])
    with pytest.raises(CheckFailed, match="minikv.serve is not the packaged one"):
        checks.fresh(chapter)
