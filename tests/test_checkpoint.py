"""Checkpoints: an exact round trip, clear errors for every kind of bad file, never unpickling,
and the shipped course models load with their documented shapes."""
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import minikv
from minikv.course import corpus
from minikv.course.checkpoint import (
    CONFIG_FILE,
    COURSE_MODELS,
    FEATURE_HEAD,
    METADATA_FILE,
    MODELS_DIR,
    WEIGHTS_FILE,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)

from conftest import varied_model


@pytest.fixture
def saved(tmp_path):
    model = varied_model()
    directory = save_checkpoint(model, tmp_path / "ckpt", {"preset": "tiny", "steps": 0})
    return model, directory


def rewrite_weights(directory, edit):
    """Edit the tensors and save them as another tool would: a valid file, without our sha256."""
    tensors = load_file(str(directory / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(directory / WEIGHTS_FILE))


def test_round_trip_is_exact(saved):
    model, directory = saved
    loaded = load_checkpoint(directory, device="cpu")
    assert loaded.config == model.config and not loaded.training
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), loaded(ids))  # bitwise
    assert read_metadata(directory) == {"preset": "tiny", "steps": 0}


def test_files_are_safetensors_and_json_with_one_copy_of_the_tied_weights(saved):
    model, directory = saved
    assert sorted(p.name for p in directory.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE,
                                                                   METADATA_FILE])
    assert json.loads((directory / CONFIG_FILE).read_text()) == model.config.to_dict()
    names = set(load_file(str(directory / WEIGHTS_FILE)))
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    # readable as the umask allows, like the JSON files (safetensors alone writes 0600)
    assert (directory / WEIGHTS_FILE).stat().st_mode == (directory / CONFIG_FILE).stat().st_mode


def test_loading_leaves_the_global_rng_alone(saved):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_checkpoint(saved[1], device="cpu")
    assert torch.equal(torch.rand(3), expected)


def test_loading_never_unpickles(saved, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")
    for module, name in [(torch, "load"), (pickle, "load"), (pickle, "loads"),
                         (pickle, "Unpickler")]:
        monkeypatch.setattr(module, name, forbidden)
    model, directory = saved
    loaded = load_checkpoint(directory, device="cpu")
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)


def test_truncated_weights(saved):
    path = saved[1] / WEIGHTS_FILE
    data = path.read_bytes()
    for keep in (len(data) - 100, 1000, 20, 4, 0):
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError,
                           match=r"model\.safetensors is corrupt or truncated.*save it again"):
            load_checkpoint(saved[1])


def test_corrupt_weights(saved):
    path = saved[1] / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage in the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(saved[1])
    path.write_bytes(b"this is not a safetensors file at all, just text")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(saved[1])


def test_flipped_bit_in_the_tensor_data_is_caught(saved):
    path = saved[1] / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match the sha256 saved with them"):
        load_checkpoint(saved[1])


def test_files_without_a_checksum_still_load(saved):
    rewrite_weights(saved[1], lambda t: None)
    loaded = load_checkpoint(saved[1], device="cpu")
    assert torch.equal(loaded.transformer.wpe.weight, saved[0].transformer.wpe.weight)


def test_pickled_file_is_refused(saved):
    model, directory = saved
    # a torch.save file under the safetensors name
    torch.save(model.state_dict(), directory / WEIGHTS_FILE)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(directory)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__("transformer.wpe.weight", t["transformer.wpe.weight"][:100].clone()),
     r"transformer\.wpe\.weight has shape \(100, 64\) but config\.json needs \(256, 64\)"),
    (lambda t: t.__setitem__("transformer.h.0.attn.c_attn.weight",
                             t["transformer.h.0.attn.c_attn.weight"].half()),
     r"transformer\.h\.0\.attn\.c_attn\.weight is torch\.float16, expected torch\.float32"),
    (lambda t: t.__setitem__("transformer.ln_f.bias",
                             torch.full_like(t["transformer.ln_f.bias"], float("nan"))),
     r"transformer\.ln_f\.bias holds NaN"),
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"),
     r"missing tensors \['transformer\.h\.1\.mlp\.c_fc\.bias'\]"),
    (lambda t: t.__setitem__("lm_head.weight", t["transformer.wte.weight"].clone()),
     r"unexpected tensors \['lm_head\.weight'\]"),
    (lambda t: t.__setitem__("transformer.h.2.attn.c_attn.weight", torch.zeros(192, 64)),
     r"unexpected tensors \['transformer\.h\.2\.attn\.c_attn\.weight'\]"),
], ids=["wrong-shape", "wrong-dtype", "nan", "missing-tensor", "extra-head", "extra-layer"])
def test_mismatched_weights(saved, edit, message):
    rewrite_weights(saved[1], edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(saved[1])


@pytest.mark.parametrize("text, message", [
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "exactly the GPTConfig keys"),
    (json.dumps(dict(vocab_size=512, block_size=256, n_layer=2, n_head=4)),
     "exactly the GPTConfig keys"),
    (json.dumps(dict(vocab_size=512, block_size=256, n_layer=2, n_head=3, n_embd=64,
                     layer_norm_eps=1e-5)),
     "invalid config: n_embd .64. must be divisible by n_head .3."),
    (json.dumps(dict(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64,
                     layer_norm_eps=1e-5)),
     r"wpe\.weight has shape \(256, 64\) but config\.json needs \(128, 64\)"),
], ids=["not-json", "not-a-dict", "missing-key", "bad-value", "other-shapes"])
def test_bad_config(saved, text, message):
    (saved[1] / CONFIG_FILE).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(saved[1])


@pytest.mark.parametrize("missing", [CONFIG_FILE, WEIGHTS_FILE])
def test_missing_file(saved, missing):
    (saved[1] / missing).unlink()
    with pytest.raises(ValueError, match=f"{missing} is missing"):
        load_checkpoint(saved[1])


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_a_broken_copy_of_a_course_model_says_how_to_retrain(tmp_path, monkeypatch):
    models = tmp_path / "models"
    shutil.copytree(MODELS_DIR / "draft", models / "draft")
    (models / "draft" / WEIGHTS_FILE).write_bytes(b"\0" * 16)
    monkeypatch.setattr(minikv.course.checkpoint, "MODELS_DIR", models)
    with pytest.raises(ValueError,
                       match=r"retrain it with `python -m minikv train --preset draft --ship`"):
        minikv.load_course_model("draft")


def test_unknown_course_model():
    with pytest.raises(ValueError, match="valid names: 'target', 'draft', 'target-gqa2'"):
        minikv.load_course_model("gpt2")


@pytest.mark.parametrize("name", ["target", "draft", "target-rope"])
def test_shipped_models_load_with_documented_shapes(name):
    model, tok = minikv.load_course_model(name, device="cpu")
    assert model.config == minikv.GPTConfig.preset(name)
    assert model.config.vocab_size == tok.n_vocab == 1024
    assert not model.training and model.device.type == "cpu"
    assert model.lm_head.weight is model.transformer.wte.weight
    meta = read_metadata(MODELS_DIR / name)
    assert meta["preset"] == name and meta["num_params"] == model.num_params()


def test_target_is_much_bigger_than_the_draft_and_both_fit_the_budget():
    target, _ = minikv.load_course_model("target", device="cpu")
    draft, _ = minikv.load_course_model("draft", device="cpu")
    assert target.num_params() > 8 * draft.num_params()
    assert sum((MODELS_DIR / n / WEIGHTS_FILE).stat().st_size for n in ("target", "draft")) <= 25e6


def test_every_shipped_weight_file_together_stays_within_80_MB():
    names = (*COURSE_MODELS, FEATURE_HEAD)
    assert sum((MODELS_DIR / n / WEIGHTS_FILE).stat().st_size for n in names) <= 80e6


@pytest.mark.parametrize("name, choice, per_token", [
    ("target-mla", {"kv_lora_rank": 48}, 12 * 48), ("target-cla2", {"layers_per_kv": 2},
                                                      6 * 2 * 8 * 24)])
def test_the_cache_variants_are_the_target_made_to_cache_less(name, choice, per_token):
    """Chapter 12's variants: the target's config with one choice changed, uptrained as briefly
    as the grouped-query ones, cached decoding equal to the full pass, and per position the
    numbers their caches hold (MLA: 12 layers x a 48-wide latent, as many as target-mqa's)."""
    target, _ = minikv.load_course_model("target", device="cpu")
    model, tok = minikv.load_course_model(name, device="cpu")
    assert model.config == minikv.GPTConfig(**{**target.config.to_dict(), **choice})
    meta = read_metadata(MODELS_DIR / name)
    assert meta["preset"] == name and meta["uptrained_from"].startswith("the target")
    assert meta["train"] == read_metadata(MODELS_DIR / "target-mqa")["train"]
    prompt = tok.encode("Once upon a time")
    assert minikv.generate(model, prompt, 24).tokens == minikv.generate(
        model, prompt, 24, mode="naive").tokens
    assert minikv.kv_cache_bytes(model.config, 1, dtype=torch.float32) == 4 * per_token
    mqa, _ = minikv.load_course_model("target-mqa", device="cpu")
    assert minikv.kv_cache_bytes(mqa.config, 1) == minikv.kv_cache_bytes(
        model.config, 1) * (1 if name == "target-mla" else 1 / 4)


@pytest.mark.parametrize("name, kv_heads", [("target-gqa2", 2), ("target-mqa", 1)])
def test_the_grouped_query_variants_are_the_target_with_fewer_kv_heads(name, kv_heads):
    target, _ = minikv.load_course_model("target", device="cpu")
    model, tok = minikv.load_course_model(name, device="cpu")
    assert model.config == minikv.GPTConfig(**{**target.config.to_dict(), "n_kv_head": kv_heads})
    meta = read_metadata(MODELS_DIR / name)
    assert meta["preset"] == name and "uptrained_from" in meta
    target_steps = sum(p["train"]["steps"] for p in read_metadata(MODELS_DIR / "target")["phases"])
    assert meta["train"]["steps"] <= target_steps // 10
    # its cache holds kv_heads heads, and cached decoding equals the full pass
    out = minikv.generate(model, tok.encode("Once upon a time"), 24)
    assert out.tokens == minikv.generate(model, tok.encode("Once upon a time"), 24,
                                         mode="naive").tokens
    cache = minikv.KVCache.for_model(model, max_len=8)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    assert cache.nbytes == minikv.kv_cache_bytes(model.config, 3, dtype=torch.float32)
    assert cache.keys[0].shape[1] == kv_heads


def test_the_rope_model_is_the_targets_shape_and_recipe_with_a_llama_block():
    target, _ = minikv.load_course_model("target", device="cpu")
    rope, _ = minikv.load_course_model("target-rope", device="cpu")
    same = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
    assert all(getattr(rope.config, f) == getattr(target.config, f) for f in same)
    assert (rope.config.positions, rope.config.norm, rope.config.mlp) == ("rope", "rmsnorm",
                                                                         "swiglu")
    steps = [[p["train"]["steps"] for p in read_metadata(MODELS_DIR / n)["phases"]]
             for n in ("target", "target-rope")]
    assert steps[0] == steps[1] and len(steps[0]) == 2
    assert read_metadata(MODELS_DIR / "target-rope")["stored_dtype"] == "float16"


@pytest.mark.parametrize("name", ["target", "target-rope"])
def test_target_answers_held_out_coin_flips(name):
    model, tok = minikv.load_course_model(name, device="cpu")
    questions = [q for q in corpus.coin_flip_eval(4) if len(q.steps) <= 6]
    ids = [tok.encode(q.prompt()) for q in questions]
    with torch.no_grad():
        answers = [tok.decode([int(model(torch.tensor([i]), last_only=True)[0, -1].argmax())])
                   for i in ids]
    assert answers == [" " + q.answer for q in questions]


def test_target_continues_the_course_prompts():
    model, tok = minikv.load_course_model("target", device="cpu")
    # the text itself is shown in docs/course-models.md
    for prompt in ("The color of dog", "Once upon a time"):
        out = minikv.generate(model, tok.encode(prompt), 64, eos_id=tok.eot_token)
        # finishes its sentence
        assert out.tokens[-1] == tok.eot_token and tok.decode(out.tokens[:-1]).endswith(".")
