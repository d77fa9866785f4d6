"""The small open models, read from a local Hugging Face folder into the course's one model.

    model, tok = minikv.from_pretrained("path/to/SmolLM2-135M")  # a folder already on disk
    out = minikv.generate(model, tok.encode("The KV cache"), 20)

A folder is what `huggingface_hub.snapshot_download("HuggingFaceTB/SmolLM2-135M")` (or
`save_pretrained`, or `python -m minikv export`) leaves on disk: config.json, the weights as one
model.safetensors or as shards named by model.safetensors.index.json, and tokenizer.json when
there is one. Nothing is downloaded here: the hub is never called.

Three families are read, each a Llama-style block (config.LLAMA) with its own choices:

    llama  Llama-3.2 (Llama 3's RoPE scaling), SmolLM2 (plain RoPE); an untied head when set
    qwen2  Qwen2.5: biases on q, k and v
    qwen3  Qwen3: an RMSNorm over each head's q and k, and a head width of its own (head_dim)

What the engine does not have is refused by name before any weight is read: another model_type,
a mixture of experts, sliding-window attention, RoPE scalings other than Llama 3's, biases on
the output projection or the MLP, another activation, a quantized checkpoint. Pickled weights
(pytorch_model.bin) are never read: loading a pickle can run code. Every check a course
checkpoint gets is made here too, and in the same order: config.json's types and values first,
then every tensor's name, shape and dtype as the safetensors headers declare them, against the
shapes the config implies (nothing the size of the model is allocated until they all match),
then the values (finite).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..engine import GPT, GPTConfig
from ..engine.config import LLAMA
from ..engine.validate import one_of
from .checkpoint import _DTYPES
from .device import resolve_device
from .export import llama_state_dict
from .files import read_at_most

CONFIG, WEIGHTS, INDEX, TOKENIZER = ("config.json", "model.safetensors",
                                     "model.safetensors.index.json", "tokenizer.json")
# config.json is a few KB; a sharded model's index a few hundred KB at most
MAX_JSON_BYTES = 1 << 24
FAMILIES = {"llama": "Llama-3.2, SmolLM2", "qwen2": "Qwen2.5", "qwen3": "Qwen3"}
LOADABLE = (torch.float32, torch.float16, torch.bfloat16)  # what a tensor may be stored as
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
ELSEWHERE = "use transformers.AutoModelForCausalLM for it"


def from_pretrained(folder: str | os.PathLike, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> tuple:
    """(model, tokenizer) from a local Hugging Face folder of a Llama, Qwen2 or Qwen3 model:
    the GPT, in eval mode on `device` (default: minikv.default_device()) as `dtype`, and a
    transformers PreTrainedTokenizerFast of the folder's tokenizer.json (None when the folder
    has none, or transformers is not installed). A ValueError names what is wrong or not
    supported, and what to do, before anything the size of the model is allocated."""
    folder = _folder(folder)
    one_of("dtype", dtype, LOADABLE)
    config = read_hf_config(folder)
    files = _weight_files(folder)
    declared = _declared(files, folder)
    _check_declared(declared, config, folder)
    device = resolve_device(device)
    state = _read_tensors(files, folder)
    with torch.random.fork_rng(devices=[]):  # building the model draws an init: keep the RNG
        model = GPT.from_llama_state_dict(state, config)
    return model.to(device, dtype).eval(), _tokenizer(folder)


def hub_folder(repo_id: str) -> Path | None:
    """The folder of `repo_id` ("HuggingFaceTB/SmolLM2-135M") in this machine's Hugging Face
    cache, as huggingface_hub.snapshot_download left it (the revision refs/main names), or None
    when it is not there. Only looks: never downloads. The cache is $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub ($XDG_CACHE_HOME for ~/.cache)."""
    if not (isinstance(repo_id, str) and repo_id.count("/") == 1 and ".." not in repo_id):
        raise ValueError(f"repo_id must be 'owner/name', as on the hub, not {repo_id!r:.60}")
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else
                                         Path(env.get("XDG_CACHE_HOME") or "~/.cache")
                                         / "huggingface" / "hub")
    repo = Path(cache).expanduser() / ("models--" + repo_id.replace("/", "--"))
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    folder = repo / "snapshots" / ref
    return folder if ref and Path(ref).name == ref and (folder / CONFIG).is_file() else None


def _folder(folder) -> Path:
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or Path), not {type(folder).__name__}")
    path = Path(folder).expanduser()
    fix = ("download it first, e.g. huggingface_hub.snapshot_download("
           "'HuggingFaceTB/SmolLM2-135M'), and pass the folder it returns")
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as e:  # a symlink loop, a name too long
        raise ValueError(f"cannot read folder {path} ({e.strerror}); {fix}") from None
    if not is_dir:
        what = "is a file, not a folder" if exists else "does not exist"
        raise ValueError(f"{path} {what}: from_pretrained reads a local Hugging Face folder "
                         f"(config.json, *.safetensors); {fix}")
    return path


def _read_json(path: Path, fix: str):
    data = read_at_most(path, MAX_JSON_BYTES, "file", fix)
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, [[[[...
        raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None


# --- config.json -------------------------------------------------------------------------------

def read_hf_config(folder: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json of a Llama, Qwen2 or Qwen3 model: its types
    and values checked, and whatever the engine does not have refused by name."""
    folder = _folder(folder)
    path = folder / CONFIG
    raw = _read_json(path, "download the model's folder again")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(raw).__name__}; "
                         f"download the model's folder again")
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES or any(raw.get(k) for k in MOE_KEYS):
        moe = " (a mixture of experts)" if any(raw.get(k) for k in MOE_KEYS) else ""
        raise ValueError(f"{path}: model_type {kind!r:.40}{moe} is not one minikv reads (" +
                         ", ".join(f"{k}: {v}" for k, v in FAMILIES.items()) + f"); {ELSEWHERE}")
    _refuse_unsupported(raw, path)
    try:
        fields = _fields(raw, kind, path)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]!r}, which a {kind} config needs; download "
                         f"the model's folder again") from None
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:  # TypeError: a flag that is not true or false
        raise type(e)(f"{path} holds an invalid {kind} config: {e}; download the model's "
                      f"folder again") from None


def _refuse_unsupported(raw: dict, path: Path) -> None:
    """The choices of these families that the engine does not have, each named."""
    layers = raw.get("layer_types") or []
    refused = {
        "sliding-window attention (use_sliding_window)": raw.get("use_sliding_window")
        or (isinstance(layers, list) and any(t != "full_attention" for t in layers)),
        "biases on every attention projection (attention_bias)": raw.get("attention_bias"),
        "biases in the MLP (mlp_bias)": raw.get("mlp_bias"),
        f"activation {raw.get('hidden_act')!r} (only silu)": raw.get("hidden_act", "silu")
        != "silu",
        "a quantized checkpoint (quantization_config)": raw.get("quantization_config"),
        "partial rotary embeddings": _rope(raw, path).get("partial_rotary_factor", 1) != 1,
    }
    named = [what for what, present in refused.items() if present]
    if named:
        raise ValueError(f"{path}: {named[0]} is not supported by minikv's engine; {ELSEWHERE}")


def _rope(raw: dict, path: Path) -> dict:
    """RoPE's parameters: transformers 5 writes rope_parameters, earlier versions rope_theta
    and rope_scaling."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: rope_parameters must be a JSON object, not {rope!r:.60}; "
                         f"download the model's folder again")
    return rope


def _fields(raw: dict, kind: str, path: Path) -> dict:
    """GPTConfig's fields from config.json's (a missing required key: a KeyError, named);
    GPTConfig checks their types and values."""
    rope = _rope(raw, path)
    n_embd, n_head = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim")
    plain = type(n_embd) is int and type(n_head) is int and n_head > 0 and n_embd % n_head == 0
    if plain and head_dim == n_embd // n_head:
        head_dim = None  # the usual width: not a choice of its own
    kv = raw.get("num_key_value_heads")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{path}: rope_type {rope_type!r:.40} is not supported (default and "
                         f"llama3 are); {ELSEWHERE}")
    scaling = None if rope_type == "default" else (
        "llama3", rope.get("factor"), rope.get("low_freq_factor"),
        rope.get("high_freq_factor"), rope.get("original_max_position_embeddings"))
    return dict(
        **LLAMA, vocab_size=raw["vocab_size"], block_size=raw["max_position_embeddings"],
        n_layer=raw["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=None if kv == n_head else kv, head_size=head_dim,
        n_inner=raw["intermediate_size"], layer_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        rope_scaling=scaling, tied_head=raw.get("tie_word_embeddings", False),
        qkv_bias=True if kind == "qwen2" else None, qk_norm=kind == "qwen3")


# --- the weights -------------------------------------------------------------------------------

def _weight_files(folder: Path) -> dict[str, set | None]:
    """{safetensors file name: the tensor names the index puts in it (None: no index)}."""
    index = folder / INDEX
    if not index.exists():
        if not (folder / WEIGHTS).is_file():
            raise ValueError(f"{folder} has no {WEIGHTS} or {INDEX}: only safetensors weights "
                             f"are read (a pytorch_model.bin is a pickle, which can run code "
                             f"when loaded); download the model's safetensors files")
        return {WEIGHTS: None}
    fix = f"download the model's folder again ({INDEX} names each tensor's shard)"
    raw = _read_json(index, fix)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ValueError(f"{index} must hold a weight_map of tensor names to file names; {fix}")
    files: dict[str, set] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ValueError(f"{index} names shard {shard!r:.60}: a shard is a .safetensors "
                             f"file in the folder itself; {fix}")
        files.setdefault(shard, set()).add(name)
    return files


def _declared(files: dict, folder: Path) -> dict[str, tuple]:
    """Name -> (shape, dtype) of every tensor, read from the safetensors headers alone."""
    declared: dict[str, tuple] = {}
    for file, names in files.items():
        path = folder / file
        fix = "download the model's folder again"
        if not path.is_file():
            raise ValueError(f"{path} is missing: {INDEX} puts tensors in it; {fix}")
        try:  # safetensors checks the header and each byte range against the file's size
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                for key in keys:
                    piece = f.get_slice(key)
                    dtype = piece.get_dtype()
                    declared[key] = (tuple(piece.get_shape()), _DTYPES.get(dtype, dtype))
        except Exception as e:  # SafetensorError, or whatever a damaged header provokes
            raise ValueError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                             f"{fix}") from None
        if names is not None and set(keys) != names:
            raise ValueError(f"{path} holds other tensors than {INDEX} says it does; {fix}")
    return declared


def hf_shapes(config: GPTConfig, n_layer: int) -> dict[str, tuple]:
    """Name -> shape of every tensor a Hugging Face folder of `config` holds (layer 0's read
    off a one-layer model on the meta device, so a config claiming huge sizes costs nothing)."""
    one = GPTConfig(**{**config.to_dict(), "n_layer": 1})
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in llama_state_dict(GPT(one)).items()}
    out = {}
    for name, shape in shapes.items():
        if ".layers.0." not in name:
            out[name] = shape
        for i in range(n_layer if ".layers.0." in name else 0):
            out[name.replace(".layers.0.", f".layers.{i}.")] = shape
    return out


def _check_declared(declared: dict, config: GPTConfig, folder: Path) -> None:
    fix = f"download the model's folder again (these weights do not fit {CONFIG})"
    layers = {n.split(".")[2] for n in declared if n.startswith("model.layers.")}
    if len(layers) != config.n_layer or not all(
            i.isdigit() and int(i) < config.n_layer for i in layers):
        # checked first, so that a config claiming 10⁹ layers never builds 10⁹ names
        raise ValueError(f"{folder}: the weights hold {len(layers)} layers, {CONFIG} says "
                         f"{config.n_layer}; {fix}")
    want = hf_shapes(config, config.n_layer)
    if config.tied_head and "lm_head.weight" in declared:  # some tools save the tied copy
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    missing, unexpected = sorted(set(want) - set(declared)), sorted(set(declared) - set(want))
    if missing or unexpected:
        raise ValueError(f"{folder}: missing tensors {missing[:4]}, unexpected tensors "
                         f"{unexpected[:4]} for a model of {CONFIG}; {fix}")
    for name, shape in want.items():
        got, dtype = declared[name]
        if got != shape:
            raise ValueError(f"{folder}: tensor {name} has shape {got}, {CONFIG} needs "
                             f"{shape}; {fix}")
        if dtype not in LOADABLE:
            raise ValueError(f"{folder}: tensor {name} is {dtype}; weights must be float32, "
                             f"float16 or bfloat16; a quantized model is not supported: "
                             f"download the unquantized one, or {ELSEWHERE}")


def _read_tensors(files: dict, folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor, as float32 on the CPU, each checked finite."""
    state = {}
    for file in files:
        try:
            with safe_open(str(folder / file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name).float()
                    if not torch.isfinite(state[name]).all():
                        raise ValueError(f"{folder / file}: tensor {name} holds NaN or "
                                         f"infinite values; download the folder again")
        except ValueError:
            raise
        except Exception as e:  # a file changed or damaged since its header was read
            raise ValueError(f"{folder / file} is corrupt or truncated ({type(e).__name__}: "
                             f"{e}); download the model's folder again") from None
    return state


def _tokenizer(folder: Path):
    """The folder's tokenizer.json as a transformers tokenizer, read locally; None without."""
    path = folder / TOKENIZER
    if not path.is_file():
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    try:
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as e:  # the tokenizers library's own errors
        raise ValueError(f"{path} cannot be read as a tokenizer ({type(e).__name__}: {e}); "
                         f"download the model's folder again") from None
