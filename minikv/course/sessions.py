"""A conversation's K/V on disk: `save_session` writes a Session's history and the K/V the
engine's radix tree holds for it to one safetensors file; `load_session` puts them in
another engine's tree (another process's, on the same model) and gives back a Session
that goes on with the tokens the saved one would have given.

The file: tensors `tokens` (the history), `starts` (where each turn began), `keys` and
`values` (cache layers, heads, positions, width: GPTConfig.kv_shape; the tree's positions);
a header naming the format, the model's config and a fingerprint of its weights (K/V
are only worth anything to the weights that computed them), and a SHA-256 over all of
it. Loading checks the header, then every tensor's declared shape and dtype against the
model, before a byte of a tensor is read or a block allocated; then the hash.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..engine.radix import RadixTree
from ..engine.serving import Engine
from ..engine.session import Session
from .checkpoint import _tensor_hash, tensors_sha256
from .files import write_atomically

FORMAT = "minikv-session-1"
FIX = "save the session again with minikv.course.sessions.save_session"


def _tree(engine: Engine) -> RadixTree:
    tree = engine.scheduler.prefix
    if not isinstance(tree, RadixTree):
        raise TypeError("sessions are saved from and loaded into an engine with a radix tree: "
                        "Engine(model, num_blocks, prefix_caching=Radix())")
    return tree


def _header(model, tensors: dict) -> dict:
    """The format, the model (its config, its weights' fingerprint) and a SHA-256 over
    them and every tensor."""
    config = json.dumps(model.config.to_dict(), sort_keys=True)  # a new default field: same
    weights = tensors_sha256(model.state_dict())
    h = hashlib.sha256(f"{FORMAT}|{config}|{weights}".encode())
    return {"minikv": FORMAT, "config": config, "model": weights,
            "sha256": _tensor_hash(tensors, h)}


def save_session(session: Session, path: str | Path) -> Path:
    """Write `session` (its history and the K/V the tree holds for it) to `path`, whole or
    not at all. An existing file is replaced only if it is a saved session."""
    if not isinstance(session, Session):
        raise TypeError(f"save_session takes a minikv Session, not {session!r:.30}")
    path = Path(path)
    if path.exists() and (not path.is_file() or _format(path) != FORMAT):
        raise ValueError(f"{path} exists and is not a saved session: give a new file's path")
    tree, model = _tree(session.engine), session.engine.model
    _, keys, values = tree.export(session.history)
    tensors = {"tokens": torch.tensor(session.history, dtype=torch.long),
               "starts": torch.tensor(session.starts, dtype=torch.long),
               "keys": keys.contiguous(), "values": values.contiguous()}
    return write_atomically(path, save(tensors, metadata=_header(model, tensors)))


def _format(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("minikv")
    except Exception:
        return None


def load_session(engine: Engine, path: str | Path) -> Session:
    """The session saved at `path`, its K/V in `engine`'s radix tree (evicting what the
    tree can let go of to make room); a ValueError naming what is wrong, before anything
    is allocated, for a file that is not a session of this model."""
    tree, model = _tree(engine), engine.model
    cfg, path = model.config, Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file; {FIX}")
    try:  # safetensors checks the header and each tensor's byte range against the file
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            if header.get("minikv") != FORMAT:
                raise ValueError(f"{path} is not a saved session ({FORMAT}); {FIX}")
            if header.get("config") != json.dumps(cfg.to_dict(), sort_keys=True):
                raise ValueError(f"{path} was saved from another model's config: load it "
                                 "into an engine on the model that computed it")
            declared = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                        for k in f.keys()}
            _check_declared(declared, cfg, model.dtype, path)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except ValueError:
        raise
    except Exception as e:  # SafetensorError, or what a damaged header provokes
        raise ValueError(f"{path} is corrupt or truncated ({type(e).__name__}); {FIX}") from None
    if header != _header(model, tensors):
        raise ValueError(f"{path} does not match its sha256, or was computed by other "
                         f"weights; {FIX}")
    tokens, starts = tensors["tokens"].tolist(), tensors["starts"].tolist()
    if any(not 0 <= t < cfg.vocab_size for t in tokens) or starts != sorted(starts) or any(
            not 0 <= s < len(tokens) for s in starts):
        raise ValueError(f"{path} holds token ids or turns that do not fit the model; {FIX}")
    n = tensors["keys"].shape[2]
    tree.restore(tokens[:n], tensors["keys"], tensors["values"])
    return Session(engine, tokens, starts)


_DTYPE_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
                torch.bfloat16: "BF16"}


def _check_declared(declared: dict, cfg, dtype, path: Path) -> None:
    """The four tensors with the shapes and dtypes a session of this model has."""
    if set(declared) != {"tokens", "starts", "keys", "values"}:
        raise ValueError(f"{path} holds tensors {sorted(declared)}, not a session's; {FIX}")
    (t,), t_dtype = declared["tokens"]
    if t_dtype != "I64" or declared["starts"][1] != "I64" or len(declared["starts"][0]) != 1:
        raise ValueError(f"{path}: tokens and starts must be int64 vectors; {FIX}")
    if not 0 < t <= cfg.block_size:
        raise ValueError(f"{path} holds {t} positions; the model's context is "
                         f"{cfg.block_size}; {FIX}")
    heads, key_dim, value_dim = cfg.kv_shape  # MLA: one latent, no values
    for name, width in (("keys", key_dim), ("values", value_dim)):
        shape, kind = declared[name]
        if (len(shape) != 4 or shape[:2] != (cfg.kv_layers, heads)
                or shape[3] != width or not shape[2] <= t
                or kind != _DTYPE_NAMES.get(dtype)):
            raise ValueError(f"{path}: {name} is {shape} {kind}; this model's are (layers="
                             f"{cfg.kv_layers}, heads={heads}, <= {t}, width={width}) "
                             f"{_DTYPE_NAMES.get(dtype)}; {FIX}")
