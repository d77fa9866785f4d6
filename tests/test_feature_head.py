"""Chapter 10's shipped feature head: validated like every shipped file, trained (it agrees with
the target in the loop), made by `python -m minikv train-head`, and loaded only
for the model it was trained on."""
import shutil
from dataclasses import replace

import pytest
import torch

import minikv
from minikv.course import checkpoint
from minikv.course.checkpoint import (
    FEATURE_HEAD,
    MODELS_DIR,
    WEIGHTS_FILE,
    load_checkpoint,
    load_feature_head,
    save_checkpoint,
)
from minikv.course.train_head import HeadConfig, main, train_head
from minikv.engine import FeatureHead, feature_generate


@pytest.fixture(scope="module")
def target():
    return minikv.load_course_model("target", "cpu")


def test_the_shipped_head_fits_the_target_and_the_weights_budget(target):
    model, _ = target
    head = load_feature_head(model)
    assert head.config == replace(model.config, n_layer=1) and not head.training
    assert head.device == model.device and sum(p.numel() for p in head.parameters()) == 518_784
    shipped = [MODELS_DIR / n / WEIGHTS_FILE for n in (*checkpoint.COURSE_MODELS, FEATURE_HEAD)]
    assert sum(p.stat().st_size for p in shipped) <= 80e6  # issue 53's budget, its variants in


def test_the_shipped_head_is_trained(target):
    """Greedy output is the target's whatever the head; a trained head also gets most of its
    proposals accepted (an untrained one: almost none)."""
    model, tok = target
    prompt = tok.encode("Once upon a time")
    want = minikv.generate(model, prompt, 60).tokens
    trained = feature_generate(model, load_feature_head(model), prompt, 60, gamma=4)
    torch.manual_seed(0)
    untrained = FeatureHead(FeatureHead.config_for(model)).eval()
    fresh = feature_generate(model, untrained, prompt, 60, gamma=4)
    assert trained.tokens == fresh.tokens == want
    assert trained.stats.alpha > 0.8 > 0.2 > fresh.stats.alpha


def test_a_head_is_loaded_only_for_its_target(target):
    draft, _ = minikv.load_course_model("draft", "cpu")
    with pytest.raises(ValueError, match="trained for the course target"):
        load_feature_head(draft)


@pytest.mark.parametrize("name", [WEIGHTS_FILE, checkpoint.CONFIG_FILE, checkpoint.METADATA_FILE])
def test_tampering_with_the_shipped_head_is_detected(name, tmp_path, monkeypatch):
    models = tmp_path / "models"
    for d in ("target", FEATURE_HEAD):
        shutil.copytree(MODELS_DIR / d, models / d)
    monkeypatch.setattr(checkpoint, "MODELS_DIR", models)
    path = models / FEATURE_HEAD / name
    original = path.read_bytes()
    for where in (0, len(original) // 2, len(original) - 2):
        data = bytearray(original)
        data[where] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="restore it|train-head"):
            load_feature_head()
    path.write_bytes(original)
    assert isinstance(load_feature_head(), FeatureHead)


def test_a_head_and_a_model_are_not_loaded_as_each_other(tmp_path):
    with pytest.raises(ValueError, match="missing tensors"):
        load_checkpoint(MODELS_DIR / FEATURE_HEAD, "cpu")  # as a GPT
    with pytest.raises(ValueError, match="missing tensors|unexpected tensors|layers"):
        load_checkpoint(MODELS_DIR / "draft", "cpu", FeatureHead)


def test_train_head_saves_a_head_that_loads_back(tmp_path, target):
    small = HeadConfig(steps=3, batch_size=2, warmup=1,
                       docs={"coinflip": 40, "facts": 40, "stories": 40})
    head, meta = train_head(small, "cpu", progress=False)
    assert meta["kind"] == "feature-head" and meta["train"]["steps"] == 3
    assert {"regression", "tokens", "agree"} <= set(meta["val"])
    save_checkpoint(head, tmp_path / "head", meta)
    again = load_checkpoint(tmp_path / "head", "cpu", FeatureHead)
    for a, b in zip(head.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_train_head_never_overwrites_a_shipped_model_by_default(capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(MODELS_DIR / "draft"), "--steps", "1"])
    assert "--ship" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--ship", "--out", "runs/x"])
