"""Saving and loading models: safetensors weights + a JSON config, never pickle.

A checkpoint is a directory of three files:

    config.json        GPTConfig.to_dict(): the shapes
    model.safetensors  every weight once, float32 (lm_head is tied to wte, so only wte is stored)
    training.json      how it was made: preset, seed, steps, tokens seen, losses, wall time, ...

Loading checks everything before building the model: config keys and values, exactly the
expected tensor names, their shapes and dtype, finite values, and a SHA-256 of the tensor bytes
that save_checkpoint stores in the safetensors header (so a flipped bit in the data is caught
too). Anything wrong is a ValueError that names the file and says how to get a good one; a
truncated or corrupt file is one too. safetensors files hold raw tensor bytes and a JSON header,
so loading one cannot run code, unlike a pickled torch.save file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path

import tiktoken
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine import GPT, GPTConfig
from .device import resolve_device
from .tokenizer import load_tokenizer

CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE = "config.json", "model.safetensors", "training.json"
MODELS_DIR = Path(__file__).parent / "models"
# shipped in minikv/course/models/<name>/, made by `python -m minikv train`
COURSE_MODELS = ("target", "draft")
TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight


def save_checkpoint(model: GPT, directory: str | Path, metadata: dict | None = None) -> Path:
    """Write config.json, model.safetensors and training.json into `directory` (created if
    needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in model.state_dict().items() if name != TIED}
    header = {"format": "pt", "sha256": tensors_sha256(tensors)}
    _write(directory / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata=header))
    _write(directory / CONFIG_FILE,
           lambda tmp: Path(tmp).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n"))
    _write(directory / METADATA_FILE,
           lambda tmp: Path(tmp).write_text(json.dumps(metadata or {}, indent=2, sort_keys=True)
                                            + "\n"))
    return directory


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A fingerprint of names, shapes, dtypes and bytes, independent of the file layout."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _write(path: Path, writer) -> None:
    """Write to a temporary name, then rename: an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    writer(str(tmp))
    os.replace(tmp, path)


def _fix(directory: Path) -> str:
    """What to do about a bad checkpoint in `directory`."""
    if directory.resolve().parent == MODELS_DIR.resolve() and directory.name in COURSE_MODELS:
        return (f"restore it with `git checkout -- minikv/course/models/{directory.name}` "
                f"or retrain it with `python -m minikv train --preset {directory.name}`")
    return ("save it again with minikv.checkpoint.save_checkpoint, "
            "or retrain with `python -m minikv train`")


def read_config(directory: str | Path) -> GPTConfig:
    """The GPTConfig in `directory`/config.json, validated."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                         f"{_fix(directory)}")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {_fix(directory)}") from None
    expected = {f.name for f in fields(GPTConfig)}
    if not isinstance(raw, dict) or set(raw) != expected:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path} must hold exactly the GPTConfig keys {sorted(expected)}, "
                         f"got {got}; {_fix(directory)}")
    try:
        return GPTConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} holds an invalid config: {e}; {_fix(directory)}") from None


def read_metadata(directory: str | Path) -> dict:
    """training.json: how the checkpoint was made ({} when absent)."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {_fix(Path(directory))}") from None


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors in `directory`/model.safetensors, on the CPU, their bytes checked against the
    header's sha256 when it has one (files written by other tools may not). Never unpickles."""
    directory = Path(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                         f"{_fix(directory)}")
    try:  # safetensors checks the header and every tensor's byte range against the file size
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            expected_sha = (f.metadata() or {}).get("sha256")
    except Exception as e:  # SafetensorError, or whatever a damaged header provokes
        raise ValueError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                         f"{_fix(directory)}") from None
    if expected_sha is not None and tensors_sha256(tensors) != expected_sha:
        raise ValueError(f"{path} is corrupt: its tensors do not match the sha256 saved with them; "
                         f"{_fix(directory)}")
    return tensors


def load_checkpoint(directory: str | Path, device: str | torch.device | None = None) -> GPT:
    """The GPT saved in `directory`, in eval mode on `device` (default: minikv.default_device())."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist; {_fix(directory)}")
    config = read_config(directory)
    tensors = read_weights(directory)
    device = resolve_device(device)
    path = directory / WEIGHTS_FILE
    # building the model draws random init: keep the caller's RNG as it was
    with torch.random.fork_rng(devices=[]):
        model = GPT(config)
    expected = {name: t for name, t in model.state_dict().items() if name != TIED}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path} does not match {CONFIG_FILE} ({config}): "
                         f"missing tensors {missing[:4]}, "
                         f"unexpected tensors {unexpected[:4]}; {_fix(directory)}")
    for name, target in expected.items():
        t = tensors[name]
        if t.shape != target.shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(t.shape)} "
                             f"but {CONFIG_FILE} needs {tuple(target.shape)}; {_fix(directory)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{path}: tensor {name} is {t.dtype}, expected torch.float32; "
                             f"{_fix(directory)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; "
                             f"{_fix(directory)}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])  # lm_head.weight is wte's tensor, so it is filled too
    return model.to(device).eval()


def load_course_model(name: str = "target", device: str | torch.device | None = None
                      ) -> tuple[GPT, tiktoken.Encoding]:
    """A shipped course model and its tokenizer: "target" (the model the course studies) or "draft"
    (a much cheaper one with the same tokenizer, for speculative decoding)."""
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
