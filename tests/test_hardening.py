"""The contract, for every input: a clear error that says what to do, and caches, models and files
left as they were. One table of bad inputs across the public API, the command line, checkpoints
and the tokenizer asset; then faults (interrupts, tampered files, a memory-bomb config) and
threads sharing a model."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minikv
from minikv.bench.parallel import column_parallel
from minikv.course import checkpoint, tokenizer
from minikv.course.checkpoint import (
    CONFIG_FILE,
    METADATA_FILE,
    WEIGHTS_FILE,
    load_checkpoint,
    save_checkpoint,
)
from minikv.course.files import mark_directory
from minikv.engine.attention import window_attention

from conftest import cli_exit, varied_model

ROOT = Path(__file__).resolve().parent.parent


class Env:
    """What a bad call could damage: a model, a caller's cache, a saved checkpoint."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.model = varied_model()                                  # tiny: vocab 512, block 256
        self.draft = varied_model(seed=1)
        self.cache = minikv.KVCache.for_model(self.model, max_len=10)
        with torch.no_grad():
            self.model(torch.tensor([[1, 2, 3, 4]]), cache=self.cache)
        self.ckpt = save_checkpoint(self.model, tmp_path / "ckpt", {"preset": "tiny"})
        self.before = self.state()

    def state(self):
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(self.ckpt.iterdir())}
        return ({k: v.clone() for k, v in self.model.state_dict().items()},
                self.cache.get_seq_length(),
                [t.clone() for t in self.cache.keys + self.cache.values], files)

    def assert_unchanged(self):
        params, length, tensors, files = self.before
        now_params, now_length, now_tensors, now_files = self.state()
        assert now_length == length, "the cache's length changed"
        assert all(torch.equal(a, b) for a, b in zip(tensors, now_tensors)), "cache changed"
        assert all(torch.equal(params[k], now_params[k]) for k in params), "model changed"
        assert now_files == files, "the checkpoint's files changed"

    # helpers for rows
    def gen(self, ids=(5, 6), n=2, **kw):
        return minikv.generate(self.model, list(ids) if isinstance(ids, tuple) else ids, n, **kw)

    def spec(self, n=4, **kw):
        return minikv.speculative_generate(self.model, self.draft, [1, 2], n, **kw)

    def serve(self, *requests, **kw):
        return minikv.serve(self.model, list(requests) or [minikv.Request([1, 2], 3)], **kw)

    def edited_ckpt(self, edit_config=None, edit_meta=None, edit_weights=None) -> Path:
        """A copy of the checkpoint with one file edited (the original is never touched)."""
        copy = self.tmp / f"edited-{len(list(self.tmp.iterdir()))}"
        copy.mkdir()
        for p in self.ckpt.iterdir():
            (copy / p.name).write_bytes(p.read_bytes())
        if edit_config:
            config = json.loads((copy / CONFIG_FILE).read_text())
            edit_config(config)
            (copy / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if edit_meta:
            (copy / METADATA_FILE).write_text(edit_meta((copy / METADATA_FILE).read_text()))
        if edit_weights:
            tensors = load_file(str(copy / WEIGHTS_FILE))
            edit_weights(tensors)
            save_file(tensors, str(copy / WEIGHTS_FILE))
        return copy


def cfg(**kw):
    return minikv.GPTConfig(**{**minikv.PRESETS["tiny"], **kw})


def tensor_ids(*rows):
    return torch.tensor(rows)


def req(**kw):
    return minikv.Request(**{"prompt": [1, 2], "max_new_tokens": 3, **kw})


def fwd(env, idx, **kw):
    with torch.no_grad():
        return env.model(idx, cache=env.cache, **kw)


def set_(config, key, value):
    config[key] = value


def run_cli(*args):
    """Exit 2 expected: its stderr raised as a ValueError, so the table matches the message
    like any other row."""
    code, err = cli_exit(*args)
    if code not in (2,):
        raise AssertionError(f"exit code {code}, expected 2; stderr: {err}")
    raise ValueError(err)


E = Env
V, T = ValueError, TypeError
# (id, call(env), error type, fragment of the message that says what to do)
ROWS = [
    # --- GPTConfig ------------------------------------------------------------------------------
    ("config n_layer 0", lambda e: cfg(n_layer=0), V, "n_layer must be a positive int"),
    ("config n_layer negative", lambda e: cfg(n_layer=-1), V, "n_layer must be a positive int"),
    ("config n_layer bool", lambda e: cfg(n_layer=True), V, "n_layer must be a positive int"),
    ("config n_layer float", lambda e: cfg(n_layer=1.5), V, "n_layer must be a positive int"),
    ("config n_layer str", lambda e: cfg(n_layer="2"), V, "n_layer must be a positive int"),
    ("config vocab 0", lambda e: cfg(vocab_size=0), V, "vocab_size must be a positive int"),
    ("config indivisible heads", lambda e: cfg(n_head=3), V, "pick an n_head that divides it"),
    ("config eps nan", lambda e: cfg(layer_norm_eps=float("nan")), V, r"eps must be a number in"),
    ("config eps 0", lambda e: cfg(layer_norm_eps=0.0), V, r"eps must be a number in"),
    ("config eps str", lambda e: cfg(layer_norm_eps="1e-5"), V, r"eps must be a number in"),
    ("config eps None", lambda e: cfg(layer_norm_eps=None), V, r"eps must be a number in"),
    ("unknown preset", lambda e: minikv.GPTConfig.preset("gpt5"), V, "preset must be one of"),
    # --- GPT.forward ----------------------------------------------------------------------------
    ("forward float ids", lambda e: fwd(e, torch.tensor([[1.0]])), T, "integer tensor"),
    ("forward bool ids", lambda e: fwd(e, torch.tensor([[True]])), T, "integer tensor"),
    ("forward list ids", lambda e: fwd(e, [[1, 2]]), T, "integer tensor"),
    ("forward 1-D ids", lambda e: fwd(e, torch.tensor([1, 2])), V, r"idx\[None\]"),
    ("forward empty", lambda e: fwd(e, torch.zeros(1, 0, dtype=torch.long)), V, "T >= 1"),
    ("forward out of vocab", lambda e: fwd(e, tensor_ids([1, 512])), V, "model's own tokenizer"),
    ("forward negative id", lambda e: fwd(e, tensor_ids([-1])), V, "model's own tokenizer"),
    ("forward batch mismatch", lambda e: fwd(e, tensor_ids([1], [2])), V, "batch_size=2"),
    ("forward overflow", lambda e: fwd(e, tensor_ids([1] * 7)), V, "larger max_len"),
    ("forward positions shape", lambda e: fwd(e, tensor_ids([1]), positions=torch.tensor([0, 1])),
     V, "positions must be"),
    ("forward positions float", lambda e: fwd(e, tensor_ids([1]), positions=torch.tensor([1.0])),
     V, "positions must be"),
    ("forward positions past block", lambda e: fwd(e, tensor_ids([1]),
                                                    positions=torch.tensor([256])),
     V, "positions must be"),
    ("forward not a cache", lambda e: e.model(tensor_ids([1]), cache={"k": 1}), T,
     "must be a minikv.KVCache"),
    ("forward cache dtype", lambda e: e.model(tensor_ids([1]), cache=minikv.KVCache(
        2, 1, 4, 16, 8, dtype=torch.float64)), V, "KVCache.for_model"),
    ("forward cache shape", lambda e: e.model(tensor_ids([1]), cache=minikv.KVCache(
        3, 1, 4, 16, 8)), V, "KVCache.for_model"),
    ("forward past block_size", lambda e: e.model(torch.ones(1, 257, dtype=torch.long)), V,
     "shorten the prompt"),
    # --- KVCache --------------------------------------------------------------------------------
    ("cache batch 0", lambda e: minikv.KVCache(2, 0, 4, 16, 8), V, "batch_size must be a positive"),
    ("cache max_len float", lambda e: minikv.KVCache(2, 1, 4, 16, 8.0), V, "max_len must be"),
    ("cache heads bool", lambda e: minikv.KVCache(2, 1, True, 16, 8), V, "n_head must be"),
    ("for_model past block", lambda e: minikv.KVCache.for_model(e.model, max_len=300), V,
     r"max_len must be an int in \[1, 257\)"),
    ("for_model batch 0", lambda e: minikv.KVCache.for_model(e.model, batch_size=0), V,
     "batch_size must be"),
    ("crop negative", lambda e: e.cache.crop(-1), V, r"crop length must be an int in \[0, 5\)"),
    ("crop longer", lambda e: e.cache.crop(5), V, r"crop length must be an int in \[0, 5\)"),
    ("crop float", lambda e: e.cache.crop(2.0), V, "crop length must be an int"),
    ("crop bool", lambda e: e.cache.crop(True), V, "crop length must be an int"),
    ("crop str", lambda e: e.cache.crop("3"), V, "crop length must be an int"),
    ("update wrong shape", lambda e: e.cache.update(torch.zeros(1, 4, 1, 8), torch.zeros(
        1, 4, 1, 8), 0), V, "key and value must be"),
    ("update wrong dtype", lambda e: e.cache.update(torch.zeros(1, 4, 1, 16).double(),
                                                    torch.zeros(1, 4, 1, 16).double(), 0),
     V, "key and value must be"),
    ("update layer out of range", lambda e: e.cache.update(torch.zeros(1, 4, 1, 16), torch.zeros(
        1, 4, 1, 16), 5), V, r"layer_idx must be an int in \[0, 2\)"),
    ("update overflow", lambda e: e.cache.update(torch.zeros(1, 4, 7, 16), torch.zeros(
        1, 4, 7, 16), 0), V, "larger max_len"),
    # --- generate -------------------------------------------------------------------------------
    ("gen empty prompt", lambda e: e.gen([]), V, "prompt is empty"),
    ("gen text prompt", lambda e: e.gen("The color"), T, "encode it first"),
    ("gen None prompt", lambda e: e.gen(None), T, "token ids must be a list.*not NoneType"),
    ("gen float ids", lambda e: e.gen([1.5]), T, "token ids must be ints"),
    ("gen batch of prompts", lambda e: e.gen(torch.ones(2, 3, dtype=torch.long)), V,
     "one sequence at a time"),
    ("gen out of vocab", lambda e: e.gen([9999]), V, "model's own tokenizer"),
    ("gen negative n", lambda e: e.gen(n=-1), V, "max_new_tokens must be an int >= 0"),
    ("gen bool n", lambda e: e.gen(n=True), V, "max_new_tokens must be an int >= 0"),
    ("gen float n", lambda e: e.gen(n=1.5), V, "max_new_tokens must be an int >= 0"),
    ("gen unknown mode", lambda e: e.gen(mode="paged"), V, "mode must be one of"),
    ("gen temperature negative", lambda e: e.gen(temperature=-0.5), V, "0 .greedy. or a number"),
    ("gen temperature nan", lambda e: e.gen(temperature=float("nan")), V, "0 .greedy."),
    ("gen temperature inf", lambda e: e.gen(temperature=float("inf")), V, "0 .greedy."),
    ("gen temperature tiny", lambda e: e.gen(temperature=1e-45), V, "0 .greedy. or a number >="),
    ("gen temperature str", lambda e: e.gen(temperature="hot"), V, "0 .greedy."),
    ("gen temperature bool", lambda e: e.gen(temperature=True), V, "0 .greedy."),
    ("gen top_k 0", lambda e: e.gen(top_k=0), V, "top_k must be a positive int or None"),
    ("gen top_k float", lambda e: e.gen(top_k=1.5), V, "top_k must be"),
    ("gen seed None", lambda e: e.gen(seed=None), V, r"seed must be an int in \[0, 2\*\*63\)"),
    ("gen seed str", lambda e: e.gen(seed="a"), V, "seed must be an int"),
    ("gen seed float", lambda e: e.gen(seed=1.5), V, "seed must be an int"),
    ("gen seed huge", lambda e: e.gen(seed=2**70), V, "seed must be an int"),
    ("gen seed negative", lambda e: e.gen(seed=-1), V, "seed must be an int"),
    ("gen eos huge", lambda e: e.gen(eos_id=10**6), V, r"eos_id must be an int in \[0, 512\)"),
    ("gen eos negative", lambda e: e.gen(eos_id=-5), V, "eos_id must be"),
    ("gen eos bool", lambda e: e.gen(eos_id=True), V, "eos_id must be"),
    ("gen eos str", lambda e: e.gen(eos_id="x"), V, "eos_id must be"),
    ("gen cache too short", lambda e: e.gen(n=6, cache=e.cache), V, "use a larger cache"),
    ("gen naive with cache", lambda e: e.gen(mode="naive", cache=e.cache), V,
     "only applies to mode='cached'"),
    ("gen past block", lambda e: e.gen([1] * 250, n=10), V, "lower max_new_tokens"),
    # --- speculative_generate -------------------------------------------------------------------
    ("spec gamma 0", lambda e: e.spec(gamma=0), V, "gamma must be a positive int"),
    ("spec gamma float", lambda e: e.spec(gamma=2.5), V, "gamma must be a positive int"),
    ("spec gamma 100", lambda e: e.spec(gamma=300), V, "lower max_new_tokens or gamma"),
    ("spec max_gamma below gamma", lambda e: e.spec(gamma=3, adaptive_gamma=True, max_gamma=1), V,
     "max_gamma must be an int >= 3"),
    ("spec other vocabulary", lambda e: minikv.speculative_generate(
        e.model, varied_model("small"), [1], 3), V, "the target's tokenizer"),
    ("spec temperature", lambda e: e.spec(temperature=-1.0), V, "0 .greedy."),
    ("spec eos", lambda e: e.spec(eos_id=512), V, "eos_id must be"),
    ("spec n negative", lambda e: e.spec(n=-2), V, "max_new_tokens must be an int >= 0"),
    # --- serve ----------------------------------------------------------------------------------
    ("serve window 0", lambda e: e.serve(replay_window=0), V, "window must be a positive"),
    ("serve window bool", lambda e: e.serve(replay_window=True), V, "window must be a positive"),
    ("serve no requests", lambda e: minikv.serve(e.model, []), V, "no requests"),
    ("serve empty generator", lambda e: minikv.serve(e.model, (r for r in [])), V, "no requests"),
    ("serve empty prompt", lambda e: e.serve(req(prompt=[])), V, "prompt is empty"),
    ("serve text prompt", lambda e: e.serve(req(prompt="hi")), T, "encode it first"),
    ("serve long tensor prompt", lambda e: e.serve(req(prompt=torch.ones(1, 250, dtype=torch.long),
                                                       max_new_tokens=10)),
     V, "lower max_new_tokens"),
    ("serve n 0", lambda e: e.serve(req(max_new_tokens=0)), V, "max_new_tokens must be"),
    ("serve n bool", lambda e: e.serve(req(max_new_tokens=True)), V, "max_new_tokens must be"),
    ("serve temperature", lambda e: e.serve(req(temperature=-1)), V, "0 .greedy."),
    ("serve eos bool", lambda e: e.serve(req(eos_id=True)), V, "eos_id must be"),
    ("serve eos negative", lambda e: e.serve(req(eos_id=-5)), V, "eos_id must be"),
    ("serve eos huge", lambda e: e.serve(req(eos_id=10**6)), V,
     r"eos_id must be an int in \[0, 512\)"),
    ("serve eos str", lambda e: e.serve(req(eos_id="x")), V, "eos_id must be"),
    ("serve seed str", lambda e: e.serve(req(seed="x")), V, "seed must be an int"),
    ("serve top_k 0", lambda e: e.serve(req(top_k=0)), V, "top_k must be"),
    # --- checkpoints ----------------------------------------------------------------------------
    ("ckpt missing dir", lambda e: load_checkpoint(e.tmp / "nowhere"), V, "does not exist"),
    ("ckpt path is a file", lambda e: load_checkpoint(e.ckpt / CONFIG_FILE), V,
     "is a file, not a checkpoint directory"),
    ("ckpt n_head changed", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "n_head", 8))), V, "do not match the sha256"),
    ("ckpt eps changed", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "layer_norm_eps", 1e-3))), V, "do not match the sha256"),
    ("ckpt eps nan", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "layer_norm_eps", float("nan")))), V, "invalid config"),
    ("ckpt field str", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "n_embd", "64"))), V, "invalid config"),
    ("ckpt field bool", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "n_layer", True))), V, "invalid config"),
    ("ckpt memory bomb layers", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "n_layer", 10**9))), V, "the config says 1000000000"),
    ("ckpt memory bomb vocab", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "vocab_size", 10**12))), V, "needs \\(1000000000000, 64\\)"),
    ("ckpt extra key", lambda e: load_checkpoint(e.edited_ckpt(
        lambda c: set_(c, "rope", True))), V, "exactly the GPTConfig keys"),
    ("ckpt metadata edited", lambda e: load_checkpoint(e.edited_ckpt(
        edit_meta=lambda t: t.replace("tiny", "tinx"))), V, "do not match the sha256"),
    ("ckpt metadata not json", lambda e: load_checkpoint(e.edited_ckpt(
        edit_meta=lambda t: t[:-3])), V, "training.json is not valid JSON"),
    ("ckpt nan weights, no hash", lambda e: load_checkpoint(e.edited_ckpt(
        edit_weights=lambda w: w["transformer.ln_f.weight"].fill_(float("nan")))), V,
     "holds NaN"),
    ("ckpt wrong dtype, no hash", lambda e: load_checkpoint(e.edited_ckpt(
        edit_weights=lambda w: w.__setitem__("transformer.wte.weight",
                                             w["transformer.wte.weight"].half()))), V,
     "expected torch.float32"),
    ("ckpt bad device", lambda e: load_checkpoint(e.ckpt, device="tpu"), V, "unknown device"),
    ("save not a GPT", lambda e: save_checkpoint(torch.nn.Linear(2, 2), e.tmp / "x"), T,
     "saves a minikv.GPT"),
    ("save column-parallel copy", lambda e: save_checkpoint(column_parallel(e.model, 2), e.ckpt),
     V, "column_parallel copy is for inference only"),
    ("save nan weights", lambda e: save_checkpoint(nan_model(), e.ckpt), V, "holds NaN"),
    ("save metadata not json", lambda e: save_checkpoint(e.model, e.ckpt, {"t": object()}), V,
     "JSON-serialisable"),
    ("save metadata nan", lambda e: save_checkpoint(e.model, e.ckpt, {"loss": float("nan")}), V,
     "finite numbers"),
    ("save over a file", lambda e: save_checkpoint(e.model, e.ckpt / CONFIG_FILE), V,
     "not a directory"),
    # --- tokenizer ------------------------------------------------------------------------------
    ("tokenizer unknown", lambda e: minikv.load_tokenizer("gpt5"), V, "'course', 'gpt2'"),
    ("tokenizer tampered", lambda e: tokenizer.load_ranks(tampered_ranks(e.tmp)), V,
     "regenerate it with `python -m minikv tokenizer --train`"),
    ("tokenizer missing", lambda e: tokenizer.load_ranks(e.tmp / "none.tiktoken"), V,
     "cannot read the course tokenizer"),
    # --- command line ---------------------------------------------------------------------------
    ("cli unknown command", lambda e: run_cli("frobnicate"), V, "generate"),
    ("cli generate n negative", lambda e: run_cli("generate", "--prompt", "x", "--preset", "tiny",
                                                  "--max-new-tokens", "-1"), V,
     "--max-new-tokens: must be at least 1"),
    ("cli generate temperature", lambda e: run_cli("generate", "--prompt", "x", "--preset",
                                                   "tiny", "--temperature", "1e-45"), V,
     "or a number >="),
    ("cli generate top_k", lambda e: run_cli("generate", "--prompt", "x", "--preset", "tiny",
                                             "--top-k", "0"), V, "--top-k: must be at least 1"),
    ("cli generate seed", lambda e: run_cli("generate", "--prompt", "x", "--preset", "tiny",
                                            "--seed", "-4"), V, "--seed: must be from 0"),
    ("cli generate device", lambda e: run_cli("generate", "--prompt", "x", "--device", "tpu"), V,
     "unknown device"),
    ("cli generate past block", lambda e: run_cli("generate", "--prompt", "x", "--preset", "tiny",
                                                  "--max-new-tokens", "9999"), V,
     "lower max_new_tokens"),
    ("cli train steps 0", lambda e: run_cli("train", "--preset", "tiny", "--steps", "0"), V,
     "must be at least 1"),
    ("cli train steps negative", lambda e: run_cli("train", "--preset", "tiny", "--steps", "-3"),
     V, "must be at least 1"),
    ("cli train over shipped", lambda e: run_cli("train", "--preset", "draft", "--out",
                                                 str(checkpoint.MODELS_DIR / "draft")), V,
     "pass --ship to overwrite it"),
    ("cli train ship other", lambda e: run_cli("train", "--preset", "tiny", "--ship"), V,
     "--ship writes the shipped course models"),
    ("cli train unwritable out", lambda e: run_cli("train", "--preset", "tiny", "--out",
                                                   "/proc/minikv/run"), V, "choose a writable"),
    ("cli train all with out", lambda e: run_cli("train", "--preset", "all", "--out", "x"), V,
     "--out needs a single --preset"),
    ("cli tokenizer no action", lambda e: run_cli("tokenizer"), V, "--train"),
    ("cli evaluate bad device", lambda e: run_cli("evaluate", "--device", "tpu", "--out", "-"), V,
     "unknown device"),
    ("cli exercises unknown", lambda e: run_cli("exercises", "--frob"), V, "unrecognized"),
    ("cli bench repeats 0", lambda e: run_cli("bench", "--quick", "--repeats", "0"), V,
     "must be at least 1"),
    ("cli bench device", lambda e: run_cli("bench", "--quick", "--device", "tpu"), V,
     "unknown device"),
    ("cli figures unwritable", lambda e: run_cli("figures", "--out", "/proc/minikv/figures"), V,
     "choose a writable path"),
    ("cli evaluate unwritable", lambda e: run_cli("evaluate", "--out", "/proc/minikv/x/y.md"), V,
     "/proc/minikv/x does not exist"),
    # --- issue 31's three classes, several members each ---------------------------------------
    # 1. a size function given a length that makes no sense: a number would come back, wrong
    ("bytes seq_len negative", lambda e: minikv.kv_cache_bytes(e.model.config, -5), V, "seq_len"),
    ("bytes seq_len float", lambda e: minikv.kv_cache_bytes(e.model.config, 2.5), V, "seq_len"),
    ("bytes seq_len bool", lambda e: minikv.kv_cache_bytes(e.model.config, True), V, "seq_len"),
    ("bytes batch 0", lambda e: minikv.kv_cache_bytes(e.model.config, 8, 0), V, "batch_size"),
    ("bytes n_kv_head 0", lambda e: minikv.kv_cache_bytes(e.model.config, 8, n_kv_head=0), V,
     "n_kv_head"),
    ("bytes dtype str", lambda e: minikv.kv_cache_bytes(e.model.config, 8, dtype="float16"), T,
     "torch.dtype"),
    ("bytes of a model", lambda e: minikv.kv_cache_bytes(e.model, 8), T, "GPTConfig"),
    ("cache length layer", lambda e: e.cache.get_seq_length(5), V, "layer_idx"),
    ("cache batch 10**15", lambda e: minikv.KVCache.for_model(e.model, batch_size=10**15),
     MemoryError, "lower batch_size"),
    ("sink cache n_layer 0", lambda e: minikv.SinkWindowCache(0, 4, 16, 2, 4, block_size=8), V,
     "n_layer"),
    # issue 32: a window cache's numbering of positions, and its one-pass mask
    ("sink cache renumbers GPT-2", lambda e: minikv.SinkWindowCache.for_model(e.model,
                                                                            rope="reindex"),
     V, "learned-position model has rope='true'"),
    ("sink cache numbering", lambda e: minikv.SinkWindowCache.for_model(e.model, rope="slots"), V,
     "rope must be one of"),
    ("window mask theta str", lambda e: window_attention(4, 16, reindex_theta="1e4"), V,
     "reindex_theta must be a number > 1 .the model's rope_theta."),
    # 2. a prompt of the wrong Python type that iterates over ints
    ("gen bytes prompt", lambda e: e.gen(b"\x05\x06"), T, "not bytes"),
    ("gen set prompt", lambda e: e.gen({5, 6}), T, "not set"),
    ("gen range prompt", lambda e: e.gen(range(5, 7)), T, "not range"),
    ("gen numpy prompt", lambda e: e.gen(__import__("numpy").array([5, 6])), T, "not ndarray"),
    ("gen bool ids", lambda e: e.gen([True, 5]), T, "not True/False"),
    ("batch bytes prompt", lambda e: minikv.generate_batch(e.model, [b"\x05"], 2), T, "bytes"),
    ("batch prompts bytes", lambda e: minikv.generate_batch(e.model, b"\x05\x06", 2), T,
     "prompts must be a list"),
    ("serve bytes prompt", lambda e: e.serve(req(prompt=b"\x01\x02")), T, "not bytes"),
    ("serve requests None", lambda e: minikv.serve(e.model, None), T, "requests must be a list"),
    ("serve tuple request", lambda e: minikv.serve(e.model, [([1, 2], 3)]), T,
     "request 0 must be a minikv.Request"),
    ("spec bytes prompt", lambda e: minikv.speculative_generate(e.model, e.draft, b"\x01", 2), T,
     "not bytes"),
    # 3. a flag that is not a bool: truthiness would decide for the caller
    ("gen trace 'no'", lambda e: e.gen(trace="no"), T, "trace must be True or False"),
    ("gen return_logits 1", lambda e: e.gen(return_logits=1), T, "return_logits must be True"),
    ("spec adaptive 'no'", lambda e: e.spec(adaptive_gamma="no"), T, "adaptive_gamma must be"),
    ("serve replay 'no'", lambda e: e.serve(replay="no"), T, "replay must be True or False"),
    ("serve prefix 0", lambda e: e.serve(prefix_caching=0), T, "prefix_caching must be"),
    ("serve deterministic 'yes'", lambda e: e.serve(req(deterministic="yes")), T,
     "request 0: deterministic must be True or False"),
    ("forward last_only 1", lambda e: fwd(e, tensor_ids([1]), last_only=1), T,
     "last_only must be True or False"),
    ("lookup trace 'yes'", lambda e: minikv.lookup_generate(e.model, [1, 2], 2, trace="yes"), T,
     "trace must be True or False"),
]


def nan_model():
    model = varied_model()
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(float("nan"))
    return model


def tampered_ranks(tmp: Path) -> Path:
    """The shipped ranks with two merges swapped: a valid file that encodes differently."""
    lines = tokenizer.RANKS_PATH.read_bytes().splitlines(keepends=True)
    lines[300], lines[301] = (lines[301].split()[0] + b" 300\n", lines[300].split()[0] + b" 301\n")
    path = tmp / "tampered.tiktoken"
    path.write_bytes(b"".join(lines))
    return path


def test_the_table_is_big_enough():
    assert len(ROWS) >= 80 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("name, call, error, message", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_a_clear_error_and_changes_nothing(tmp_path, name, call, error, message):
    env = Env(tmp_path)
    with pytest.raises(error, match=message):
        call(env)
    env.assert_unchanged()


# --- faults: interrupts, failures mid-way, tampering, memory ----------------------------------

def test_a_failure_in_the_middle_of_generation_leaves_the_callers_cache_as_it_was(tmp_path):
    """Sampling that fails at step 3 (logits overflow): clear error, cache length restored, and
    a retry is the same as never having failed."""
    env = Env(tmp_path)
    calls = {"n": 0}

    def poison(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 3:
            return output * float("inf")
    handle = env.model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(ValueError, match="sampling failed: the model's logits hold inf"):
            minikv.generate(env.model, [5], 5, temperature=1.0, cache=env.cache)
    finally:
        handle.remove()
    assert env.cache.get_seq_length() == 4
    retry = minikv.generate(env.model, [5], 5, temperature=1.0, cache=env.cache.fork())
    fresh_cache = minikv.KVCache.for_model(env.model, max_len=10)
    with torch.no_grad():
        env.model(torch.tensor([[1, 2, 3, 4]]), cache=fresh_cache)
    assert retry.tokens == minikv.generate(env.model, [5], 5, temperature=1.0,
                                           cache=fresh_cache).tokens


def test_ctrl_c_in_the_middle_of_a_forward_pass_leaves_the_cache_usable(tmp_path):
    """An interrupt after layer 0 has written its K/V: the cache's length has not moved, and the
    next call works (before, the layers disagreed and every later call refused)."""
    env = Env(tmp_path)

    def interrupt(module, inputs, output):
        raise KeyboardInterrupt
    handle = env.model.transformer.h[0].register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            env.model(torch.tensor([[7, 8]]), cache=env.cache)
    finally:
        handle.remove()
    assert env.cache.get_seq_length() == 4 and env.cache.layer_lengths == [4, 4]
    out = minikv.generate(env.model, [7, 8], 2, cache=env.cache)
    assert out.tokens == minikv.generate(env.model, [1, 2, 3, 4, 7, 8], 2).tokens


def test_interrupted_generation_crops_the_cache_back(tmp_path):
    env = Env(tmp_path)
    calls = {"n": 0}

    def interrupt(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
    handle = env.model.lm_head.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            minikv.generate(env.model, [5], 5, cache=env.cache)
    finally:
        handle.remove()
    assert env.cache.get_seq_length() == 4


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    env = Env(tmp_path)
    other = varied_model(seed=3)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(other, env.ckpt, {"preset": "other"})
    monkeypatch.undo()
    env.assert_unchanged()
    assert torch.equal(load_checkpoint(env.ckpt, "cpu").transformer.wte.weight,
                       env.model.transformer.wte.weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_ctrl_c_while_swapping_is_held_until_the_new_checkpoint_is_whole(tmp_path, monkeypatch):
    """SIGINT arrives between the two renames: it is raised only after the swap, and the
    checkpoint on disk is the new one, complete and loadable."""
    env = Env(tmp_path)
    other = varied_model(seed=3)
    real_rename, renames = os.rename, []

    def rename(src, dst):
        renames.append(dst)
        if len(renames) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the real signal, mid-swap
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(other, env.ckpt, {"preset": "other"})
    monkeypatch.undo()
    assert len(renames) == 2
    loaded = load_checkpoint(env.ckpt, "cpu")
    assert torch.equal(loaded.transformer.wte.weight, other.transformer.wte.weight)


def test_sigint_during_training_leaves_the_previous_checkpoint(tmp_path):
    """A real `python -m minikv train` interrupted by SIGINT while it trains into a directory
    that already holds a checkpoint: that checkpoint is untouched and loads."""
    env = Env(tmp_path)
    mark_directory(env.ckpt, "train")  # an earlier train's output: train may replace it
    env.before = env.state()
    script = textwrap.dedent(f"""
        import signal, sys
        from minikv.course import train
        # Ctrl-C as at a terminal, even when this test runs in the background (which ignores it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        orig = train.F.cross_entropy
        def noisy(*a, **k):
            print("training", flush=True)
            return orig(*a, **k)
        train.F.cross_entropy = noisy
        sys.exit(train.main(["--preset", "tiny", "--steps", "100000", "--out", {str(env.ckpt)!r}]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "training"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    env.assert_unchanged()
    load_checkpoint(env.ckpt, "cpu")


SHIPPED = [checkpoint.MODELS_DIR / name / f for name in checkpoint.COURSE_MODELS
           for f in (WEIGHTS_FILE, CONFIG_FILE, METADATA_FILE)] + [tokenizer.RANKS_PATH]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tampering_with_any_byte_of_a_shipped_file_is_detected(path, tmp_path, monkeypatch):
    """One flipped bit, at the start, the middle and the end of each shipped file: loading it
    from a copy of the package's files fails with an error that says how to restore it."""
    is_ranks = path == tokenizer.RANKS_PATH
    models = tmp_path / "models"
    for name in checkpoint.COURSE_MODELS:
        (models / name).mkdir(parents=True)
        for f in (checkpoint.MODELS_DIR / name).iterdir():
            (models / name / f.name).write_bytes(f.read_bytes())
    ranks = tmp_path / "course.tiktoken"
    ranks.write_bytes(tokenizer.RANKS_PATH.read_bytes())
    monkeypatch.setattr(checkpoint, "MODELS_DIR", models)
    monkeypatch.setattr(tokenizer, "RANKS_PATH", ranks)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # the cache bypass that once skipped the hash
    copy = ranks if is_ranks else models / path.parent.name / path.name
    original = copy.read_bytes()
    for where in (0, len(original) // 2, len(original) - 2):
        data = bytearray(original)
        data[where] ^= 0x01
        copy.write_bytes(bytes(data))
        name = "target" if is_ranks else path.parent.name
        with pytest.raises(ValueError, match="restore it|RANKS_SHA256"):
            minikv.load_course_model(name, "cpu")
    copy.write_bytes(original)
    minikv.load_course_model("target", "cpu")


def test_a_tampered_tokenizer_is_caught_even_after_a_good_load(tmp_path, monkeypatch):
    """tiktoken's loader caches local files: a file edited after a first load was served stale.
    minikv reads and hashes the bytes on every load."""
    ranks = tmp_path / "course.tiktoken"
    ranks.write_bytes(tokenizer.RANKS_PATH.read_bytes())
    monkeypatch.setattr(tokenizer, "RANKS_PATH", ranks)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    assert minikv.load_tokenizer().encode(" named Bob")
    ranks.write_bytes(tampered_ranks(tmp_path).read_bytes())
    with pytest.raises(ValueError, match="does not match RANKS_SHA256"):
        minikv.load_tokenizer()


def test_a_memory_bomb_config_is_rejected_without_allocating(tmp_path):
    """config.json claims 10⁹ layers of width 10⁶: rejected in a process limited to what importing
    the package takes plus 100 MB of address space."""
    env = Env(tmp_path)
    bomb = env.edited_ckpt(lambda c: c.update(n_layer=10**9, n_embd=10**6, n_head=1))
    script = textwrap.dedent(f"""
        import resource, re
        import minikv
        from minikv.course.checkpoint import load_checkpoint
        size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
        limit = size * 1024 + 100 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            load_checkpoint({str(bomb)!r}, "cpu")
        except ValueError as e:
            print("rejected:", e)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rejected:" in result.stdout and "the config says 1000000000" in result.stdout


# --- threads ------------------------------------------------------------------------------------

def test_two_threads_on_one_model_get_what_they_would_get_one_after_the_other():
    model = varied_model()
    prompts = {0: [1, 2, 3], 1: [9, 8, 7, 6, 5]}
    alone = {i: minikv.generate(model, p, 30, temperature=0.9, seed=i) for i, p in prompts.items()}
    results, barrier = {}, threading.Barrier(2)

    def work(i):
        barrier.wait()
        results[i] = minikv.generate(model, prompts[i], 30, temperature=0.9, seed=i)
    threads = [threading.Thread(target=work, args=(i,)) for i in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in prompts:
        assert results[i].tokens == alone[i].tokens
        assert results[i].stats == alone[i].stats  # K/V counted per call, not per model


def test_serve_takes_any_iterable_of_requests():
    model = varied_model()
    requests = [minikv.Request([1, 2, 3], 5), minikv.Request([4, 5], 4)]
    expected = [o.tokens for o in minikv.serve(model, requests)]
    assert [o.tokens for o in minikv.serve(model, (r for r in requests))] == expected
    assert [o.tokens for o in minikv.serve(model, tuple(requests))] == expected



def test_no_command_overwrites_a_shipped_file_by_default(monkeypatch, tmp_path):
    """Without an explicit flag, commands write under runs/ or print: figures/, benchmarks/,
    docs/ and the shipped models and tokenizer are rewritten only when asked to."""
    from minikv.bench import main as bench_main
    from minikv.course import evaluate, train
    from minikv.viz import figures
    seen = {}

    def stop(path, *args, **kwargs):
        seen[len(seen)] = Path(path).resolve()
        raise SystemExit(0)
    monkeypatch.setattr(figures, "claim_directory", stop)
    monkeypatch.setattr("minikv.bench.claim_directory", stop)
    monkeypatch.setattr("minikv.bench.load.claim_directory", stop)
    # bench-spec, bench-sessions and bench-disagg claim theirs through bench.device_and_out,
    # patched above
    monkeypatch.setattr(train, "claim_directory", stop)
    from minikv.bench import disagg, load, sessions, speculation
    for main, args in ((figures.main, []), (bench_main, ["--quick"]), (bench_main, []),
                       (load.main, []), (speculation.main, []), (sessions.main, []),
                       (disagg.main, []), (train.main, ["--preset", "draft"])):
        with pytest.raises(SystemExit):
            main(args)
    shipped = [ROOT / "figures", ROOT / "benchmarks", ROOT / "docs", checkpoint.MODELS_DIR,
               tokenizer.RANKS_PATH.parent]
    assert len(seen) == 8  # each command got as far as choosing its folder
    for path in seen.values():
        assert not any(path == s or s in path.parents for s in shipped), path
    doc = ROOT / "docs" / "course-models.md"
    before = doc.read_bytes()
    monkeypatch.setattr(evaluate, "report", lambda device: "REPORT\n")
    assert evaluate.main([]) == 0 and doc.read_bytes() == before  # printed, not written
