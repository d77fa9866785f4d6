"""minikv.from_pretrained (issue 55): a local Hugging Face folder of a Llama, Qwen2 or Qwen3 model
read into the one model. A folder written by minikv's export and one written by transformers'
save_pretrained (one file, or sharded with an index) load and decode the same greedy tokens as
the model they were written from; a folder that is damaged, misshapen or of a kind the engine
does not have is refused by name, before any tensor is read or any model built."""
import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from test_real_blocks import FAMILIES, hf_pair

import minikv
from minikv.course import export, pretrained
from minikv.engine.config import LLAMA

from conftest import varied_model

transformers = pytest.importorskip("transformers")
PROMPT = [3, 14, 15, 92, 65]


def greedy(model, n=40):
    return minikv.generate(model, PROMPT, n).tokens


def hf_greedy(hf, n=40):
    with torch.no_grad():
        return hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                           min_new_tokens=n)[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("choices", [{}, dict(tied_head=False), dict(qkv_bias=True),
                                     dict(qk_norm=True, head_size=32),
                                     dict(rope_scaling=("llama3", 32.0, 1.0, 4.0, 64))])
def test_an_exported_folder_loads_back_as_the_same_model(tmp_path, choices):
    model = varied_model("tiny", seed=4, std=0.2, vocab_size=1024, n_kv_head=2, n_inner=176,
                         **LLAMA, **choices)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    out = export.export_hf(model, tmp_path / "hf")
    back, tok = minikv.from_pretrained(out, "cpu")
    assert back.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                 model.state_dict().values()))
    mine = greedy(model)
    assert greedy(back) == mine and len(set(mine)) > 5
    course = minikv.load_tokenizer()
    text = "Once upon a time, there was a little dog named Max."
    assert tok.encode(text) == course.encode(text)  # the folder's tokenizer.json, read locally


def test_a_shipped_course_model_round_trips_through_export(tmp_path):
    model, _ = minikv.load_course_model("target-rope", "cpu")
    back, _ = minikv.from_pretrained(export.export_hf(model, tmp_path / "hf"), "cpu")
    assert back.config == model.config and greedy(back) == greedy(model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_a_save_pretrained_folder_decodes_as_transformers_does(tmp_path, family, shard):
    hf, cfg = hf_pair(family, seed={"qwen2": 3, "qwen3": 2}.get(family, 1))
    kwargs = {} if shard is None else dict(max_shard_size=shard)
    hf.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / pretrained.INDEX).exists() == (shard is not None)
    model, tok = minikv.from_pretrained(tmp_path, "cpu")
    assert tok is None  # weights and config only
    assert model.config == cfg
    theirs = hf_greedy(hf)
    assert greedy(model) == theirs and len(set(theirs)) > 5


def test_dtype_and_device_are_taken(tmp_path):
    hf, _ = hf_pair("qwen2")
    hf.to(torch.bfloat16).save_pretrained(tmp_path)  # stored as the real models are: bfloat16
    model, _ = minikv.from_pretrained(str(tmp_path), device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu" and not model.training
    with pytest.raises(ValueError, match="dtype must be one of"):
        minikv.from_pretrained(tmp_path, "cpu", dtype=torch.int8)


# --- bad folders: refused by name, nothing read or built -----------------------------------------
@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A good save_pretrained folder of a tiny Qwen2; reading a tensor or building a model
    fails the test, so each refusal below is shown to come before both."""
    hf, _ = hf_pair("qwen2")
    hf.save_pretrained(tmp_path)

    def read(*args):
        raise AssertionError("tensors were read before the folder was checked")

    def build(*args):
        raise AssertionError("a model was built before the folder was checked")
    monkeypatch.setattr(pretrained, "_read_tensors", read)
    monkeypatch.setattr(minikv.GPT, "from_llama_state_dict", build)
    return tmp_path


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("changes, error, match", [
    (dict(model_type="gpt_neox"), ValueError, "model_type 'gpt_neox' is not one minikv reads"),
    (dict(model_type="qwen2_moe"), ValueError, "not one minikv reads.*AutoModelForCausalLM"),
    (dict(num_experts=8), ValueError, "mixture of experts"),
    (dict(use_sliding_window=True), ValueError, "sliding-window attention"),
    (dict(attention_bias=True), ValueError, "attention_bias"),
    (dict(hidden_act="gelu"), ValueError, "activation 'gelu'"),
    (dict(quantization_config={"quant_method": "gptq"}), ValueError, "quantized"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), ValueError,
     "rope_type 'yarn' is not supported"),
    (dict(rope_parameters="fast"), ValueError, "rope_parameters must be a JSON object"),
    (dict(hidden_size="64"), ValueError, "invalid qwen2 config.*n_embd must be"),
    (dict(num_hidden_layers=2.0), ValueError, "n_layer must be a positive int"),
    (dict(rms_norm_eps=-1), ValueError, "layer_norm_eps"),
    (dict(tie_word_embeddings="yes"), TypeError, "tied_head must be True or False"),
    (dict(vocab_size=None), ValueError, "has no 'vocab_size'"),
    (dict(num_attention_heads=5), ValueError, "divisible"),
])
def test_a_bad_or_unsupported_config_is_refused_by_name(folder, changes, error, match):
    edit_config(folder, **changes)
    with pytest.raises(error, match=match):
        minikv.from_pretrained(folder, "cpu")


def test_a_config_that_is_not_a_json_object_is_refused(folder):
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        minikv.from_pretrained(folder, "cpu")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        minikv.from_pretrained(folder, "cpu")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json.*No such file"):
        minikv.from_pretrained(folder, "cpu")


def test_a_config_claiming_a_billion_layers_is_refused_at_once(folder):
    edit_config(folder, num_hidden_layers=10**9)
    with pytest.raises(ValueError, match="hold 2 layers, config.json says 1000000000"):
        minikv.from_pretrained(folder, "cpu")


def tensors(folder) -> dict:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("change, match", [
    (lambda sd: sd.pop("model.layers.0.self_attn.k_proj.bias"),
     r"missing tensors \['model.layers.0.self_attn.k_proj.bias'\]"),
    (lambda sd: sd.update(extra=torch.zeros(2)), r"unexpected tensors \['extra'\]"),
    (lambda sd: sd.update({"model.norm.weight": torch.ones(65)}),
     r"model.norm.weight has shape \(65,\), config.json needs \(64,\)"),
    (lambda sd: sd.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)}),
     "model.norm.weight is I64; weights must be float32, float16 or bfloat16"),
    (lambda sd: sd.update({"model.norm.weight": torch.ones(64, dtype=torch.float64)}),
     "is torch.float64"),
])
def test_misshapen_missing_or_wrongly_typed_tensors_are_refused(folder, change, match):
    sd = tensors(folder)
    change(sd)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        minikv.from_pretrained(folder, "cpu")


def test_a_corrupt_or_truncated_safetensors_file_is_refused(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        minikv.from_pretrained(folder, "cpu")
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])  # a header claiming a terabyte
    with pytest.raises(ValueError, match="corrupt or truncated"):
        minikv.from_pretrained(folder, "cpu")


def test_nan_weights_are_refused(tmp_path):
    hf, _ = hf_pair("qwen3")
    with torch.no_grad():
        hf.model.norm.weight[3] = float("nan")
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.norm.weight holds NaN"):
        minikv.from_pretrained(tmp_path, "cpu")


def test_bad_shard_indexes_are_refused(tmp_path, monkeypatch):
    hf, _ = hf_pair("llama-untied")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    monkeypatch.setattr(pretrained, "_read_tensors", None)  # never reached: a TypeError if so
    index = tmp_path / pretrained.INDEX
    raw = json.loads(index.read_text())
    name, shard = next(iter(raw["weight_map"].items()))
    other = next(v for v in raw["weight_map"].values() if v != shard)  # not where name is
    for bad, match in [({**raw, "weight_map": {**raw["weight_map"], name: "../x.safetensors"}},
                        "a shard is a .safetensors file in the folder itself"),
                       ({**raw, "weight_map": {**raw["weight_map"], name: "gone.safetensors"}},
                        "gone.safetensors is missing"),
                       ({**raw, "weight_map": {**raw["weight_map"], name: other}},
                        "other tensors than"),
                       ({"weight_map": []}, "must hold a weight_map")]:
        index.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            minikv.from_pretrained(tmp_path, "cpu")


def test_a_folder_without_safetensors_or_one_that_is_not_a_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    hf, _ = hf_pair("qwen2")
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only safetensors weights are read"):
        minikv.from_pretrained(tmp_path, "cpu")
    with pytest.raises(ValueError, match="does not exist.*snapshot_download"):
        minikv.from_pretrained(tmp_path / "absent", "cpu")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        minikv.from_pretrained(tmp_path / "config.json", "cpu")
    with pytest.raises(TypeError, match="folder must be a path"):
        minikv.from_pretrained(b"models/qwen", "cpu")


def test_a_broken_tokenizer_json_is_refused(tmp_path):
    hf, _ = hf_pair("qwen2")
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="tokenizer.json cannot be read as a tokenizer"):
        minikv.from_pretrained(tmp_path, "cpu")


def test_a_model_type_that_is_not_a_string_is_refused(folder):
    edit_config(folder, model_type=["qwen2"])
    with pytest.raises(ValueError, match=r"model_type \['qwen2'\] is not one minikv reads"):
        minikv.from_pretrained(folder, "cpu")


# config.json as the hub's folders hold them (written by transformers 4: rope_theta and
# rope_scaling at the top), every size scaled down, every other key as the real model's
REAL_CONFIGS = {
    "Llama-3.2-1B": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
        attention_dropout=0.0, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        head_dim=16, hidden_act="silu", hidden_size=64, initializer_range=0.02,
        intermediate_size=176, max_position_embeddings=256, mlp_bias=False,
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, pretraining_tp=1,
        rms_norm_eps=1e-05, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                          "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 64,
                                          "rope_type": "llama3"},
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
        use_cache=True, vocab_size=512),
    "SmolLM2-135M": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, hidden_act="silu",
        hidden_size=64, initializer_range=0.041666666666666664, intermediate_size=176,
        is_llama_config=True, max_position_embeddings=256, mlp_bias=False,
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, pretraining_tp=1,
        rms_norm_eps=1e-05, rope_interleaved=False, rope_scaling=None, rope_theta=100000,
        tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, vocab_size=512),
    "Qwen2.5-0.5B": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151643, hidden_act="silu", hidden_size=64,
        initializer_range=0.02, intermediate_size=176, max_position_embeddings=256,
        max_window_layers=24, num_attention_heads=4, num_hidden_layers=2,
        num_key_value_heads=2, rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=256,
        tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
        use_sliding_window=False, vocab_size=512),
    "Qwen3-0.6B": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
        attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=32,
        hidden_act="silu", hidden_size=64, initializer_range=0.02, intermediate_size=176,
        max_position_embeddings=256, max_window_layers=28, num_attention_heads=4,
        num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000, sliding_window=None, tie_word_embeddings=True,
        torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=512),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_a_hub_style_config_reads_as_transformers_reads_it(tmp_path, name):
    """The config.json of each family's real model (sizes cut down): transformers builds its
    model from it, weights drawn wide; minikv reads the same folder and decodes the same."""
    (tmp_path / "config.json").write_text(json.dumps(REAL_CONFIGS[name]))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():  # norms' scales not ones, biases not zeros
            p.uniform_(0.5, 1.5) if p.dim() == 1 and "norm" in key else p.normal_(0.0, 0.1)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    model, _ = minikv.from_pretrained(tmp_path, "cpu")
    theirs = hf_greedy(hf)
    assert greedy(model) == theirs and len(set(theirs)) > 5


def test_hub_folder_finds_a_snapshot_in_the_cache_or_says_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert pretrained.hub_folder("HuggingFaceTB/SmolLM2-135M") is None  # not downloaded
    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    assert pretrained.hub_folder("HuggingFaceTB/SmolLM2-135M") is None  # no snapshot yet
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    assert pretrained.hub_folder("HuggingFaceTB/SmolLM2-135M") == repo / "snapshots" / "abc123"
    (repo / "refs" / "main").write_text("../../elsewhere")
    assert pretrained.hub_folder("HuggingFaceTB/SmolLM2-135M") is None
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert pretrained.hub_folder("HuggingFaceTB/SmolLM2-135M") is None
    for bad in ("SmolLM2-135M", "../x/y", 3):
        with pytest.raises(ValueError, match="repo_id must be 'owner/name'"):
            pretrained.hub_folder(bad)


def test_the_appendix_runs_on_a_downloaded_model(tmp_path, monkeypatch):
    """notebooks/A_real_models.ipynb's model cells, which nbval sees skip (no model in a test
    machine's cache), run on a small exported Llama put where snapshot_download would have
    put SmolLM2-135M: the decoders agree there too, and its weights quantize."""
    import nbformat
    from nbclient import NotebookClient

    from minikv.course.notebooks import ROOT
    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    model = varied_model("tiny", seed=4, std=0.2, vocab_size=1024, n_kv_head=2, n_inner=176,
                         **LLAMA)
    export.export_hf(model, repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports this checkout's minikv
    nb = nbformat.read(ROOT / "notebooks" / "A_real_models.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs)
    assert "SmolLM2-135M on " in printed and "skipped" not in printed
    assert printed.count("same tokens: True") == 2
    assert "int8: " in printed and "int4: " in printed and "greedy tokens as " in printed
