"""The public API under a fuzzer (issue 31). Each argument of each entry point is drawn from right
values or from wrong ones of every kind a student types: wrong types (bytes, str, float, bool,
numpy and torch scalars, tensors, None), out-of-range values (negative, zero, huge, NaN, inf) and
wrong objects (another model's cache). One argument at most is wrong per call.

The property: a call with right arguments returns the right answer (checked against a plain
reference where one exists); a call with a wrong one raises TypeError or ValueError (MemoryError
for a size no machine holds) whose message names the argument; and either way the model and the
caller's cache are as they were. Anything else (AttributeError, IndexError, AssertionError, a
RuntimeError from torch) fails the test, and so does a wrong value taken silently (True as 1,
"no" as true, 3.0 as 3, bytes as a list of token ids).
"""
from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minikv
from minikv.course.checkpoint import load_checkpoint, save_checkpoint
from minikv.course.export import llama_state_dict
from minikv.engine import FeatureHead
from minikv.engine.config import LLAMA
from minikv.engine.paged import BlockPool, BlockTable, PagedCache

from conftest import cli_exit, varied_model

MODEL = varied_model()                                   # tiny: vocab 512, block_size 256
DRAFT = varied_model(seed=1, n_layer=1)
OTHER_VOCAB = varied_model(seed=2, vocab_size=300)       # a draft with another tokenizer
torch.manual_seed(3)
HEAD = FeatureHead(FeatureHead.config_for(MODEL)).eval()  # chapter 10: a draft head
OTHER_HEAD = FeatureHead(FeatureHead.config_for(OTHER_VOCAB)).eval()
V, N_LAYER = MODEL.config.vocab_size, MODEL.config.n_layer
WEIGHTS = torch.cat([p.detach().flatten().clone() for p in MODEL.parameters()])


# --- what is drawn ------------------------------------------------------------------------------
class Make:
    """A value built afresh for every call (a cache), shown by its label in a failing example."""

    def __init__(self, label: str, build: Callable):
        self.label, self.build = label, build

    def __repr__(self) -> str:
        return self.label


def named(model, label: str) -> Make:
    return Make(label, lambda: model)  # a label in place of the module's long repr


def built(value):
    return value.build() if isinstance(value, Make) else value


@dataclass
class Arg:
    good: st.SearchStrategy
    bad: st.SearchStrategy | None  # None: not an argument the fuzzer gets wrong
    says: tuple[str, ...] = ()  # a refusal names one of these (default: the argument's name)


NOT_NUMBERS = ["3", b"\x03", [1, 2], {"n": 1}, object(), torch.tensor([1.0, 2.0])]
LOOKALIKES = [True, False, 2.0, np.int64(2), np.float32(2.0), torch.tensor(2)]


def count(lo: int, hi: int, *, none: bool = False, too_big=(), says=()) -> Arg:
    """An int in [lo, hi] (or None); wrong: other types, lo - 1, -1, NaN, inf, `too_big`."""
    wrong = NOT_NUMBERS + LOOKALIKES + [lo - 1, -1, math.nan, math.inf, *too_big]
    good = st.integers(lo, hi) | (st.none() if none else st.nothing())
    return Arg(good, st.sampled_from(wrong + ([] if none else [None])), says)


def flag(good=(False, True)) -> Arg:
    wrong = ["no", "", "True", 0, 1, 1.0, None, np.bool_(True), torch.tensor(True)]
    return Arg(st.sampled_from(good), st.sampled_from(wrong))


def choice(good, wrong) -> Arg:
    return Arg(st.sampled_from(good), st.sampled_from(wrong))


TEMPERATURE = Arg(st.just(0) | st.just(0.0) | st.floats(0.5, 2.0),
                  st.sampled_from([-0.5, 1e-4, math.nan, math.inf, -math.inf, "1.0", True, None,
                                   torch.tensor(1.0), [1.0]]))
IDS = st.lists(st.integers(0, V - 1), min_size=1, max_size=6)
TOKENS = Arg(
    IDS | IDS.map(tuple) | IDS.map(torch.tensor) | IDS.map(lambda t: torch.tensor([t])),
    st.sampled_from([b"\x01\x02", "The color of dog", {1, 2}, {1: 2}, range(3), np.array([1, 2]),
                     [], [1.0, 2.0], [True, 2], [V], [-1], [1, None], torch.tensor([1.0]),
                     torch.ones(2, 3, dtype=torch.long), torch.tensor([True]), None, 5,
                     Make("iter([1, 2])", lambda: iter([1, 2]))]),
    ("token id", "prompt"))


def fresh_cache(model=MODEL, **kw) -> Make:
    return Make(f"KVCache.for_model({kw})", lambda: minikv.KVCache.for_model(model, **kw))


WRONG_CACHES = st.sampled_from([
    "cache", 3, torch.zeros(2, 2), fresh_cache(DRAFT), fresh_cache(batch_size=2),
    Make("[KVCache]", lambda: [minikv.KVCache.for_model(MODEL)])])


# --- the entry points ---------------------------------------------------------------------------
def greedy(prompt, n: int, eos=None) -> list[int]:
    """The reference: the plain model, whole sequence each step, argmax."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(MODEL(torch.tensor([seq]))[0, -1].argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt):]


def as_list(ids) -> list[int]:
    return ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)


@dataclass
class Entry:
    call: Callable
    args: dict[str, Arg]
    check: Callable = lambda kw, out: None      # the answer of a right call
    fix: Callable = lambda kw: None             # make right values right together
    examples: int = 300
    caches: list[str] = field(default_factory=lambda: ["cache"])


def check_decoded(kw, out, tokens=None):
    tokens = out.tokens if tokens is None else tokens
    assert len(tokens) <= kw["max_new_tokens"] and all(0 <= t < V for t in tokens)
    if kw.get("temperature", 0) == 0:
        assert tokens == greedy(as_list(kw["ids"]), kw["max_new_tokens"], kw.get("eos_id"))


def fix_generate(kw):
    if kw["mode"] == "naive":
        kw["cache"] = None


def fix_speculative(kw):
    if kw["adaptive_gamma"]:
        kw["max_gamma"] = max(kw["max_gamma"], kw["gamma"])


def gen_batch(prompts, max_new_tokens, **kw):
    return minikv.generate_batch(MODEL, prompts, max_new_tokens, **kw)


def check_batch(kw, outs):
    assert len(outs) == len(kw["prompts"])
    for prompt, out in zip(kw["prompts"], outs):
        check_decoded(dict(kw, ids=prompt), out)


def request(prompt, max_new_tokens, **kw):
    return minikv.Request(prompt, max_new_tokens, **kw)


REQUEST_FIELDS = dict(
    prompt=TOKENS, max_new_tokens=count(1, 5, says=("max_new_tokens",)),
    deterministic=flag(), temperature=TEMPERATURE, top_k=count(1, V, none=True),
    seed=count(0, 2**63 - 1, too_big=[2**63]), eos_id=count(0, V - 1, none=True, too_big=[V]),
    arrival=count(0, 3))


@st.composite
def requests(draw, wrong: bool):
    """1-3 right Requests; or, `wrong`, one with a wrong field, or no list of Requests at all."""
    rows = [{k: draw(a.good) for k, a in REQUEST_FIELDS.items()}
            for _ in range(draw(st.integers(1, 3)))]
    if wrong:
        if draw(st.booleans()):
            return draw(st.sampled_from(["abc", [], None, 5, [([1, 2], 3)], b"\x01"]))
        name = draw(st.sampled_from(sorted(REQUEST_FIELDS)))
        rows[draw(st.integers(0, len(rows) - 1))][name] = draw(REQUEST_FIELDS[name].bad)
    return Make(f"[Request(**row) for row in {rows}]",
                lambda: [minikv.Request(**{k: built(v) for k, v in r.items()}) for r in rows])


def check_serve(kw, outs):
    for out in outs:
        r = out.request
        assert len(out.tokens) <= r.max_new_tokens and all(0 <= t < V for t in out.tokens)
        if r.temperature == 0 and r.deterministic and kw["replay"]:  # batch-invariant tokens
            assert out.tokens == greedy(as_list(r.prompt), r.max_new_tokens, r.eos_id)


def check_bytes(kw, n):
    cfg = kw["cfg"]
    heads = cfg.kv_heads if kw["n_kv_head"] is None else kw["n_kv_head"]
    assert n == (cfg.n_layer * 2 * kw["batch_size"] * heads * kw["seq_len"] * cfg.head_dim
                 * kw["dtype"].itemsize)


def check_cache_shape(kw, cache):
    assert cache.get_seq_length() == 0 and len(cache.keys) == kw["n_layer"]
    assert cache.keys[0].shape[:2] == (kw["batch_size"], kw["n_head"])


def fix_config(kw):
    kw["n_embd"] *= 2 * kw["n_head"]                        # an even head_dim (RoPE's pairs)
    if kw["positions"] == "learned":
        kw["rope_scaling"] = None                           # Llama 3's scaling turns RoPE
    if kw["n_kv_head"] is not None:
        kw["n_kv_head"] = math.gcd(kw["n_kv_head"], kw["n_head"])  # n_kv_head divides n_head


def filled(length: int = 3) -> minikv.KVCache:
    cache = minikv.KVCache.for_model(MODEL, max_len=8)
    with torch.no_grad():
        MODEL(torch.tensor([[1, 2, 3][:length]]), cache=cache)
    return cache


def paged():
    """One sequence of 5 positions in a pool of 8 blocks of 2 (3 blocks taken)."""
    pool = BlockPool(MODEL.config, 8, 2)
    cache = PagedCache(pool, [BlockTable(owner=0)])
    cache.reserve(5)
    cache.tables[0].length = 5
    return cache


TINY_CHECKPOINT = save_checkpoint(MODEL, Path(tempfile.mkdtemp()) / "tiny")
atexit.register(shutil.rmtree, TINY_CHECKPOINT.parent, True)
QWEN = varied_model(seed=5, **LLAMA, qkv_bias=True, n_inner=96)  # a Hugging Face folder of it:


def hf_folder() -> Path:
    """QWEN as save_pretrained writes it: config.json (hand-written: no transformers needed) and
    model.safetensors in Qwen2's names."""
    folder = Path(tempfile.mkdtemp()) / "qwen"
    folder.mkdir()
    cfg = QWEN.config
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
        intermediate_size=cfg.n_inner, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.layer_norm_eps, tie_word_embeddings=True, rope_theta=cfg.rope_theta)))
    safetensors.torch.save_file({k: v.contiguous() for k, v in llama_state_dict(QWEN).items()},
                                str(folder / "model.safetensors"))
    atexit.register(shutil.rmtree, folder.parent, True)
    return folder


def check_pretrained(kw, out):
    model, tok = out
    assert tok is None and model.config == QWEN.config and model.dtype == kw["dtype"]
    assert all(torch.equal(a.to(b.dtype), b) for a, b in zip(
        QWEN.state_dict().values(), model.state_dict().values()))


def check_same_weights(model):
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), WEIGHTS)


def crop(cache, max_length):
    cache.crop(max_length)
    return cache


def update(cache, key, value, layer_idx):
    return cache.update(key, value, layer_idx)


KV = (1, MODEL.config.n_head, 2, MODEL.config.head_dim)
WRONG_KV = st.sampled_from([torch.zeros(2, 4, 2, 16), torch.zeros(KV, dtype=torch.float64),
                            torch.zeros(1, 4, 2, 8), torch.zeros(KV)[0], "k", None, [[0.0]]])
DEVICE = choice(["cpu", torch.device("cpu"), b"cpu"], ["tpu", 3.5, "cuda:99", ["cpu"]])  # torch
# takes b"cpu" as "cpu": the right answer, so not a wrong value
DTYPE = choice([torch.float32], ["float32", float, None, 4, np.float32])
SIZES = dict(n_layer=count(1, 3), batch_size=count(1, 2, too_big=[10**15]),
             n_head=count(1, 4), head_dim=count(1, 8), max_len=count(1, 8, too_big=[10**15]))
CONFIG = dict(vocab_size=count(1, 64), block_size=count(1, 64), n_layer=count(1, 3),
              n_head=count(1, 4), n_embd=count(1, 4), n_kv_head=count(1, 4, none=True),
              layer_norm_eps=Arg(st.floats(1e-6, 0.5), st.sampled_from(
                  [0, 1, -1e-5, math.nan, math.inf, "1e-5", True, None, torch.tensor(1e-5)])),
              positions=choice(["learned", "rope"], ["RoPE", "alibi", None, 1, True]),
              rope_theta=Arg(st.just(10000.0) | st.floats(2.0, 1e6), st.sampled_from(
                  [1, 0.5, -1e4, math.nan, math.inf, "1e4", True, None])),
              norm=choice(["layernorm", "rmsnorm"], ["rms", None, True, 0]),
              mlp=choice(["gelu", "swiglu"], ["relu", None, 1]),
              n_inner=count(1, 64, none=True), bias=flag(), tied_head=flag(), qk_norm=flag(),
              qkv_bias=Arg(st.sampled_from([None, False, True]),
                           st.sampled_from(["no", 0, 1, np.bool_(True), torch.tensor(True)])),
              rope_scaling=Arg(st.sampled_from([None, ("llama3", 8.0, 1.0, 4.0, 64)]),
                               st.sampled_from(["llama3", ("yarn", 8.0, 1.0, 4.0, 64),
                                                ("llama3", -1.0, 1.0, 4.0, 64),
                                                ("llama3", 8.0, 4.0, 1.0, 64), [1, 2],
                                                ("llama3", True, 1.0, 4.0, 64),
                                                ("llama3", 8.0, 1.0, 4.0, 64.0), 3])))
MAX_NEW = count(0, 6, too_big=[10**6])
SAMPLING = dict(temperature=TEMPERATURE, top_k=count(1, V + 5, none=True),
                seed=count(0, 2**63 - 1, too_big=[2**63]))
EOS = count(0, V - 1, none=True, too_big=[V])


ENTRIES = {
    "generate": Entry(
        lambda **kw: minikv.generate(MODEL, **kw),
        dict(ids=TOKENS, max_new_tokens=MAX_NEW,
             mode=choice(["cached", "naive"], ["paged", None, 0, b"cached", "Cached"]),
             **SAMPLING, eos_id=EOS,
             cache=Arg(st.sampled_from([None, fresh_cache(), fresh_cache(max_len=40)]),
                       WRONG_CACHES),
             trace=flag(), return_logits=flag()),
        check_decoded, fix_generate, examples=1000),
    "generate_batch": Entry(
        gen_batch,
        dict(prompts=Arg(st.lists(IDS, min_size=1, max_size=3),
                         st.sampled_from(["ab", b"\x01", [], [b"\x01\x02"], [[]], None,
                                          torch.ones(2, 2, dtype=torch.long), [[1.0]]]),
                         ("prompt", "token id")),
             max_new_tokens=MAX_NEW, **SAMPLING, eos_id=EOS,
             pad_id=count(0, V - 1, too_big=[V])),
        check_batch),
    "speculative_generate": Entry(
        lambda draft, **kw: minikv.speculative_generate(MODEL, built(draft), **kw),
        dict(draft=Arg(st.just(named(DRAFT, "DRAFT")),
                       st.sampled_from(["draft", None, named(OTHER_VOCAB, "OTHER_VOCAB"), 3])),
             ids=TOKENS, max_new_tokens=MAX_NEW, gamma=count(1, 4, too_big=[10**6]),
             **SAMPLING, eos_id=EOS, adaptive_gamma=flag(), max_gamma=count(1, 6),
             trace=flag()),
        check_decoded, fix_speculative),
    "feature_generate": Entry(
        lambda head, **kw: minikv.feature_generate(MODEL, built(head), **kw),
        dict(head=Arg(st.just(named(HEAD, "HEAD")),
                      st.sampled_from(["head", None, named(OTHER_HEAD, "OTHER_HEAD"),
                                       named(DRAFT, "DRAFT"), 3])),
             ids=TOKENS, max_new_tokens=MAX_NEW, gamma=count(1, 4, too_big=[10**6]),
             **SAMPLING, eos_id=EOS,
             tree=Arg(st.sampled_from([None, (2, 2), (1, 3), (3, 1)]),
                      st.sampled_from([2, (0, 2), (2,), "2x2", (2.0, 2), (2, True), [2, 2],
                                       (2, -1)]), ("tree",)),
             trace=flag()),
        check_decoded),
    "Speculation": Entry(
        lambda draft, **kw: minikv.Speculation(draft=built(draft), **kw),
        dict(gamma=count(1, 4), ngram=count(1, 4),
             draft=Arg(st.sampled_from([None, named(DRAFT, "DRAFT")]), None))),
    "lookup_generate": Entry(
        lambda **kw: minikv.lookup_generate(MODEL, **kw),
        dict(ids=TOKENS, max_new_tokens=MAX_NEW, gamma=count(1, 4, too_big=[10**6]),
             ngram=count(1, 4), eos_id=EOS, trace=flag()),
        check_decoded),
    "serve": Entry(
        lambda requests, **kw: minikv.serve(MODEL, built(requests), **kw),
        dict(requests=Arg(requests(False), requests(True),
                          ("request", "token id", "prompt", "temperature", "top_k", "seed",
                           "eos_id")),
             replay_window=count(1, 4, too_big=[10**6]), replay=flag(), trace=flag(),
             record_logits=flag(), page_size=count(1, 8),
             num_blocks=Arg(st.none(), st.sampled_from([0, 1, True, "8", 8.0, -3])),
             prefix_caching=flag(), max_running=count(1, 3, none=True),
             policy=Arg(st.none(), st.sampled_from(["fcfs", 3, object()])),
             speculative=Arg(st.sampled_from([None, minikv.Speculation(2),
                                              minikv.Speculation(2, draft=DRAFT)]),
                             st.sampled_from([4, "lookup", object(), True]))),
        check_serve, examples=500),
    "SamplingParams": Entry(minikv.SamplingParams, SAMPLING),
    "GPT": Entry(minikv.GPT, dict(config=choice(
        [minikv.GPTConfig.preset("tiny"), minikv.GPTConfig.preset("tiny", **LLAMA)],
        ["tiny", None, {"n_layer": 2}, 3, minikv.PRESETS["tiny"]])), examples=20),
    "GPTConfig": Entry(minikv.GPTConfig, CONFIG, fix=fix_config),
    "KVCache": Entry(lambda n_layer, batch_size, n_head, head_dim, max_len, **kw: minikv.KVCache(
        n_layer, batch_size, n_head, head_dim, max_len, **kw),
        dict(**SIZES, device=DEVICE, dtype=DTYPE), check_cache_shape),
    "KVCache.for_model": Entry(
        lambda **kw: minikv.KVCache.for_model(MODEL, **kw),
        dict(batch_size=count(1, 2, too_big=[10**15]),
             max_len=count(1, 256, none=True, too_big=[257]))),
    "QuantizedKVCache": Entry(
        lambda n_layer, batch_size, n_head, head_dim, max_len, **kw: minikv.QuantizedKVCache(
            n_layer, batch_size, n_head, head_dim, max_len, **kw),
        dict(**SIZES, bits=choice([8, 4], [8.0, "8", True, 16, None, np.int64(8), 0]),
             device=DEVICE, dtype=DTYPE)),
    "SinkWindowCache": Entry(
        lambda **kw: minikv.SinkWindowCache(**kw),
        dict(n_layer=count(1, 3), n_head=count(1, 4), head_dim=count(1, 8), sinks=count(0, 4),
             window=count(1, 8), block_size=count(1, 64), device=DEVICE, dtype=DTYPE)),
    "SinkWindowCache.for_model": Entry(
        lambda **kw: minikv.SinkWindowCache.for_model(MODEL, **kw),
        dict(sinks=count(0, 4), window=count(1, 8),
             rope=choice(["true"], ["reindex", "rerotate", "slots", None, True]))),
    "H2OCache.for_model": Entry(
        lambda **kw: minikv.H2OCache.for_model(MODEL, **kw),
        dict(heavy=count(0, 4, says=("heavy", "budget")),
             recent=count(0, 4, says=("recent", "budget")),
             batch_size=count(1, 2)),  # nothing is allocated before a pass: no size too big
        fix=lambda kw: kw.update(recent=max(kw["recent"], 1 - kw["heavy"]))),
    "SnapKVCache.for_model": Entry(
        lambda **kw: minikv.SnapKVCache.for_model(MODEL, **kw),
        dict(top=count(0, 4), window=count(1, 4), kernel=Arg(st.sampled_from([1, 3, 5]),
                                                             st.sampled_from([2, 0, 3.0, True])),
             pool=choice(["avg", "max"], ["mean", None, "AVG", 1]),
             batch_size=count(1, 2))),
    "KVCache.crop": Entry(
        crop, dict(cache=Arg(st.just(Make("filled()", filled)), None),
                   max_length=count(0, 3, too_big=[4, 10**6], says=("crop",)))),
    "KVCache.get_seq_length": Entry(
        lambda cache, **kw: built(cache).get_seq_length(**kw),
        dict(cache=Arg(st.just(Make("filled()", filled)), None),
             layer_idx=count(0, N_LAYER - 1, too_big=[N_LAYER]))),
    "KVCache.update": Entry(
        update, dict(cache=Arg(st.just(Make("filled()", filled)), None),
                     key=Arg(st.just(torch.ones(KV)), WRONG_KV, ("key",)),
                     value=Arg(st.just(torch.ones(KV)), WRONG_KV, ("value",)),
                     layer_idx=count(0, N_LAYER - 1, too_big=[N_LAYER]))),
    "BlockPool": Entry(
        lambda cfg, num_blocks, page_size, **kw: BlockPool(built(cfg), num_blocks, page_size,
                                                           **kw),
        dict(cfg=Arg(st.just(MODEL.config), st.sampled_from([{"n_layer": 2}, None,
                                                             named(MODEL, "MODEL")]),
                     ("GPTConfig",)),
             num_blocks=count(1, 8, too_big=[10**15]), page_size=count(1, 8),
             device=DEVICE, dtype=DTYPE)),
    "PagedCache.reserve": Entry(
        lambda cache, n_new: built(cache).reserve(n_new),
        dict(cache=Arg(st.just(Make("paged()", paged)), None),
             n_new=count(0, 8, too_big=[10**6], says=("n_new", "pool is full")))),
    "PagedCache.crop": Entry(
        lambda cache, max_length: built(cache).crop(max_length),
        dict(cache=Arg(st.just(Make("paged()", paged)), None),
             max_length=count(0, 5, too_big=[6, 10**6], says=("crop",)))),
    "load_checkpoint": Entry(
        load_checkpoint,
        dict(directory=choice([named(TINY_CHECKPOINT, "a saved checkpoint")],
                              [3, None, b"\x00", ["ckpt"], "no/such/dir", 2.5]),
             device=DEVICE),
        lambda kw, model: check_same_weights(model), examples=25),
    "kv_cache_bytes": Entry(
        minikv.kv_cache_bytes,
        dict(cfg=Arg(st.just(MODEL.config),
                     st.sampled_from([{"n_layer": 2}, None, named(MODEL, "MODEL")]),
                     ("GPTConfig",)),
             seq_len=count(0, 10**6), batch_size=count(1, 64),
             dtype=choice([torch.float16, torch.float32, torch.int8],
                          ["float16", 2, None, np.float16]),
             n_kv_head=count(1, 4, none=True)),
        check_bytes),
    "GPT.forward": Entry(
        lambda **kw: MODEL(**kw),
        dict(idx=Arg(st.lists(st.integers(0, V - 1), min_size=3, max_size=3).map(
                         lambda t: torch.tensor([t])),
                     st.sampled_from([[[1, 2]], torch.tensor([[1.0]]), torch.tensor([1, 2]),
                                      torch.zeros(1, 0, dtype=torch.long), torch.tensor([[V]]),
                                      torch.tensor([[-1]]), torch.tensor([[True]]),
                                      np.array([[1, 2]]), None]),
                     ("idx", "token id")),
             cache=Arg(st.sampled_from([None, fresh_cache(max_len=8)]), WRONG_CACHES),
             positions=Arg(st.none(), st.sampled_from([
                 torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1]), torch.tensor([-1, 0, 1]),
                 torch.tensor([0, 1, 256]), [0, 1, 2], torch.tensor([[[0, 1, 2]]])])),
             last_only=flag())),
    "load_course_model": Entry(
        minikv.load_course_model,
        dict(name=choice(["draft"], ["targett", b"target", 3, None, ["target"], "TARGET", ""]),
             device=DEVICE),
        examples=25),
    "from_pretrained": Entry(
        minikv.from_pretrained,
        dict(folder=Arg(st.sampled_from([hf_folder()]), st.sampled_from(
                 [b"qwen", 3, None, ["qwen"], "/nonexistent/minikv-qwen", TINY_CHECKPOINT,
                  TINY_CHECKPOINT / "config.json"]), ("folder", "model_type", "a file")),
             device=DEVICE,
             dtype=choice([torch.float32, torch.bfloat16], ["float32", float, None, 4,
                                                           torch.int8])),
        check_pretrained, examples=25),
    "load_tokenizer": Entry(
        minikv.load_tokenizer,
        dict(name=choice(["course"], ["gpt3", 3, None, b"course", ["course"], ""])),
        examples=15),
    "resolve_device": Entry(
        minikv.resolve_device,
        dict(device=choice(["cpu", None], ["tpu", 3.5, "cuda:99", ["cpu"], "gpu", ""])),
        examples=20),
}


def state(cache) -> tuple:
    """A cache's state as comparable values: lengths and live tensors, or tables and books."""
    if isinstance(cache, PagedCache):
        books = (list(cache.pool.free), list(cache.pool.ref))
        return tuple((tuple(t.blocks), t.length) for t in cache.tables) + books
    return (cache.get_seq_length(), *(t.clone() for t in cache.keys + cache.values))


def same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(a, b, strict=True))


def snapshot(kwargs) -> list:
    """What must not move on a refusal: every cache passed in (and the model's weights)."""
    caches = [v for v in kwargs.values() if isinstance(v, (minikv.KVCache, PagedCache))]
    return [(c, state(c)) for c in caches]


def assert_unchanged(saved) -> None:
    check_same_weights(MODEL)
    for cache, before in saved:
        assert same(state(cache), before), "a refused call changed the cache"


@pytest.mark.parametrize("name", ENTRIES)
def test_every_call_is_right_or_refused_by_name_and_changes_nothing(name):
    entry = ENTRIES[name]

    @settings(max_examples=entry.examples, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def run(data):
        kwargs = {k: data.draw(a.good, label=k) for k, a in entry.args.items()}
        entry.fix(kwargs)
        wrongable = [k for k, a in entry.args.items() if a.bad is not None]
        rights = [None] * max(1, len(wrongable) // 3)  # a quarter of the calls are right
        bad = data.draw(st.sampled_from(rights + wrongable), label="wrong argument")
        if bad is not None:
            kwargs[bad] = data.draw(entry.args[bad].bad, label=f"wrong {bad}")
        kwargs = {k: built(v) for k, v in kwargs.items()}
        saved = snapshot(kwargs)
        try:
            out = entry.call(**kwargs)
        except (TypeError, ValueError, MemoryError) as e:
            assert bad is not None, f"right arguments refused: {type(e).__name__}: {e}"
            words = entry.args[bad].says or (bad,)
            assert any(w in str(e) for w in words), f"{e!r} does not name {bad}"
            assert_unchanged(saved)
        else:
            assert bad is None, f"{bad}={kwargs[bad]!r} was taken silently"
            entry.check(kwargs, out)
    run()


def test_the_fuzzer_draws_every_kind_of_wrong_value():
    """The table above is the fuzzer's reach: each kind in it at least once."""
    kinds = {type(v).__name__ for a in ENTRIES["generate"].args.values()
             for v in getattr(a.bad, "elements", [])}
    for kind in ("bytes", "str", "float", "bool", "int64", "float32", "Tensor", "NoneType"):
        assert kind in kinds, kind


# --- the command line ---------------------------------------------------------------------------
CLI_VALUES = {
    "--max-new-tokens": ["3", "0", "-1", "x", "1e3", "", "99999", "2.5"],
    "--temperature": ["0", "0.8", "-1", "nan", "inf", "x", ""],
    "--top-k": ["5", "0", "-2", "x", "1.5"],
    "--seed": ["0", "-1", "x", str(2**64)],
    "--mode": ["naive", "cached", "paged", ""],
    "--device": ["cpu", "tpu", "cuda:99", ""],
    "--init-seed": ["0", "-1", "x"],
}


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.dictionaries(st.sampled_from(sorted(CLI_VALUES)), st.just(None), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.sampled_from(CLI_VALUES[k]) for k in keys})))
def test_the_command_line_answers_or_exits_2_with_a_message(options):
    """`python -m minikv generate` with drawn options: it prints tokens (exit 0) or a message
    (exit 2), never a traceback."""
    argv = ["generate", "--prompt", "The color", "--preset", "tiny"]
    for k, v in options.items():
        argv += [k, v]
    code, err = cli_exit(*argv)
    assert code in (0, 2), (argv, code)
    assert code == 0 or err.strip(), argv
