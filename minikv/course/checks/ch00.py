"""Checkers for chapter 00 (setup and a tiny GPT): count_params and encode_documents (tables,
against models built on the meta device and the course tokenizer), forward_by_hand (against
model(idx), no GPT.forward), predict_generation (predict, then measure), load_gpt2_fixed (debug:
logits against the source) and choose_width (design). The hints are in hints/ch00.toml."""
from __future__ import annotations

import bisect
import functools

import torch
import torch.nn.functional as F

from ...engine import GPT, GPTConfig, generate
from ...engine.model import causal_attention
from ..checkpoint import load_course_model
from ..tokenizer import load_tokenizer
from . import (
    Exercise,
    Refused,
    as_int,
    call,
    call_hinted,
    close,
    expect_tensor,
    fail,
    forbid,
    guarded,
    hints,
    int_list,
    kind,
    named,
    passed,
    prediction,
    tiny_model,
)

H = hints("ch00")


# --- exercise 1: count the parameters -----------------------------------------------------------
@functools.cache
def _num_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return GPT(cfg).num_params()


def _off_by(extra):
    """A wrong count: the right one plus extra(C, L, V, P)."""
    return lambda cfg: _num_params(cfg) + extra(cfg.n_embd, cfg.n_layer, cfg.vocab_size,
                                                cfg.block_size)


def _a_count(got, cfg) -> int:
    h, floats = H["count_params"], isinstance(got, float) or "float" in type(got).__name__
    if as_int(got) is None:
        raise Refused(h["refused"].format(type=type(got).__name__)
                      + (h["refused_float"] if floats else ""))
    return as_int(got)


COUNT_PARAMS = Exercise(
    "count_params",
    cases=[(GPTConfig.preset(p),) for p in ("gpt2", "target", "draft", "tiny", "small")]
    + [(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2),),
       (GPTConfig(vocab_size=97, block_size=33, n_layer=5, n_head=3, n_embd=24),)],
    describe=lambda cfg: (f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                          f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd})"),
    reference=_num_params, returns=_a_count,
    mistakes=named(H["count_params"],
                   lm_head=_off_by(lambda C, L, V, P: V * C),
                   ln_f=_off_by(lambda C, L, V, P: -2 * C),
                   biases=_off_by(lambda C, L, V, P: -L * 9 * C),
                   layernorms=_off_by(lambda C, L, V, P: -L * 4 * C),
                   biases_and_layernorms=_off_by(lambda C, L, V, P: -L * 13 * C),
                   matrices_only=_off_by(lambda C, L, V, P: -L * 13 * C - 2 * C),
                   wpe=_off_by(lambda C, L, V, P: -P * C),
                   c_proj=_off_by(lambda C, L, V, P: -L * (C * C + C)),
                   mlp_width=_off_by(lambda C, L, V, P: -L * (6 * C * C + 3 * C))),
    otherwise=H["count_params"]["otherwise"])
check_count_params = COUNT_PARAMS.check


# --- exercise 2: documents as one token stream --------------------------------------------------
def _a_stream(got, tok, docs) -> list[int]:
    h = H["encode_documents"]
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        raise Refused(h["array"].format(type=f"{type(got).__module__}.{type(got).__name__}"))
    if not isinstance(got, (list, tuple)):
        raise Refused(h["not_list"].format(type=type(got).__name__))
    if any(isinstance(t, (list, tuple)) for t in got):
        raise Refused(h["nested"])
    if int_list(got) is None:
        bad = next(t for t in got if as_int(t) is None)
        raise Refused(h["not_int"].format(bad=bad, type=type(bad).__name__))
    return int_list(got)


def _each(tok, docs, before=(), after=(), skip_empty=False) -> list[int]:
    return [t for d in docs if d or not skip_empty for t in [*before, *tok.encode(d), *after]]


_TOK = load_tokenizer()
ENCODE_DOCUMENTS = Exercise(
    # the first case tells the usual mistakes apart (with one document, several look alike);
    # docs are tuples, so that the learner's function cannot change a case
    "encode_documents", cases=[(_TOK, docs) for docs in (
        ("héllo wörld ☕", "", "A coin's state is heads."),
        ("Once upon a time", " there was a dog."), ("The color of dog can vary widely.",), (),
        ("a", "b", "a b"), ("",))],
    describe=lambda tok, docs: f"docs={list(docs)!r}",
    reference=lambda tok, docs: _each(tok, docs, after=[tok.eot_token]), returns=_a_stream,
    mistakes=named(
        H["encode_documents"], no_eot=_each,
        between=lambda tok, docs: tok.encode("<|endoftext|>".join(docs), allowed_special="all"),
        one_at_end=lambda tok, docs: _each(tok, docs) + [tok.eot_token],
        joined=lambda tok, docs: tok.encode(" ".join(docs)) + [tok.eot_token],
        before=lambda tok, docs: _each(tok, docs, before=[tok.eot_token]),
        skip_empty=lambda tok, docs: _each(tok, docs, after=[tok.eot_token], skip_empty=True),
        as_text=lambda tok, docs: [t for d in docs for t in tok.encode(
            d + "<|endoftext|>", disallowed_special=())],
        gpt2_eot=lambda tok, docs: _each(tok, docs, after=[50256])),
    otherwise=H["encode_documents"]["otherwise"])
check_encode_documents = ENCODE_DOCUMENTS.check
EXERCISES = (COUNT_PARAMS, ENCODE_DOCUMENTS)


# --- exercise 3: the forward pass by hand -------------------------------------------------------
FORWARD_MISTAKES = ("no_wpe", "positions_from_1", "no_ln_f", "no_mask", "head_first")


def _forward(model: GPT, idx: torch.Tensor, mistake: str = "", blocks: int | None = None):
    """GPT.forward spelled out, or with a usual `mistake` or only the first `blocks` blocks."""
    tr = model.transformer
    x = tr.wte(idx)
    if mistake != "no_wpe":
        x = x + tr.wpe(torch.arange(idx.shape[1]) + (mistake == "positions_from_1"))
    attention = F.scaled_dot_product_attention if mistake == "no_mask" else causal_attention
    for i, block in enumerate(tr.h[:blocks]):
        x = block(x, None, i, attention)
    if mistake == "head_first":
        return tr.ln_f(model.lm_head(x))
    return model.lm_head(x if mistake == "no_ln_f" else tr.ln_f(x))


def _forward_mistakes(model: GPT) -> dict:
    """hint -> wrong forward_by_hand, for this model (its number of blocks)."""
    h, n = H["forward_by_hand"], len(model.transformer.h)
    return ({h[m]: functools.partial(_forward, mistake=m) for m in FORWARD_MISTAKES}
            | {h["blocks"].format(k=k, n=n): functools.partial(_forward, blocks=k)
               for k in range(1, n)}
            | named(h, last=lambda model, idx: _forward(model, idx)[:, -1],
                    batch=lambda model, idx: _forward(model, idx)[0]))


def _crash(fn, *args) -> str:
    """How fn(*args) crashes ('' if it does not)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a usual mistake that crashes as the learner's did
        return f"{type(e).__name__}: {e}"
    return ""


@guarded
def check_forward_by_hand(forward_by_hand) -> None:
    """forward_by_hand(model, idx) == model(idx) (within 1e-5), without GPT.forward."""
    name, h = "forward_by_hand", H["forward_by_hand"]
    target, tok = load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(0)
    cases = [(model, torch.randint(0, 512, shape, generator=g), label) for model, shape, label in (
        (tiny_model(0), (1, 6), "tiny random model"),
        (tiny_model(1, n_layer=3), (2, 9), "tiny random model, 3 layers, batch of 2"),
        (tiny_model(2, n_layer=1, n_head=2), (3, 1),
         "tiny random model, 1 layer, batch of 3, one token each"),
        (tiny_model(3, n_layer=4), (1, 40), "tiny random model, 4 layers, 40 tokens"))]
    cases.append((target, torch.tensor([tok.encode("The color of dog can vary widely.")]),
                  "the course target"))
    for model, idx, label in cases:
        shape, mistakes = (*idx.shape, model.config.vocab_size), _forward_mistakes(model)
        case = f"{label}, idx of shape {tuple(idx.shape)}"
        with torch.inference_mode():  # computed before the learner's function runs
            want = model(idx)
        with forbid(name, GPT.forward):
            got = call_hinted(name, case, lambda e: next(
                (h[m] for m in FORWARD_MISTAKES if _crash(mistakes[h[m]], model, idx) ==
                 f"{type(e).__name__}: {e}"), "your function raised on this input"),
                forward_by_hand, model, idx.clone())
        refused = (h["numpy"] if type(got).__module__ == "numpy" else h["not_tensor"]
                   if not isinstance(got, torch.Tensor) else
                   "" if got.is_floating_point() else h["ids"])
        if refused:
            fail(name, case, f"a float tensor of shape {shape}", kind(got), refused)
        with torch.inference_mode():  # float64 logits are as right as float32 ones
            expect_tensor(name, case, got.detach().cpu().to(want.dtype), want, mistakes=mistakes,
                          inputs=(model, idx), hints={"shape": h["shape"].format(shape=shape),
                                                      "close": h["otherwise"]})
    passed(name, len(cases))


# --- exercise 4: predict, then measure: what one generation costs -------------------------------
PREDICT_QUESTION = "A coin's state is tails. Alice doesn't flip, then Bob flips, then Carol flips."


def _generation_mistakes(P: int, words: int, chars: int, n_new: int, limit: int) -> list:
    """((passes, kv) or None for any, hint): n_new tokens after P, stopped by EOS before limit."""
    h = {k: v.format(limit=limit, words=words, chars=chars, P=P, n_new=n_new)
         for k, v in H["predict_generation"].items()}
    return [((limit, P + limit - 1), h["all"]), ((None, P + limit - 1), h["all_kv"]),
            ((limit, None), h["all_passes"]), ((None, P + n_new), h["last_fed_kv"]),
            ((n_new + 1, None), h["last_fed"]), ((None, n_new - 1), h["no_prompt"]),
            ((None, n_new), h["no_prompt"]), ((None, P), h["prefill"]),
            ((P + n_new - 1, None), h["per_token"]),
            ((None, sum(P + i for i in range(n_new))), h["naive"]),
            ((None, words + n_new - 1), h["words"]), ((None, chars + n_new - 1), h["chars"])]


@guarded
def check_predict_generation(predict_generation) -> None:
    """predict_generation() -> (forward passes, K/V vectors per layer), measured by generate."""
    name, h = "predict_generation", H["predict_generation"]
    predicted = prediction(name, f"{name}()", predict_generation, GPT.forward, generate,
                           why=h["ran"])
    values = int_list(predicted)
    if values is None or len(values) != 2:
        fail(name, "predict_generation()", "a pair of ints (forward_passes, kv_computed)",
             predicted, h["refused"])
    target, tok = load_course_model("target", "cpu")
    prompt = PREDICT_QUESTION + " What's the state? A:"
    ids, limit = tok.encode(prompt), 40
    out = generate(target, ids, limit, eos_id=tok.eot_token)  # the measurement
    want = [out.stats.forward_passes, out.stats.kv_computed]
    if values == want:
        print(f"✓ {name}: as measured, {want[0]} forward passes and {want[1]} K/V vectors per "
              f"layer")
        return
    mistakes = _generation_mistakes(len(ids), len(prompt.split()), len(prompt), len(out.tokens),
                                    limit)
    hint = next((h for pair, h in mistakes
                 if all(m is None or m == v for m, v in zip(pair, values))
                 and any(m is not None and m != w for m, w in zip(pair, want))), "")
    fail(name, f"generate(target, tok.encode({prompt!r}), {limit}, eos_id=tok.eot_token): it "
         f"wrote {[tok.decode([t]) for t in out.tokens]}",
         f"{want[0]} forward passes, {want[1]} K/V vectors per layer (measured)",
         f"you predicted {values[0]} passes, {values[1]} K/V vectors",
         hint or h["otherwise"].format(P=len(ids), n_new=len(out.tokens)))


# --- exercise 5: debug a GPT-2 checkpoint loader ------------------------------------------------
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _hf_layout(model: GPT, head: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights in the Hugging Face GPT-2 layout (Conv1D, mask buffers, maybe a head)."""
    sd = {name: t.t().clone() if name.endswith(CONV1D) else t.clone()
          for name, t in model.state_dict().items() if head or name != "lm_head.weight"}
    T = model.config.block_size
    return sd | {f"transformer.h.{i}.attn.bias": torch.ones(T, T).tril().view(1, 1, T, T)
                 for i in range(model.config.n_layer)}


def shipped_load(state_dict, config, transpose=lambda name, t, ours: t.shape != ours.shape,
                 skip=(".attn.bias", ".attn.masked_bias")) -> GPT:
    """The notebook's loader as shipped (a weight transposed when its shape says so), or not."""
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, t in state_dict.items():
            if not (skip and name.endswith(skip)):
                ours[name].copy_(t.t() if transpose(name, t, ours[name]) else t)
    return model


def _loader_error_hint(e: Exception) -> str:
    text, h = f"{type(e).__name__}: {e}", H["load_gpt2_fixed"]
    return (h["mask_buffer"] if isinstance(e, KeyError) and "attn.bias" in text else
            h["no_head"] if isinstance(e, KeyError) and "lm_head" in text else
            h["embeddings"] if "wte" in text or "wpe" in text else
            h["shape"] if "size" in text or "shape" in text else h["raised"])


@guarded
def check_load_gpt2(load_gpt2_fixed) -> None:
    """load_gpt2_fixed(state_dict, config) -> a tied minikv.GPT with the source model's logits."""
    name, h = "load_gpt2_fixed", H["load_gpt2_fixed"]
    target, tok = load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(5)
    cases = [(tiny_model(11), "a tiny random model (2 layers, n_embd 64)", True),
             (tiny_model(12, n_layer=3, n_head=2, n_embd=48), "a 3-layer random model, no "
              "'lm_head.weight' in the checkpoint", False),
             (target, "the course target", True)]
    for model, label, head in cases:
        case = f"{label}: load_gpt2_fixed(its Hugging Face-layout state dict, its config)"
        idx = (torch.tensor([tok.encode("The color of dog can vary widely.")]) if model is target
               else torch.randint(0, model.config.vocab_size, (2, 11), generator=g))
        with torch.inference_mode():
            want = model(idx)
        with forbid(name, GPT.from_gpt2_state_dict):
            got = call_hinted(name, case, _loader_error_hint, load_gpt2_fixed,
                              _hf_layout(model, head), model.config)
        if not isinstance(got, GPT):
            fail(name, case, "a minikv.GPT", type(got).__name__, h["not_model"]
                 + (" (did you forget to return it?)" if got is None else ""))
        if got.eval().lm_head.weight is not got.transformer.wte.weight:
            fail(name, case, "lm_head.weight IS transformer.wte.weight (tied)",
                 "two different tensors", h["untied"])
        with torch.inference_mode():
            logits = got(idx)
        if close(logits, want):
            continue
        with torch.inference_mode():
            buggy = shipped_load(_hf_layout(model, head), model.config)(idx)
        ours = model.state_dict()
        wrong = [n for n, t in got.state_dict().items() if not torch.equal(t, ours.get(n, t))]
        hint = h["shipped"] if close(logits, buggy) else h["differ"].format(
            wrong=wrong[:4], more=" ..." if len(wrong) > 4 else "") + (
            h["c_proj"] if wrong and all(n.endswith("attn.c_proj.weight") for n in wrong) else
            h["otherwise"] if wrong else "")
        error = float((logits.double() - want.double()).abs().max())
        fail(name, case, "the checkpoint's model's logits (within 1e-5)",
             f"logits off by up to {error:.3g}", hint)
    passed(name, len(cases))


# --- exercise 6: design: the widest model that fits a memory budget -----------------------------
WIDTH_BUDGET = 24 * 2**20  # bytes of float32 weights
WIDTH_SHAPE = dict(vocab_size=1024, block_size=256, n_layer=12, n_head=8)


def _weight_bytes(n_embd: int) -> int:
    """float32 bytes of minikv.GPT's parameters (the tied head once), built on the meta device."""
    return _num_params(GPTConfig(n_embd=n_embd, **WIDTH_SHAPE)) * 4


def _widest(budget: int) -> int:
    """The largest multiple of 8 whose model's float32 weights fit `budget` bytes."""
    return 8 * bisect.bisect_right(range(1, 128), budget, key=lambda m: _weight_bytes(8 * m))


@guarded
def check_choose_width(choose_width) -> None:
    """choose_width() -> the widest n_embd (a multiple of 8) whose float32 weights fit 24 MiB."""
    name, h = "choose_width", H["choose_width"]
    got = call(name, "choose_width()", choose_width)
    width = as_int(got)
    case = (f"GPTConfig(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=your "
            f"choice), float32 weights within 24 MiB = {WIDTH_BUDGET:,} bytes")
    if width is None or width <= 0:
        fail(name, case, "a positive int n_embd", got, h["refused"])
    if width % WIDTH_SHAPE["n_head"]:
        fail(name, case, "an n_embd that 8 heads split evenly", width,
             h["heads"].format(width=width))
    used = _weight_bytes(width)
    shown = f"n_embd={width}: {used:,} bytes ({used / 2**20:.2f} MiB)"
    if used > WIDTH_BUDGET:
        embeddings = (WIDTH_SHAPE["vocab_size"] + WIDTH_SHAPE["block_size"]) * width  # wte, wpe
        fail(name, case, f"at most {WIDTH_BUDGET:,} bytes", shown, h["embeddings"].format(
            embeddings=embeddings, width=width, mib=4 * embeddings / 2**20)
            if used - 4 * embeddings <= WIDTH_BUDGET else
            h["two_bytes"] if used // 2 <= WIDTH_BUDGET else h["over"])
    if width != _widest(WIDTH_BUDGET):
        fail(name, case, "the widest n_embd whose weights fit", shown,
             h["wider"].format(width=width, mib=used / 2**20)
             + (h["mb"] if width == _widest(24 * 10**6) else ""))
    print(f"✓ {name}: n_embd={width} is the widest that fits ({used / 2**20:.2f} MiB of 24)")
