"""The figure command draws every seed picture from engine runs, deterministically, and the
pictures follow the model."""
import torch

import minikv
from minikv.viz.draw import png
from minikv.viz.figures import make_figures, seed_002_prefill_decode


def models(seed: int):
    """A random target and a draft that is a slightly perturbed copy (so rounds both pass and
    fail)."""
    torch.manual_seed(seed)
    target = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=1024)).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    draft = minikv.GPT(target.config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return target, draft


def test_every_figure_is_produced(tmp_path):
    target, draft = models(0)
    written = make_figures(target, draft, minikv.load_tokenizer(), tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(["seed_000_coin_flip.png", "seed_001_no_rollback.png",
                            "seed_002_prefill_decode.png", "seed_003_kv_cache_guide.png",
                            "seed_004_speculative_rollback.png"])
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_figures_are_deterministic_and_follow_the_model():
    tok = minikv.load_tokenizer()
    a, _ = models(0)
    b, _ = models(1)
    first = png(seed_002_prefill_decode(a, tok))
    assert png(seed_002_prefill_decode(a, tok)) == first
    assert png(seed_002_prefill_decode(b, tok)) != first


def test_shipped_figures_exist():
    """figures/ holds what `python -m minikv figures` wrote from the course models (README shows
    them)."""
    from minikv.viz.figures import FIGURES_DIR
    for name in ("seed_000_coin_flip", "seed_001_no_rollback", "seed_002_prefill_decode",
                 "seed_003_kv_cache_guide", "seed_004_speculative_rollback"):
        assert (FIGURES_DIR / f"{name}.png").is_file(), (
            f"run `python -m minikv figures` to draw {name}")
