"""Checkers for chapter 00 (setup and a tiny GPT).

- count_params (a table): against sum(p.numel()) of models built on the meta device, an int;
- encode_documents (a table): against the course tokenizer, one flat list of ints;
- forward_by_hand: against model(idx) on tiny random models and the target, no GPT.forward;
- predict_generation (predict, then measure): one greedy generation's passes and K/V vectors;
- load_gpt2_fixed (debug): the shipped Hugging Face-layout loader fixed, logits against the source;
- choose_width (design): the widest n_embd whose float32 weights fit 24 MiB, measured on meta.
"""
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
    diagnose,
    fail,
    forbid,
    guarded,
    int_list,
    kind,
    passed,
    prediction,
    tiny_model,
)


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
    if as_int(got) is None:
        raise Refused(f"return an int, not a {type(got).__name__}: a parameter count is a whole "
                      f"number" + (" (count with integers: // not /, no float(), no math.pow)"
                                   if isinstance(got, float) or "float" in type(got).__name__
                                   else ""))
    return as_int(got)


COUNT_PARAMS = Exercise(
    "count_params",
    cases=[(GPTConfig.preset(p),) for p in ("gpt2", "target", "draft", "tiny", "small")]
    + [(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2),),
       (GPTConfig(vocab_size=97, block_size=33, n_layer=5, n_head=3, n_embd=24),)],
    describe=lambda cfg: (f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                          f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd})"),
    reference=_num_params, returns=_a_count,
    mistakes={
        "this is what you get when you count the LM head as well: it is tied to wte (the same "
        "tensor), so it adds nothing": _off_by(lambda C, L, V, P: V * C),
        "this is what you get when you forget the final LayerNorm ln_f (2·C)":
            _off_by(lambda C, L, V, P: -2 * C),
        "this is what you get when you forget the biases of the four linears in each block (3C + "
        "C + 4C + C = 9·C per block)": _off_by(lambda C, L, V, P: -L * 9 * C),
        "this is what you get when you forget the two LayerNorms of each block (a weight and a "
        "bias of C each: 4·C per block)": _off_by(lambda C, L, V, P: -L * 4 * C),
        "this is what you get when you forget every block's biases and LayerNorms (13·C per "
        "block)": _off_by(lambda C, L, V, P: -L * 13 * C),
        "this is what you get when you count only the weight matrices: every bias and LayerNorm "
        "is missing": _off_by(lambda C, L, V, P: -L * 13 * C - 2 * C),
        "this is what you get when you forget the position embeddings wpe (block_size × C)":
            _off_by(lambda C, L, V, P: -P * C),
        "this is what you get when you forget the attention's output projection c_proj (C × C + "
        "C per block)": _off_by(lambda C, L, V, P: -L * (C * C + C)),
        "this is what you get when the MLP's hidden width is C instead of 4·C":
            _off_by(lambda C, L, V, P: -L * (6 * C * C + 3 * C)),
    },
    otherwise="count every parameter section 2 lists, each shape as it follows from the config: "
              "per block two LayerNorms and four linears (weights and biases), then wte, wpe and "
              "ln_f; the tied head adds nothing")
check_count_params = COUNT_PARAMS.check


# --- exercise 2: documents as one token stream --------------------------------------------------
def _a_stream(got, tok, docs) -> list[int]:
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        raise Refused(f"return a Python list of ints, not a {type(got).__module__}."
                      f"{type(got).__name__} (use .tolist())")
    if not isinstance(got, (list, tuple)):
        raise Refused(f"return a list of ints, not a {type(got).__name__}")
    if any(isinstance(t, (list, tuple)) for t in got):
        raise Refused("this is what you get when you return one list per document: return ONE "
                      "flat list (the stream), e.g. ids += ... for each document")
    if int_list(got) is None:
        bad = next(t for t in got if as_int(t) is None)
        raise Refused(f"every token id must be an int, got {bad!r} ({type(bad).__name__})")
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
    mistakes={
        "this is what you get when you forget <|endoftext|>: append tok.eot_token after every "
        "document": _each,
        "this is what you get when <|endoftext|> goes only BETWEEN documents: the last one needs "
        "one too (every document is followed by it)":
            lambda tok, docs: tok.encode("<|endoftext|>".join(docs), allowed_special="all"),
        "this is what you get when you put one <|endoftext|> at the very end: every document is "
        "followed by its own": lambda tok, docs: _each(tok, docs) + [tok.eot_token],
        "this is what you get when you join the documents into one text: encode each one on its "
        "own and follow each by tok.eot_token":
            lambda tok, docs: tok.encode(" ".join(docs)) + [tok.eot_token],
        "this is what you get when <|endoftext|> goes BEFORE each document: it ends a document, "
        "it goes after": lambda tok, docs: _each(tok, docs, before=[tok.eot_token]),
        "this is what you get when you skip the empty document: an empty text is still a "
        "document, followed by <|endoftext|>":
            lambda tok, docs: _each(tok, docs, after=[tok.eot_token], skip_empty=True),
        "this is what you get when you encode the text '<|endoftext|>' as ordinary characters "
        "(disallowed_special=()): it becomes several byte tokens; the special token is the one "
        "id tok.eot_token": lambda tok, docs: [t for d in docs for t in tok.encode(
            d + "<|endoftext|>", disallowed_special=())],
        "50256 is GPT-2's <|endoftext|>, not the course tokenizer's: use tok.eot_token (1023)":
            lambda tok, docs: _each(tok, docs, after=[50256]),
    },
    otherwise="encode each document on its own and put tok.eot_token after every one (an empty "
              "one included)")
check_encode_documents = ENCODE_DOCUMENTS.check
EXERCISES = (COUNT_PARAMS, ENCODE_DOCUMENTS)


# --- exercise 3: the forward pass by hand -------------------------------------------------------
FORWARD_MISTAKES = {
    "no wpe": "this is what you get without the position embeddings: add "
              "model.transformer.wpe(torch.arange(T)) to the token embeddings",
    "positions from 1": "this is what you get when positions start at 1: the first token is at "
                        "position 0 (torch.arange(T))",
    "no ln_f": "this is what you get when you forget the final LayerNorm: "
               "model.transformer.ln_f comes after the last block, before the LM head",
    "no mask": "this is what you get without the causal mask: a position may attend only to "
               "itself and the positions before it (call each block with causal_attention)",
    "head first": "this is what you get when you apply the LM head before the final LayerNorm: "
                  "ln_f normalises the C-wide hidden states, then lm_head maps them to the "
                  "vocabulary",
}


def _forward(model: GPT, idx: torch.Tensor, mistake: str = "", blocks: int | None = None):
    """GPT.forward spelled out, or with a usual `mistake` or only the first `blocks` blocks."""
    tr = model.transformer
    x = tr.wte(idx)
    if mistake != "no wpe":
        x = x + tr.wpe(torch.arange(idx.shape[1]) + (mistake == "positions from 1"))
    attention = F.scaled_dot_product_attention if mistake == "no mask" else causal_attention
    for i, block in enumerate(tr.h[:blocks]):
        x = block(x, None, i, attention)
    if mistake == "head first":
        return tr.ln_f(model.lm_head(x))
    return model.lm_head(x if mistake == "no ln_f" else tr.ln_f(x))


def _forward_mistakes(model: GPT) -> dict:
    """hint -> wrong forward_by_hand, for this model (its number of blocks)."""
    n = len(model.transformer.h)
    return ({h: functools.partial(_forward, mistake=m) for m, h in FORWARD_MISTAKES.items()}
            | {f"this is what you get when you run only {k} of the model's {n} blocks: loop over "
               f"model.transformer.h, whatever its length": functools.partial(_forward, blocks=k)
               for k in range(1, n)}
            | {"this is what you get when you return only the last position: return all T "
               "positions (B, T, vocab)": lambda model, idx: _forward(model, idx)[:, -1],
               "you dropped the batch dimension: keep shape (B, T, vocab)":
                   lambda model, idx: _forward(model, idx)[0]})


def _crash(fn, *args) -> str:
    """How fn(*args) crashes ('' if it does not)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a usual mistake that crashes as the learner's did
        return f"{type(e).__name__}: {e}"
    return ""


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@guarded
def check_forward_by_hand(forward_by_hand) -> None:
    """forward_by_hand(model, idx) == model(idx) (within 1e-5), without GPT.forward."""
    name = "forward_by_hand"
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
        shape = (*idx.shape, model.config.vocab_size)
        case = f"{label}, idx of shape {tuple(idx.shape)}"
        with torch.inference_mode():  # computed before the learner's function runs
            want = model(idx)
        with forbid(name, GPT.forward):
            got = call_hinted(name, case, lambda e: next(
                (h for m, h in FORWARD_MISTAKES.items() if _crash(_forward, model, idx, m) ==
                 f"{type(e).__name__}: {e}"), "your function raised on this input"),
                forward_by_hand, model, idx.clone())
        refused = ("return the logits as a torch.Tensor, not a numpy array (no .numpy())"
                   if type(got).__module__ == "numpy" else
                   "return the logits tensor itself, of shape (B, T, vocab)"
                   if not isinstance(got, torch.Tensor) else
                   "" if got.is_floating_point() else "return the logits, not the argmax ids")
        if refused:
            fail(name, case, f"a float tensor of shape {shape}", kind(got), refused)
        got = got.detach().cpu()
        if _close(got, want):
            continue
        with torch.inference_mode():
            hint = diagnose(_forward_mistakes(model), [((model, idx), got)],
                            same=lambda a, b: _close(a.squeeze(), b.squeeze()))
        if tuple(got.shape) != shape:
            fail(name, case, f"shape {shape}", f"shape {tuple(got.shape)}", hint or
                 f"return logits for every position: shape (B, T, vocab) = {shape}")
        error = float((got.double() - want.double()).abs().max())
        fail(name, case, "model(idx), within 1e-5", f"logits off by up to {error:.3g}", hint or
             "wte(idx) + wpe(positions 0..T-1), every block in order with causal_attention, "
             "then ln_f, then lm_head")
    passed(name, len(cases))


# --- exercise 4: predict, then measure: what one generation costs -------------------------------
PREDICT_QUESTION = "A coin's state is tails. Alice doesn't flip, then Bob flips, then Carol flips."
FORGOT_PROMPT = ("you forgot the prompt: the prefill computes the K/V of every prompt token, in "
                 "one pass")


def _generation_mistakes(P: int, words: int, chars: int, n_new: int, limit: int) -> list:
    """((passes, kv) or None for any, hint): n_new tokens after P, stopped by EOS before limit."""
    return [
        ((limit, P + limit - 1), f"you predicted all {limit} tokens (max_new_tokens): generation "
         f"stops right after <|endoftext|>, and the target ends its answer quickly (chapter "
         f"section 3 shows how it answers a coin question)"),
        ((None, P + limit - 1), f"that K/V count is for all {limit} tokens (max_new_tokens): "
         f"generation stops right after <|endoftext|>"),
        ((limit, None), f"{limit} passes is max_new_tokens: generation stops right after "
         f"<|endoftext|>"),
        ((None, P + n_new), "you counted the last new token as fed: <|endoftext|> is returned, "
         "never fed back (no pass computes its K/V)"),
        ((n_new + 1, None), "you counted the last new token as fed (or the prefill as a pass "
         "of its own): the prefill's pass already yields the first new token, and the last one "
         "is never fed"),
        ((None, n_new - 1), FORGOT_PROMPT), ((None, n_new), FORGOT_PROMPT),
        ((None, P), "that is the prefill alone: every decode pass after it computes the K/V "
         "of the token it feeds"),
        ((P + n_new - 1, None), "that is one pass per token: the prompt goes through the model "
         "in ONE pass (the prefill), then one pass per new token but the last"),
        ((None, sum(P + i for i in range(n_new))), "that is what the naive decoder computes "
         "(every pass feeds the whole sequence again); generate's default mode keeps a KV "
         "cache: each pass computes only the K/V of the tokens it feeds"),
        ((None, words + n_new - 1), f"{words} is the prompt's word count: the cache holds one "
         f"K/V per TOKEN (len(tok.encode(prompt)) = {P})"),
        ((None, chars + n_new - 1), f"{chars} is the prompt's character count: the cache "
         f"holds one K/V per TOKEN"),
    ]


@guarded
def check_predict_generation(predict_generation) -> None:
    """predict_generation() -> (forward passes, K/V vectors per layer), measured by generate."""
    name = "predict_generation"
    predicted = prediction(name, f"{name}()", predict_generation, GPT.forward, generate,
                           why="a prediction is committed BEFORE the measurement; reason from "
                               "the chapter and return the numbers (counting the prompt's tokens "
                               "with the tokenizer is fine)")
    values = int_list(predicted)
    if values is None or len(values) != 2:
        fail(name, "predict_generation()", "a pair of ints (forward_passes, kv_computed)",
             predicted, "return the two numbers you predict, as ints, e.g. return 7, 9")
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
         hint or f"the prompt is {len(ids)} tokens, fed once; the model wrote "
                 f"{len(out.tokens)} tokens, the last of them never fed")


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
    if isinstance(e, KeyError) and "attn.bias" in text:
        return ("'attn.bias' is GPT-2's causal-mask buffer, not a weight: minikv builds its mask "
                "in causal_attention, so skip it (and 'attn.masked_bias')")
    if isinstance(e, KeyError) and "lm_head" in text:
        return ("some GPT-2 checkpoints have no 'lm_head.weight' (the head is tied to wte): "
                "do not require it")
    if "wte" in text or "wpe" in text:
        return ("the embeddings (wte, wpe) are stored the same way in both layouts, one row per "
                "token or position: transpose only the four Conv1D weights")
    if "size" in text or "shape" in text:
        return ("a shape mismatch: GPT-2 stores the four Conv1D weights (attn.c_attn, attn.c_proj, "
                "mlp.c_fc, mlp.c_proj) as (in, out), nn.Linear as (out, in): transpose all four, "
                "and nothing else")
    return "your loader raised on this checkpoint"


@guarded
def check_load_gpt2(load_gpt2_fixed) -> None:
    """load_gpt2_fixed(state_dict, config) -> a tied minikv.GPT with the source model's logits."""
    name = "load_gpt2_fixed"
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
            fail(name, case, "a minikv.GPT", type(got).__name__,
                 "return the model you loaded the weights into"
                 + (" (did you forget to return it?)" if got is None else ""))
        if got.eval().lm_head.weight is not got.transformer.wte.weight:
            fail(name, case, "lm_head.weight IS transformer.wte.weight (tied)",
                 "two different tensors", "GPT-2 ties the LM head to the token embedding: load "
                 "the weights into the tensors GPT(config) made (copy_ into them), do not replace "
                 "a parameter with a new one")
        with torch.inference_mode():
            logits = got(idx)
        if _close(logits, want):
            continue
        with torch.inference_mode():
            buggy = shipped_load(_hf_layout(model, head), model.config)(idx)
        ours = model.state_dict()
        wrong = [n for n, t in got.state_dict().items() if not torch.equal(t, ours.get(n, t))]
        hint = f"weights that differ from the checkpoint's model: {wrong[:4]}" + (
            " ..." if len(wrong) > 4 else "") + ". "
        if _close(logits, buggy):
            hint = ("these are the shipped loader's logits: the bug is still there. It loads "
                    "without an error and the model runs, but some weight is still in GPT-2's "
                    "(in, out) layout: one whose shape is the same in both layouts, so the "
                    "shape test cannot tell it needs transposing")
        elif wrong and all(n.endswith("attn.c_proj.weight") for n in wrong):
            hint += ("attn.c_proj.weight is a Conv1D weight too, and square (C x C): the shape "
                     "cannot tell you it needs transposing, its name can")
        elif wrong:
            hint += ("load each tensor under its own name, transposing exactly the four Conv1D "
                     "weights")
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
    name = "choose_width"
    got = call(name, "choose_width()", choose_width)
    width = as_int(got)
    case = (f"GPTConfig(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=your "
            f"choice), float32 weights within 24 MiB = {WIDTH_BUDGET:,} bytes")
    if width is None or width <= 0:
        fail(name, case, "a positive int n_embd", got, "return the width you choose, an int")
    if width % WIDTH_SHAPE["n_head"]:
        fail(name, case, "an n_embd that 8 heads split evenly", width,
             f"GPTConfig refuses n_embd={width} with n_head=8 (each head gets n_embd / n_head "
             f"dimensions): choose a multiple of 8")
    used = _weight_bytes(width)
    shown = f"n_embd={width}: {used:,} bytes ({used / 2**20:.2f} MiB)"
    if used > WIDTH_BUDGET:
        embeddings = (WIDTH_SHAPE["vocab_size"] + WIDTH_SHAPE["block_size"]) * width  # wte, wpe
        fail(name, case, f"at most {WIDTH_BUDGET:,} bytes", shown,
             f"over budget: you left out the embeddings; wte and wpe hold {embeddings:,} "
             f"parameters at n_embd={width} ({4 * embeddings / 2**20:.1f} MiB)"
             if used - 4 * embeddings <= WIDTH_BUDGET else
             "over budget: you counted 2 bytes per parameter; the budget is for float32 weights, "
             "4 bytes each" if used // 2 <= WIDTH_BUDGET else
             "over budget: count every parameter (section 2 lists them), the tied head once, 4 "
             "bytes each (float32)")
    if width != _widest(WIDTH_BUDGET):
        hint = (f"n_embd={width} fits ({used / 2**20:.2f} MiB), but a wider model fits too, and "
                f"the goal is the widest")
        if width == _widest(24 * 10**6):
            hint += (": 24 MiB is 24 x 2**20 bytes, not 24 x 10**6 (the widest for 24 MB "
                     "is the one you chose)")
        fail(name, case, "the widest n_embd whose weights fit", shown, hint)
    print(f"✓ {name}: n_embd={width} is the widest that fits ({used / 2**20:.2f} MiB of 24)")
