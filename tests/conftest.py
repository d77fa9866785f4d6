import os

import pytest
import torch

import minikv

# Chapter 09's Triton exercise is graded on a CPU by Triton's interpreter. TRITON_INTERPRET is read
# when a kernel is decorated, and triton.language decorates its own helpers (tl.zeros, tl.sum, ...)
# as it is imported: so it is set here, before any test imports triton. Where a CUDA GPU is, the
# kernels compile for it instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


def cli_exit(*args: str) -> tuple[int, str]:
    """(exit code, stderr) of `python -m minikv ...`, run in this process; argparse's own
    refusals (SystemExit) count as exit codes."""
    import contextlib
    import io

    from minikv import __main__ as cli
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(args))
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


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


def assert_cached_equals_full(model: minikv.GPT) -> None:
    """A batch of 2 read as a 7-token prefill and 13 decode steps through a KVCache gives the
    logits of one full pass (float64 models: to 1e-10)."""
    ids = torch.randint(0, model.config.vocab_size, (2, 20),
                        generator=torch.Generator().manual_seed(1))
    cache = minikv.KVCache.for_model(model, batch_size=2, max_len=20)
    with torch.no_grad():
        full = model(ids)
        parts = [model(ids[:, :7], cache=cache)] + [model(ids[:, i:i + 1], cache=cache)
                                                     for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)


def assert_right_ways_pass(checker, right: list, stubs: list, capsys) -> None:
    """A chapter checker's right answers pass (each printing its ✓), the first leaving the
    random state as it found it; each stub goes through as NotImplementedError."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checker(*right[0])
    assert torch.equal(before, torch.random.get_rng_state())
    for args in right[1:]:
        checker(*args)
    assert capsys.readouterr().out.count("✓ ") == len(right)
    for args in stubs:
        with pytest.raises(NotImplementedError):
            checker(*args)


def assert_mistake_named(checker, wrong, fragment: str) -> None:
    """A wrong answer fails the checker with a message that names the mistake."""
    from minikv.course.checks import CheckFailed
    with pytest.raises(CheckFailed) as info:
        checker(*wrong if isinstance(wrong, tuple) else (wrong,))
    assert fragment in str(info.value), str(info.value)


def checker_id(value):
    """A test id for a parametrized checker or its (functions...) case: their names."""
    if isinstance(value, tuple):
        return "+".join(getattr(f, "__name__", "?") for f in value)
    return value[:40] if isinstance(value, str) else getattr(value, "__name__", None)
