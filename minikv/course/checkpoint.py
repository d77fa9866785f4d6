"""Saving and loading models: safetensors weights + a JSON config, never pickle.

A checkpoint is a directory of three files:

    config.json        GPTConfig.to_dict(): the shapes
    model.safetensors  every weight once (a tied lm_head is wte, so only wte is stored), all
                       float32, or all float16 to halve the file (loaded as float32)
    training.json      how it was made: preset, seed, steps, tokens seen, losses, wall time, ...

The safetensors header holds a SHA-256 over the exact bytes of config.json and training.json and
over every tensor's name, shape, dtype and bytes, so a change to any byte of any of the three files
is caught (a config edit that keeps every shape, say n_head 4 -> 8, included). Loading checks, in
order and before anything large is allocated: that the directory and files exist (and that the JSON
files are no bigger than MAX_JSON_BYTES); the config's keys, types and ranges; every tensor's name,
shape and dtype as the safetensors header declares them, against the shapes the config implies;
then the bytes, the hash and finite values. Anything wrong is a ValueError that names the file and
says how to get a good one. safetensors files hold raw tensor bytes and a JSON header, so loading
one cannot run code, unlike a pickled torch.save file.

Saving refuses what loading would refuse (NaN weights, a column-parallel inference copy) and writes
all three files into a temporary directory that replaces the old checkpoint at once; a Ctrl-C while
the two are swapped is held until the swap is done.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import tiktoken
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine import GPT, GPTConfig
from ..engine.config import GPT2_FIELDS
from ..engine.eagle import FeatureHead
from .device import resolve_device
from .files import check_writable, read_at_most, replace_directory
from .tokenizer import load_tokenizer

CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE = "config.json", "model.safetensors", "training.json"
FORMAT = "minikv-checkpoint-2"  # the header's sha256 covers config.json and training.json too
MODELS_DIR = Path(__file__).parent / "models"
# shipped in minikv/course/models/<name>/, made by `python -m minikv train --ship`
COURSE_MODELS = ("target", "draft", "target-gqa2", "target-mqa", "target-rope", "target-mla",
                 "target-cla2")
# chapter 10's draft on the target's own features (engine/eagle.py), made by
# `python -m minikv train-head --ship`: not a GPT, so not among COURSE_MODELS
FEATURE_HEAD = "feature-head"
# config.json is ~150 bytes and training.json a few KB: a bigger one is not the package's, and is
# refused before it is read (parsing a JSON file takes several times its size in memory)
MAX_JSON_BYTES = 1 << 20
TIED = "lm_head.weight"  # transformer.wte.weight's tensor, unless config.tied_head is False
STORED_DTYPES = (torch.float32, torch.float16)  # a file holds one of them for every tensor


def _tied(name: str, config: GPTConfig) -> bool:
    """Whether `name` is the tied head: wte's tensor under a second name, never stored."""
    return name == TIED and config.tied_head


# --- saving --------------------------------------------------------------------------------------

def save_checkpoint(model: GPT, directory: str | Path, metadata: dict | None = None,
                    dtype: torch.dtype = torch.float32, mark: str | None = None) -> Path:
    """Write config.json, model.safetensors and training.json as `directory`, replacing what was
    there in one step; the weights as `dtype` (float32, or float16: half the bytes, each weight
    rounded to 11 significant bits). Refuses a model that load_checkpoint would refuse.
    `mark`: the command whose output the directory is (files.claim_directory)."""
    directory = Path(directory)
    if type(model) not in (GPT, FeatureHead):
        raise TypeError(f"save_checkpoint saves a minikv.GPT (or a FeatureHead), got "
                        f"{type(model).__name__}")
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype must be one of {STORED_DTYPES}, got {dtype!r}")
    tensors = {name: t.detach().to("cpu", dtype).contiguous()
               for name, t in model.state_dict().items() if not _tied(name, model.config)}
    _check_tensors(tensors, model.config, directory / WEIGHTS_FILE,
                   "save the model it was made from: a column_parallel copy is for inference only",
                   type(model))
    try:
        meta_bytes = (json.dumps(metadata or {}, indent=2, sort_keys=True, allow_nan=False)
                      + "\n").encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"metadata must be a JSON-serialisable dict of finite numbers, "
                         f"strings, lists and dicts: {e}") from None
    if len(meta_bytes) > MAX_JSON_BYTES:  # loading would refuse it
        raise ValueError(f"metadata takes {len(meta_bytes):,} bytes as JSON, more than the "
                         f"{MAX_JSON_BYTES:,} a checkpoint's {METADATA_FILE} can hold: keep "
                         f"summaries in it, not per-step logs")
    config_bytes = (json.dumps(model.config.to_dict(), indent=2) + "\n").encode()
    header = {"format": "pt", "minikv": FORMAT,
              "sha256": checkpoint_sha256(config_bytes, meta_bytes, tensors)}
    check_writable(directory)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=header)
        (tmp / CONFIG_FILE).write_bytes(config_bytes)
        (tmp / METADATA_FILE).write_bytes(meta_bytes)
    replace_directory(directory, fill, mark=mark)
    return directory


def checkpoint_sha256(config_bytes: bytes, meta_bytes: bytes,
                      tensors: dict[str, torch.Tensor]) -> str:
    """A fingerprint of the two JSON files' exact bytes and of every tensor's name, shape, dtype
    and bytes (independent of the safetensors file layout)."""
    h = hashlib.sha256()
    for name, data in ((CONFIG_FILE, config_bytes), (METADATA_FILE, meta_bytes)):
        h.update(f"{name}:{len(data)};".encode() + data)
    return _tensor_hash(tensors, h)


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The fingerprint of the tensors alone (files saved before the config was covered)."""
    return _tensor_hash(tensors, hashlib.sha256())


def _tensor_hash(tensors: dict[str, torch.Tensor], h) -> str:
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --- loading -------------------------------------------------------------------------------------

def _is_course_model(directory: Path) -> bool:
    try:
        return (directory.resolve().parent == MODELS_DIR.resolve()
                and directory.name in (*COURSE_MODELS, FEATURE_HEAD))
    except (OSError, RuntimeError):  # a symlink loop, say
        return False


def _fix(directory: Path) -> str:
    """What to do about a bad checkpoint in `directory`."""
    if _is_course_model(directory):
        retrain = ("train-head" if directory.name == FEATURE_HEAD
                   else f"train --preset {directory.name}")
        return (f"restore it with `git checkout -- minikv/course/models/{directory.name}` "
                f"or retrain it with `python -m minikv {retrain} --ship`")
    return ("save it again with minikv.course.checkpoint.save_checkpoint, "
            "or retrain with `python -m minikv train`")


def _read_bytes(directory: Path, name: str, required: bool = True) -> bytes | None:
    path = directory / name
    if not path.exists():  # a directory or a pipe in its place is an error, not "absent"
        if not required:
            return None
        raise ValueError(f"{path} is missing: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                         f"{_fix(directory)}")
    return read_at_most(path, MAX_JSON_BYTES, "checkpoint file", _fix(directory))


def _parse_json(data: bytes, path: Path, directory: Path):
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a 5000-digit int, [[[[...
        raise ValueError(f"{path} is not valid JSON ({e}); {_fix(directory)}") from None


def read_config(directory: str | Path) -> GPTConfig:
    """The GPTConfig in `directory`/config.json, validated (keys, types and ranges)."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    raw = _parse_json(_read_bytes(directory, CONFIG_FILE), path, directory)
    expected = {f.name for f in fields(GPTConfig)}
    optional = expected - set(GPT2_FIELDS)  # absent: as in GPT-2 (one K/V head per head, ...)
    if not isinstance(raw, dict) or not expected - optional <= set(raw) <= expected:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path} must hold exactly the GPTConfig keys "
                         f"{sorted(expected - optional)} (and optionally {sorted(optional)}), "
                         f"got {got}; {_fix(directory)}")
    try:
        return GPTConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} holds an invalid config: {e}; {_fix(directory)}") from None


def read_metadata(directory: str | Path) -> dict:
    """training.json: how the checkpoint was made ({} when absent)."""
    directory = Path(directory)
    data = _read_bytes(directory, METADATA_FILE, required=False)
    if data is None:
        return {}
    meta = _parse_json(data, directory / METADATA_FILE, directory)
    if not isinstance(meta, dict):
        raise ValueError(f"{directory / METADATA_FILE} must hold a JSON object; {_fix(directory)}")
    return meta


def expected_shapes(config: GPTConfig, layers: int | None = None,
                    kind: type = GPT) -> dict[str, tuple]:
    """Name -> shape of every stored tensor of a `kind` (a GPT, or a FeatureHead) with
    `config`, read off a model of one group of layers built on the meta device (no memory):
    block j's shapes repeat for every layer i = j mod layers_per_kv (cross-layer attention:
    the upper layers of a group make no K/V; one group of one layer otherwise)."""
    n = config.n_layer if layers is None else layers
    group = min(config.layers_per_kv, n)
    one = GPTConfig(**{**config.to_dict(), "n_layer": group})
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in kind(one).state_dict().items()
                  if not _tied(n, config)}
    out = {}
    for name, shape in shapes.items():
        if name.startswith("transformer.h."):
            j = int(name.split(".")[2])
            for i in range(j, n, group):
                out[name.replace(f".h.{j}.", f".h.{i}.", 1)] = shape
        else:
            out[name] = shape
    return out


def _check_tensors(declared: dict, config: GPTConfig, path: Path, fix: str,
                   kind: type = GPT) -> None:
    """Names, shapes and dtypes (`declared` maps name -> a tensor or (shape, dtype)) of a
    `kind` against `config`, without allocating anything the size of the model."""
    def shape_dtype(v):
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
    layers = {n.split(".")[2] for n in declared if n.startswith("transformer.h.")}
    every_layer = len(layers) == config.n_layer and all(
        i.isdigit() and int(i) < config.n_layer for i in layers)  # never builds range(n_layer)
    if not every_layer:
        # checked first, so that a config claiming 10⁹ layers never builds 10⁹ names
        extra = sorted(n for n in declared if n.startswith("transformer.h.")
                       and not (n.split(".")[2].isdigit()
                                and int(n.split(".")[2]) < config.n_layer))
        raise ValueError(f"{path} does not match {CONFIG_FILE} ({config}): it holds "
                         f"{len(layers)} layers, the config says {config.n_layer}"
                         + (f"; unexpected tensors {extra[:4]}" if extra else "")
                         + f"; {fix}")
    want = expected_shapes(config, kind=kind)
    dtypes = Counter(shape_dtype(v)[1] for v in declared.values()).most_common()
    stored = dtypes[0][0] if dtypes and dtypes[0][0] in STORED_DTYPES else torch.float32
    missing, unexpected = sorted(set(want) - set(declared)), sorted(set(declared) - set(want))
    if missing or unexpected:
        raise ValueError(f"{path} does not match {CONFIG_FILE} ({config}): "
                         f"missing tensors {missing[:4]}, unexpected tensors {unexpected[:4]}; "
                         f"{fix}")
    for name, shape in want.items():
        got_shape, dtype = shape_dtype(declared[name])
        if got_shape != shape:
            raise ValueError(f"{path}: tensor {name} has shape {got_shape} but {CONFIG_FILE} "
                             f"needs {shape}; {fix}")
        if dtype != stored:
            raise ValueError(f"{path}: tensor {name} is {dtype}, expected {stored} (as most "
                             f"tensors are: a file holds float32 or float16 only); {fix}")
    for name, value in declared.items():
        if isinstance(value, torch.Tensor) and not torch.isfinite(value).all():
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; {fix}")


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}


def read_weights(directory: str | Path, config: GPTConfig | None = None,
                 kind: type = GPT) -> dict[str, torch.Tensor]:
    """The tensors in `directory`/model.safetensors, on the CPU. With `config`, their declared
    names, shapes and dtypes are checked against it before any tensor is read; then their bytes,
    the header's sha256 (when the file has one: other tools' files may not) and finite values.
    Never unpickles."""
    directory = Path(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                         f"{_fix(directory)}")
    try:  # safetensors checks the header and every tensor's byte range against the file size
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            if config is not None:
                declared = {}
                for name in f.keys():
                    piece = f.get_slice(name)
                    declared[name] = (tuple(piece.get_shape()),
                                      _DTYPES.get(piece.get_dtype(), piece.get_dtype()))
                _check_tensors(declared, config, path, _fix(directory), kind)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except ValueError:
        raise
    except Exception as e:  # SafetensorError, or whatever a damaged header provokes
        raise ValueError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                         f"{_fix(directory)}") from None
    if header.get("minikv") == FORMAT:
        config_bytes = _read_bytes(directory, CONFIG_FILE)
        meta_bytes = _read_bytes(directory, METADATA_FILE, required=False) or b""
        actual = checkpoint_sha256(config_bytes, meta_bytes, tensors)
        if actual != header.get("sha256"):
            raise ValueError(f"{directory} is corrupt: {CONFIG_FILE}, {METADATA_FILE} and the "
                             f"tensors do not match the sha256 saved with them; {_fix(directory)}")
    elif _is_course_model(directory):
        raise ValueError(f"{path} has no {FORMAT} sha256 in its header, so it is not the shipped "
                         f"file; {_fix(directory)}")
    elif "sha256" in header and tensors_sha256(tensors) != header["sha256"]:
        # a checkpoint saved before the hash covered the config: its tensors can still be checked
        raise ValueError(f"{path} is corrupt: its tensors do not match the sha256 saved with them; "
                         f"{_fix(directory)}")
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; "
                             f"{_fix(directory)}")
    return tensors


def load_checkpoint(directory: str | Path, device: str | torch.device | None = None,
                    kind: type = GPT) -> GPT:
    """The GPT (or the `kind`: a FeatureHead) saved in `directory`, in eval mode on `device`
    (default: minikv.default_device())."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or Path), not {type(directory).__name__}")
    directory = Path(directory)
    try:
        exists, is_dir = directory.exists(), directory.is_dir()
    except OSError as e:  # a symlink loop, a name too long, ...
        raise ValueError(f"cannot read checkpoint directory {directory} ({e.strerror}); "
                         f"{_fix(directory)}") from None
    if not exists:
        raise ValueError(f"checkpoint directory {directory} does not exist; {_fix(directory)}")
    if not is_dir:
        raise ValueError(f"{directory} is a file, not a checkpoint directory (one holding "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}); pass the directory")
    config = read_config(directory)
    read_metadata(directory)
    tensors = read_weights(directory, config, kind)
    device = resolve_device(device)
    # building the model draws random init: keep the caller's RNG as it was
    with torch.random.fork_rng(devices=[]):
        model = kind(config)
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if not _tied(name, config):
                target.copy_(tensors[name])  # a tied lm_head.weight is wte's: filled too
    return model.to(device).eval()


def load_course_model(name: str = "target", device: str | torch.device | None = None
                      ) -> tuple[GPT, tiktoken.Encoding]:
    """A shipped course model and its tokenizer: "target" (the model the course studies), "draft"
    (a much cheaper one with the same tokenizer, for speculative decoding), or the target's
    grouped-query variants "target-gqa2" (2 K/V heads) and "target-mqa" (1), chapter 07's; or
    "target-rope", the target's shape with a Llama-style block (rotary positions, RMSNorm,
    SwiGLU), chapter 08's."""
    if name not in COURSE_MODELS:
        raise ValueError(f"unknown course model {name!r}; "
                         f"valid names: {', '.join(map(repr, COURSE_MODELS))}")
    model = load_checkpoint(MODELS_DIR / name, device)
    tok = load_tokenizer()
    if model.config.vocab_size != tok.n_vocab:
        raise ValueError(f"course model {name!r} has vocab_size {model.config.vocab_size} "
                         f"but the course tokenizer has {tok.n_vocab} ids; "
                         f"{_fix(MODELS_DIR / name)}")
    return model, tok


def load_feature_head(target: GPT | None = None, device: str | torch.device | None = None
                      ) -> FeatureHead:
    """Chapter 10's shipped FeatureHead, trained on the course target's features; checked to
    fit `target` (the shipped one when None). On `target`'s device when one is given."""
    config = read_config(MODELS_DIR / "target") if target is None else target.config
    directory = MODELS_DIR / FEATURE_HEAD
    if read_config(directory) != replace(config, n_layer=1):
        raise ValueError(f"the shipped feature head was trained for the course target "
                         f"({read_config(directory)}), not for a model of {config}")
    return load_checkpoint(directory, target.device if target is not None else device,
                           FeatureHead)
