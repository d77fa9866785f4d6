import pytest
import torch

import minikv


def varied_model(preset: str = "tiny", seed: int = 0, std: float = 0.1,
                 **overrides) -> minikv.GPT:
    """A random model whose greedy output wanders over many tokens.

    Default GPT-2 init (std 0.02) makes a random model repeat one token forever, which would let a
    broken cache pass an equality test; std 0.1 keeps logits O(1) but the argmax moving.
    """
    torch.manual_seed(seed)
    model = minikv.GPT(minikv.GPTConfig.preset(preset, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return model


def stub(*args, **kwargs):
    """An exercise as students receive it: every checker must let this error through, not mark it
    wrong."""
    raise NotImplementedError("your turn: replace this line with your code")


@pytest.fixture
def tiny():
    return varied_model()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def solution_check_cells(notebook: str, chapter: str) -> list[tuple[str, object, str, list[str]]]:
    """The check cells of solutions/<notebook>, each in the shared two-line form calling
    fresh(chapter): (source of the code cell before it, the check cell, the checker it calls, the
    names it passes)."""
    import nbformat

    from minikv.course import notebooks as course
    nb = nbformat.read(course.ROOT / "solutions" / notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    found = []
    for before, cell in zip(code, code[1:]):
        if "check" not in cell.metadata.get("tags", []):
            continue
        first, second = cell.source.splitlines()
        assert first == "import importlib, minikv.course.checks as checks"
        assert second.startswith(f'importlib.reload(checks).fresh("{chapter}").check_')
        assert course.BEGIN in before.source
        found.append((before.source, cell, second.split(".check_")[1].split("(")[0],
                      second.split("(", 3)[-1].rstrip(")").split(", ")))
    return found
