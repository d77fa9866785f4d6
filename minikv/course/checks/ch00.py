"""Chapter 00's checkers: count_params, encode_documents (tables), forward_by_hand,
predict_generation, load_gpt2_fixed and choose_width. Hints: hints/ch00.toml."""
from __future__ import annotations

import bisect
import functools

import torch
import torch.nn.functional as F

from ...engine import GPT, GPTConfig, generate
from ...engine.model import causal_attention
from .. import checks as ck
from ..checkpoint import load_course_model
from ..tokenizer import load_tokenizer

H = ck.hints("ch00")
COUNT, ENC, FWD, GEN, LOAD, WIDTH = (H[k] for k in (
    "count_params", "encode_documents", "forward_by_hand", "predict_generation",
    "load_gpt2_fixed", "choose_width"))


# --- exercise 1: count the parameters -----------------------------------------------------------
@functools.cache
def _num_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return GPT(cfg).num_params()


def _off_by(extra):  # a wrong count: the right one plus extra(C, L, V, P)
    return lambda c: _num_params(c) + extra(c.n_embd, c.n_layer, c.vocab_size, c.block_size)


def _a_count(got, cfg) -> int:
    if ck.as_int(got) is None:
        raise ck.Refused(COUNT["refused"].format(type=type(got).__name__) + (
            COUNT["refused_float"] if "float" in type(got).__name__ else ""))
    return ck.as_int(got)


COUNT_PARAMS = ck.Exercise(
    "count_params",
    cases=[(GPTConfig.preset(p),) for p in ("gpt2", "target", "draft", "tiny", "small")]
    + [(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2),),
       (GPTConfig(vocab_size=97, block_size=33, n_layer=5, n_head=3, n_embd=24),)],
    describe=lambda cfg: (f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                          f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd})"),
    reference=_num_params, returns=_a_count, otherwise=COUNT["otherwise"],
    mistakes=ck.named(COUNT, lm_head=_off_by(lambda C, L, V, P: V * C),
                      ln_f=_off_by(lambda C, L, V, P: -2 * C),
                      biases=_off_by(lambda C, L, V, P: -L * 9 * C),
                      layernorms=_off_by(lambda C, L, V, P: -L * 4 * C),
                      biases_and_layernorms=_off_by(lambda C, L, V, P: -L * 13 * C),
                      matrices_only=_off_by(lambda C, L, V, P: -L * 13 * C - 2 * C),
                      wpe=_off_by(lambda C, L, V, P: -P * C),
                      c_proj=_off_by(lambda C, L, V, P: -L * (C * C + C)),
                      mlp_width=_off_by(lambda C, L, V, P: -L * (6 * C * C + 3 * C))))
check_count_params = COUNT_PARAMS.check


# --- exercise 2: documents as one token stream --------------------------------------------------
def _each(tok, docs, before=(), after=(), skip_empty=False) -> list[int]:
    return [t for d in docs if d or not skip_empty for t in [*before, *tok.encode(d), *after]]


ENCODE_DOCUMENTS = ck.Exercise(  # the first case tells the mistakes apart; tuples stay whole
    "encode_documents", cases=[(load_tokenizer(), docs) for docs in (
        ("héllo wörld ☕", "", "A coin's state is heads."),
        ("Once upon a time", " there was a dog."), ("The color of dog can vary widely.",), (),
        ("a", "b", "a b"), ("",))],
    describe=lambda tok, docs: f"docs={list(docs)!r}",
    returns=lambda got, *case: ck.token_ids(got, ENC),
    reference=lambda tok, docs: _each(tok, docs, after=[tok.eot_token]),
    mistakes=ck.named(
        ENC, no_eot=_each,
        between=lambda tok, docs: tok.encode("<|endoftext|>".join(docs), allowed_special="all"),
        one_at_end=lambda tok, docs: _each(tok, docs) + [tok.eot_token],
        joined=lambda tok, docs: tok.encode(" ".join(docs)) + [tok.eot_token],
        before=lambda tok, docs: _each(tok, docs, before=[tok.eot_token]),
        skip_empty=lambda tok, docs: _each(tok, docs, after=[tok.eot_token], skip_empty=True),
        as_text=lambda tok, docs: [t for d in docs for t in tok.encode(
            d + "<|endoftext|>", disallowed_special=())],
        gpt2_eot=lambda tok, docs: _each(tok, docs, after=[50256])),
    otherwise=ENC["otherwise"])
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


def _crash(fn, *args) -> str:  # how fn(*args) crashes ('' if it does not)
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a usual mistake that crashes as the learner's did
        return f"{type(e).__name__}: {e}"
    return ""


@ck.guarded
def check_forward_by_hand(forward_by_hand) -> None:
    name, (target, tok) = "forward_by_hand", load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(0)
    cases = [(model, torch.randint(0, 512, shape, generator=g), label) for model, shape, label in (
        (ck.tiny_model(0), (1, 6), "tiny random model"),
        (ck.tiny_model(1, n_layer=3), (2, 9), "tiny random model, 3 layers, batch of 2"),
        (ck.tiny_model(2, n_layer=1, n_head=2), (3, 1),
         "tiny random model, 1 layer, batch of 3, one token each"),
        (ck.tiny_model(3, n_layer=4), (1, 40), "tiny random model, 4 layers, 40 tokens"))]
    cases.append((target, torch.tensor([tok.encode("The color of dog can vary widely.")]),
                  "the course target"))
    for model, idx, label in cases:
        n, shape = len(model.transformer.h), (*idx.shape, model.config.vocab_size)
        mistakes = ({FWD[m]: functools.partial(_forward, mistake=m) for m in FORWARD_MISTAKES}
                    | {FWD["blocks"].format(k=k, n=n): functools.partial(_forward, blocks=k)
                       for k in range(1, n)}
                    | ck.named(FWD, last=lambda model, idx: _forward(model, idx)[:, -1],
                               batch=lambda model, idx: _forward(model, idx)[0]))
        case = f"{label}, idx of shape {tuple(idx.shape)}"
        with torch.inference_mode():  # computed before the learner's function runs
            want = model(idx)
        with ck.forbid(name, GPT.forward):
            got = ck.call_hinted(name, case, lambda e: next(
                (FWD[m] for m in FORWARD_MISTAKES if _crash(mistakes[FWD[m]], model, idx) ==
                 f"{type(e).__name__}: {e}"), "your function raised on this input"),
                forward_by_hand, model, idx.clone())
        refused = (FWD["numpy"] if type(got).__module__ == "numpy" else FWD["not_tensor"]
                   if not isinstance(got, torch.Tensor) else
                   "" if got.is_floating_point() else FWD["ids"])
        if refused:
            ck.fail(name, case, f"a float tensor of shape {shape}", ck.kind(got), refused)
        with torch.inference_mode():  # float64 logits are as right as float32 ones
            ck.expect_tensor(name, case, got.detach().cpu().to(want.dtype), want,
                             mistakes=mistakes, inputs=(model, idx),
                             hints={"shape": FWD["shape"].format(shape=shape),
                                    "close": FWD["otherwise"]})
    ck.passed(name, len(cases))


# --- exercise 4: predict, then measure: what one generation costs -------------------------------
PREDICT_QUESTION = "A coin's state is tails. Alice doesn't flip, then Bob flips, then Carol flips."


def _generation_mistakes(P: int, words: int, chars: int, n_new: int, limit: int) -> list:
    """((passes, kv) or None for any, hint): n_new tokens after P, stopped by EOS before limit."""
    h = {k: v.format(limit=limit, words=words, chars=chars, P=P, n_new=n_new)
         for k, v in GEN.items()}
    return [((limit, P + limit - 1), h["all"]), ((None, P + limit - 1), h["all_kv"]),
            ((limit, None), h["all_passes"]), ((None, P + n_new), h["last_fed_kv"]),
            ((n_new + 1, None), h["last_fed"]), ((None, n_new - 1), h["no_prompt"]),
            ((None, n_new), h["no_prompt"]), ((None, P), h["prefill"]),
            ((P + n_new - 1, None), h["per_token"]),
            ((None, sum(P + i for i in range(n_new))), h["naive"]),
            ((None, words + n_new - 1), h["words"]), ((None, chars + n_new - 1), h["chars"])]


@ck.guarded
def check_predict_generation(predict_generation) -> None:
    name = "predict_generation"
    predicted = ck.prediction(name, f"{name}()", predict_generation, GPT.forward, generate,
                              why=GEN["ran"])
    values = ck.int_list(predicted)
    if values is None or len(values) != 2:
        ck.fail(name, f"{name}()", "a pair of ints (forward_passes, kv_computed)", predicted,
                GEN["refused"])
    (target, tok), prompt, limit = load_course_model("target", "cpu"), \
        PREDICT_QUESTION + " What's the state? A:", 40
    ids = tok.encode(prompt)
    out = generate(target, ids, limit, eos_id=tok.eot_token)  # the measurement
    want = [out.stats.forward_passes, out.stats.kv_computed]
    if values == want:
        return print(f"✓ {name}: as measured, {want[0]} forward passes and {want[1]} K/V "
                     f"vectors per layer")
    hint = ck.pair_hint(_generation_mistakes(len(ids), len(prompt.split()), len(prompt),
                                             len(out.tokens), limit), values, want, "")
    ck.fail(name, f"generate(target, tok.encode({prompt!r}), {limit}, eos_id=tok.eot_token): it "
            f"wrote {[tok.decode([t]) for t in out.tokens]}",
            f"{want[0]} forward passes, {want[1]} K/V vectors per layer (measured)",
            f"you predicted {values[0]} passes, {values[1]} K/V vectors",
            hint or GEN["otherwise"].format(P=len(ids), n_new=len(out.tokens)))


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
    text = f"{type(e).__name__}: {e}"
    return LOAD["mask_buffer" if isinstance(e, KeyError) and "attn.bias" in text else
                "no_head" if isinstance(e, KeyError) and "lm_head" in text else
                "embeddings" if "wte" in text or "wpe" in text else
                "shape" if "size" in text or "shape" in text else "raised"]


@ck.guarded
def check_load_gpt2(load_gpt2_fixed) -> None:
    name, (target, tok) = "load_gpt2_fixed", load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(5)
    cases = [(ck.tiny_model(11), "a tiny random model (2 layers, n_embd 64)", True),
             (ck.tiny_model(12, n_layer=3, n_head=2, n_embd=48), "a 3-layer random model, no "
              "'lm_head.weight' in the checkpoint", False), (target, "the course target", True)]
    for model, label, head in cases:
        case = f"{label}: load_gpt2_fixed(its Hugging Face-layout state dict, its config)"
        idx = (torch.tensor([tok.encode("The color of dog can vary widely.")]) if model is target
               else torch.randint(0, model.config.vocab_size, (2, 11), generator=g))
        with torch.inference_mode():
            want = model(idx)
        with ck.forbid(name, GPT.from_gpt2_state_dict):
            got = ck.call_hinted(name, case, _loader_error_hint, load_gpt2_fixed,
                                 _hf_layout(model, head), model.config)
        if not isinstance(got, GPT):
            ck.fail(name, case, "a minikv.GPT", type(got).__name__, LOAD["not_model"]
                    + (" (did you forget to return it?)" if got is None else ""))
        ck.expect(got.eval().lm_head.weight is got.transformer.wte.weight, name, case,
                  "lm_head.weight IS transformer.wte.weight (tied)", "two different tensors",
                  LOAD["untied"])
        with torch.inference_mode():
            logits, buggy = got(idx), shipped_load(_hf_layout(model, head), model.config)(idx)
        if ck.close(logits, want):
            continue
        ours = model.state_dict()
        wrong = [n for n, t in got.state_dict().items() if not torch.equal(t, ours.get(n, t))]
        hint = LOAD["shipped"] if ck.close(logits, buggy) else LOAD["differ"].format(
            wrong=wrong[:4], more=" ..." if len(wrong) > 4 else "") + (
            LOAD["c_proj"] if wrong and all(n.endswith("attn.c_proj.weight") for n in wrong) else
            LOAD["otherwise"] if wrong else "")
        ck.fail(name, case, "the checkpoint's model's logits (within 1e-5)",
                f"logits off by up to {float((logits.double() - want.double()).abs().max()):.3g}",
                hint)
    ck.passed(name, len(cases))


# --- exercise 6: design: the widest model that fits a memory budget -----------------------------
WIDTH_BUDGET = 24 * 2**20  # bytes of float32 weights, choose_width()'s default
WIDTH_SHAPE = dict(vocab_size=1024, block_size=256, n_layer=12, n_head=8)


def _weight_bytes(n_embd: int) -> int:  # float32 bytes of the parameters (the tied head once)
    return _num_params(GPTConfig(n_embd=n_embd, **WIDTH_SHAPE)) * 4


def _widest(budget: int) -> int:  # the largest multiple of 8 whose float32 weights fit
    return 8 * bisect.bisect_right(range(1, 128), budget, key=lambda m: _weight_bytes(8 * m))


@ck.guarded
def check_choose_width(choose_width) -> None:
    name = "choose_width"  # the default budget first, then others: exactly full, a byte short
    for budget in (None, _weight_bytes(200), _weight_bytes(200) - 1, 4 * 2**20, 100 * 2**20):
        args, b = (() if budget is None else (budget,)), budget or WIDTH_BUDGET
        got = ck.call(name, f"choose_width({', '.join(map(str, args))})", choose_width, *args)
        width, best = ck.as_int(got), _widest(b)
        case = (f"GPTConfig(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=your "
                f"choice), float32 weights within {b:,} bytes ({b / 2**20:g} MiB)")
        if width is None or width <= 0:
            ck.fail(name, case, "a positive int n_embd", got, WIDTH["refused"])
        ck.expect(width % 8 == 0, name, case, "an n_embd that 8 heads split evenly", width,
                  WIDTH["heads"].format(width=width))
        used = _weight_bytes(width)
        shown = f"n_embd={width}: {used:,} bytes ({used / 2**20:.2f} MiB)"
        if width != best and budget is not None and width == _widest(WIDTH_BUDGET):
            ck.fail(name, case, f"n_embd={best}", shown, WIDTH["budget"])
        if used > b:
            embeddings = (WIDTH_SHAPE["vocab_size"] + WIDTH_SHAPE["block_size"]) * width
            ck.fail(name, case, f"at most {b:,} bytes", shown, WIDTH["embeddings"].format(
                embeddings=embeddings, width=width, mib=4 * embeddings / 2**20)
                if used - 4 * embeddings <= b else
                WIDTH["two_bytes"] if used // 2 <= b else WIDTH["over"])
        ck.expect(width == best, name, case, "the widest n_embd whose weights fit", shown,
                  WIDTH["wider"].format(width=width, mib=used / 2**20) + (
                      WIDTH["mb"] if budget is None and width == _widest(24 * 10**6) else ""))
        if budget is None:
            message = (f"✓ {name}: n_embd={width} is the widest that fits ({used / 2**20:.2f} "
                       f"MiB of 24)")
    print(message)
