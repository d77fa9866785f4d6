"""Checkers for chapter 00 (setup and a tiny GPT).

- count_params: against sum(p.numel()) of real models built on the meta device (GPT-2's 124M costs
  nothing), as an int;
- encode_documents: against the course tokenizer, as a flat list of ints;
- forward_by_hand: against the model's own forward pass, on random tiny models of several depths
  and on the course target, without calling GPT.forward;
- predict_generation (predict, then measure): the forward passes and K/V vectors of one greedy
  generation, predicted without running the model, then measured by `generate`'s own stats;
- load_gpt2_fixed (debug): a Hugging Face-layout checkpoint loader whose shape test leaves the
  square attn.c_proj untransposed, fixed: logits against the model the checkpoint came from;
- choose_width (design): the widest n_embd whose float32 weights fit 24 MiB, measured on models
  built on the meta device.

Each usual mistake is recognised by computing what it would give and named in the hint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine import GPT, GPTConfig, generate
from ...engine.model import causal_attention
from ..checkpoint import load_course_model
from ..tokenizer import load_tokenizer
from . import (
    CheckFailed,
    as_int,
    call,
    call_hinted,
    expect,
    fail,
    forbid,
    guarded,
    passed,
    prediction,
    tiny_model,
)

# --- exercise 1: count the parameters -----------------------------------------------------------


def _count_params_mistakes(cfg: GPTConfig) -> dict[int, str]:
    """What the usual wrong counts come to for `cfg`, each with the mistake that gives it."""
    C, L, V, P = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    with torch.device("meta"):
        right = GPT(cfg).num_params()
    mistakes = {
        right + V * C: "this is what you get when you count the LM head as well: it is tied to "
                       "wte (the same tensor), so it adds nothing",
        right - 2 * C: "this is what you get when you forget the final LayerNorm ln_f (2·C)",
        right - L * 9 * C: "this is what you get when you forget the biases of the four linears "
                           "in each block (3C + C + 4C + C = 9·C per block)",
        right - L * 4 * C: "this is what you get when you forget the two LayerNorms of each block "
                           "(a weight and a bias of C each: 4·C per block)",
        right - L * 13 * C: "this is what you get when you forget every block's biases and "
                            "LayerNorms (13·C per block)",
        right - L * 13 * C - 2 * C: "this is what you get when you count only the weight "
                                    "matrices: every bias and LayerNorm is missing",
        right - P * C: "this is what you get when you forget the position embeddings wpe "
                       "(block_size × C)",
        right - L * (C * C + C): "this is what you get when you forget the attention's output "
                                 "projection c_proj (C × C + C per block)",
        right - L * (6 * C * C + 3 * C): "this is what you get when the MLP's hidden width is C "
                                         "instead of 4·C",
    }
    mistakes.pop(right, None)  # a toy config can make a mistake cost nothing
    return mistakes


@guarded
def check_count_params(count_params) -> None:
    """count_params(cfg) == sum(p.numel()) of minikv.GPT(cfg), as an int, for several presets and a
    toy config."""
    name = "count_params"
    configs = [GPTConfig.preset(p) for p in ("gpt2", "target", "draft", "tiny", "small")]
    configs.append(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2))
    configs.append(GPTConfig(vocab_size=97, block_size=33, n_layer=5, n_head=3, n_embd=24))
    for cfg in configs:
        with torch.device("meta"):
            expected = GPT(cfg).num_params()
        case = (f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd})")
        got = call(name, case, count_params, cfg)
        value = as_int(got)
        if value is None:
            fail(name, case, expected, got,
                 f"return an int, not a {type(got).__name__}: a parameter count is a whole number"
                 + (" (count with integers: // not /, no float(), no math.pow)"
                    if isinstance(got, float) or "float" in type(got).__name__ else ""))
        hint = _count_params_mistakes(cfg).get(value, "count every parameter section 2 lists, "
                                               "each shape as it follows from the config: per "
                                               "block two LayerNorms and four linears (weights "
                                               "and biases), then wte, wpe and ln_f; the tied "
                                               "head adds nothing")
        expect(value == expected, name, case, expected, value, hint)
    passed(name, len(configs))


# --- exercise 2: documents as one token stream --------------------------------------------------

def _stream_mistakes(tok, docs: list[str]) -> list[tuple[list[int], str]]:
    eot = tok.eot_token
    ids = [tok.encode(d) for d in docs]
    return [
        ([t for d in ids for t in d],
         "this is what you get when you forget <|endoftext|>: append tok.eot_token after every "
         "document"),
        (tok.encode("<|endoftext|>".join(docs), allowed_special="all"),
         "this is what you get when <|endoftext|> goes only BETWEEN documents: the last one needs "
         "one too (every document is followed by it)"),
        ([t for d in ids for t in d] + [eot],
         "this is what you get when you put one <|endoftext|> at the very end: every document "
         "is followed by its own"),
        (tok.encode(" ".join(docs)) + [eot],
         "this is what you get when you join the documents into one text: encode each one on "
         "its own and follow each by tok.eot_token"),
        ([t for d in ids for t in [eot] + d],
         "this is what you get when <|endoftext|> goes BEFORE each document: it ends a document, "
         "it goes after"),
        ([t for d, i in zip(docs, ids) if d for t in i + [eot]],
         "this is what you get when you skip the empty document: an empty text is still a "
         "document, followed by <|endoftext|>"),
        ([t for d in docs for t in tok.encode(d + "<|endoftext|>", disallowed_special=())],
         "this is what you get when you encode the text '<|endoftext|>' as ordinary characters "
         "(disallowed_special=()): it becomes several byte tokens; the special token is the one "
         "id tok.eot_token"),
        ([t for d in ids for t in d + [50256]],
         "50256 is GPT-2's <|endoftext|>, not the course tokenizer's: use tok.eot_token (1023)"),
    ]


@guarded
def check_encode_documents(encode_documents) -> None:
    """encode_documents(tok, docs) == each document's ids followed by <|endoftext|>, as the course
    models were trained, as one flat list of ints."""
    name = "encode_documents"
    tok = load_tokenizer()
    # the first case tells the usual mistakes apart (with one document, several look alike)
    cases = [["héllo wörld ☕", "", "A coin's state is heads."],
             ["Once upon a time", " there was a dog."], ["The color of dog can vary widely."],
             [], ["a", "b", "a b"], [""]]
    for docs in cases:
        case = f"docs={docs!r}"
        expected = [t for doc in docs for t in tok.encode(doc) + [tok.eot_token]]
        got = call(name, case, encode_documents, tok, list(docs))
        if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
            fail(name, case, expected, got, f"return a Python list of ints, not a "
                 f"{type(got).__module__}.{type(got).__name__} (use .tolist())")
        if not isinstance(got, (list, tuple)):
            fail(name, case, expected, got, f"return a list of ints, not a {type(got).__name__}")
        if any(isinstance(t, (list, tuple)) for t in got):
            fail(name, case, expected, got, "this is what you get when you return one list per "
                 "document: return ONE flat list (the stream), e.g. ids += ... for each document")
        ints = [as_int(t) for t in got]
        bad = next((t for t, i in zip(got, ints) if i is None), None)
        if bad is not None or any(i is None for i in ints):
            fail(name, case, expected, got, f"every token id must be an int, got {bad!r} "
                 f"({type(bad).__name__})")
        hint = next((h for wrong, h in _stream_mistakes(tok, docs) if ints == wrong), "")
        expect(ints == expected, name, case, expected, ints,
               hint or "encode each document on its own and put tok.eot_token after every one "
               "(an empty one included)")
    passed(name, len(cases))


# --- exercise 3: the forward pass by hand -------------------------------------------------------

def _logits_like(model: GPT, idx: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    """GPT.forward without a cache, spelled out; `mistake` names a usual way to get it wrong."""
    tr = model.transformer
    T = idx.shape[1]
    positions = torch.arange(T, device=idx.device) + (1 if mistake == "positions from 1" else 0)
    x = tr.wte(idx) if mistake == "no wpe" else tr.wte(idx) + tr.wpe(positions)
    attention = causal_attention
    if mistake == "no mask":
        attention = F.scaled_dot_product_attention
    for i, block in enumerate(tr.h):
        x = block(x, None, i, attention)
    if mistake != "no ln_f":
        x = tr.ln_f(x)
    return model.lm_head(x)


FORWARD_MISTAKES = {
    "no wpe": "this is what you get without the position embeddings: add "
              "model.transformer.wpe(torch.arange(T)) to the token embeddings",
    "positions from 1": "this is what you get when positions start at 1: the first token is at "
                        "position 0 (torch.arange(T))",
    "no ln_f": "this is what you get when you forget the final LayerNorm: "
               "model.transformer.ln_f comes after the last block, before the LM head",
    "no mask": "this is what you get without the causal mask: a position may attend only to "
               "itself and the positions before it (call each block with causal_attention)",
}


class _CallOrder:
    """Records which of the model's top-level modules run, in order, while the learner's function
    runs (forward pre-hooks), so a crash can be explained."""

    def __init__(self, model: GPT):
        tr = model.transformer
        self.modules = {"wte": tr.wte, "wpe": tr.wpe, "ln_f": tr.ln_f, "lm_head": model.lm_head}
        self.modules |= {f"h.{i}": b for i, b in enumerate(tr.h)}
        self.order: list[str] = []

    def __enter__(self) -> _CallOrder:
        self.handles = [m.register_forward_pre_hook(lambda *_, n=n: self.order.append(n))
                        for n, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a.double() - b.double()).abs()
                                        <= 1e-5 * (1 + b.double().abs())).all())


def _forward_cases():
    target, tok = load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(0)
    yield tiny_model(0), torch.randint(0, 512, (1, 6), generator=g), "tiny random model"
    yield (tiny_model(1, n_layer=3), torch.randint(0, 512, (2, 9), generator=g),
           "tiny random model, 3 layers, batch of 2")
    yield (tiny_model(2, n_layer=1, n_head=2), torch.randint(0, 512, (3, 1), generator=g),
           "tiny random model, 1 layer, batch of 3, one token each")
    yield (tiny_model(3, n_layer=4), torch.randint(0, 512, (1, 40), generator=g),
           "tiny random model, 4 layers, 40 tokens")
    yield (target, torch.tensor([tok.encode("The color of dog can vary widely.")]),
           "the course target")


@guarded
def check_forward_by_hand(forward_by_hand) -> None:
    """forward_by_hand(model, idx) == model(idx) (within 1e-5), logits (B, T, vocab), on random tiny
    models of 1 to 4 layers, batches of 1 to 3, and the course target; GPT.forward is not called."""
    name = "forward_by_hand"
    n_cases = 0
    for model, idx, label in _forward_cases():
        B, T = idx.shape
        case = f"{label}, idx of shape {(B, T)}"
        with torch.inference_mode():  # computed before the learner's function runs
            expected = model(idx)
        with forbid(name, GPT.forward), _CallOrder(model) as calls:
            try:
                got, error = forward_by_hand(model, idx.clone()), None
            except NotImplementedError:
                raise
            except CheckFailed:
                raise
            except Exception as e:  # noqa: BLE001 - any crash is a wrong answer for this case
                got, error = None, e
        if error is not None:
            order = calls.order
            hint = "your function raised on this input"
            if "lm_head" in order and "ln_f" in order and order.index("lm_head") < \
                    order.index("ln_f"):
                hint = ("this is what you get when you apply the LM head before the final "
                        "LayerNorm: ln_f normalises the C-wide hidden states, then lm_head maps "
                        "them to the vocabulary")
            fail(name, case, "logits of shape " + str((B, T, model.config.vocab_size)),
                 f"{type(error).__name__}: {error}", hint)
        V = model.config.vocab_size
        shape = (B, T, V)
        if type(got).__module__ == "numpy":
            fail(name, case, f"a torch.Tensor of shape {shape}", f"numpy array of shape "
                 f"{getattr(got, 'shape', '?')}",
                 "return the logits as a torch.Tensor, not a numpy array (no .numpy())")
        if not isinstance(got, torch.Tensor):
            fail(name, case, f"a torch.Tensor of shape {shape}", type(got).__name__,
                 "return the logits tensor itself, of shape (B, T, vocab)")
        if not got.is_floating_point():
            fail(name, case, f"float logits of shape {shape}", f"{got.dtype} tensor",
                 "return the logits, not the argmax ids")
        got = got.detach().cpu()
        if tuple(got.shape) != shape:
            last = expected[:, -1]
            hint = f"return logits for every position: shape (B, T, vocab) = {shape}"
            if T > 1 and (_close(got, last) or _close(got, expected[:, -1:])):
                hint = ("this is what you get when you return only the last position: "
                        "return all T positions (B, T, vocab)")
            elif B == 1 and _close(got, expected[0]):
                hint = "you dropped the batch dimension: keep shape (B, T, vocab)"
            fail(name, case, f"shape {shape}", f"shape {tuple(got.shape)}", hint)
        if not _close(got, expected):
            blocks = {n for n in calls.order if n.startswith("h.")}
            n_layer = len(model.transformer.h)
            if 0 < len(blocks) < n_layer:
                fail(name, case, f"all {n_layer} blocks", f"{len(blocks)} blocks ran",
                     f"this is what you get when you run only {len(blocks)} of the model's "
                     f"{n_layer} blocks: loop over model.transformer.h, whatever its length")
            hint = next((h for m, h in FORWARD_MISTAKES.items()
                         if _close(got, _logits_like(model, idx, m).detach())),
                        "wte(idx) + wpe(positions 0..T-1), every block in order with "
                        "causal_attention, then ln_f, then lm_head")
            error = float((got.double() - expected.double()).abs().max())
            fail(name, case, "model(idx), within 1e-5", f"logits off by up to {error:.3g}", hint)
        n_cases += 1
    passed(name, n_cases)


# --- exercise 4: predict, then measure: what one generation costs -------------------------------

PREDICT_QUESTION = "A coin's state is tails. Alice doesn't flip, then Bob flips, then Carol flips."


def _generation_mistakes(P: int, words: int, chars: int, n_new: int, limit: int) -> list:
    """((passes, kv) or (None, kv) or (passes, None), hint) for the usual wrong predictions of a
    cached generation of n_new tokens (stopped by EOS before `limit`) after a P-token prompt."""
    fed = P + n_new - 1
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
        ((None, n_new - 1), "you forgot the prompt: the prefill computes the K/V of every "
         "prompt token, in one pass"),
        ((None, n_new), "you forgot the prompt: the prefill computes the K/V of every prompt "
         "token, in one pass"),
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
    ], fed


@guarded
def check_predict_generation(predict_generation) -> None:
    """predict_generation() -> (forward passes, K/V vectors per layer) of
    generate(target, ids, 40, eos_id=tok.eot_token) on PREDICT_QUESTION's question, measured."""
    name = "predict_generation"
    predicted = prediction(name, f"{name}()", predict_generation, GPT.forward, generate,
                           why="a prediction is committed BEFORE the measurement; reason from "
                               "the chapter and return the numbers (counting the prompt's tokens "
                               "with the tokenizer is fine)")
    pair = (list(predicted) if isinstance(predicted, (tuple, list))
            and not isinstance(predicted, str) else None)
    values = None if pair is None or len(pair) != 2 else [as_int(v) for v in pair]
    if values is None or None in values:
        fail(name, "predict_generation()", "a pair of ints (forward_passes, kv_computed)",
             predicted, "return the two numbers you predict, as ints, e.g. return 7, 9")
    passes, kv = values
    target, tok = load_course_model("target", "cpu")
    prompt = PREDICT_QUESTION + " What's the state? A:"
    ids = tok.encode(prompt)
    limit = 40
    out = generate(target, ids, limit, eos_id=tok.eot_token)  # the measurement
    want = (out.stats.forward_passes, out.stats.kv_computed)
    case = (f"generate(target, tok.encode({prompt!r}), {limit}, eos_id=tok.eot_token): it wrote "
            f"{[tok.decode([t]) for t in out.tokens]}")
    if (passes, kv) == want:
        print(f"✓ {name}: as measured, {passes} forward passes and {kv} K/V vectors per layer")
        return
    mistakes, _ = _generation_mistakes(len(ids), len(prompt.split()), len(prompt),
                                       len(out.tokens), limit)
    hint = next((h for (p, k), h in mistakes if (p is None or p == passes)
                 and (k is None or k == kv) and (p, k) != (None, None)
                 and ((p is not None and p != want[0]) or (k is not None and k != want[1]))), "")
    fail(name, case, f"{want[0]} forward passes, {want[1]} K/V vectors per layer (measured)",
         f"you predicted {passes} passes, {kv} K/V vectors",
         hint or f"the prompt is {len(ids)} tokens, fed once; the model wrote "
                 f"{len(out.tokens)} tokens, the last of them never fed")


# --- exercise 5: debug a GPT-2 checkpoint loader ------------------------------------------------

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _hf_layout(model: GPT, head: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights as a Hugging Face GPT-2 checkpoint holds them: names under
    'transformer.', the four Conv1D weights stored (in, out), each block's causal-mask buffer
    'attn.bias', and (optionally) the tied 'lm_head.weight'."""
    sd = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        sd[name] = t.t().clone() if name.endswith(CONV1D) else t.clone()
    n, T = model.config.n_layer, model.config.block_size
    for i in range(n):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    if head:
        sd["lm_head.weight"] = model.transformer.wte.weight.detach().clone()
    return sd


def _buggy_load(state_dict, config) -> GPT:
    """The notebook's loader as shipped: transposes a weight only when its shape says so."""
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if tensor.shape != ours[name].shape:
                tensor = tensor.t()
            ours[name].copy_(tensor)
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
    """load_gpt2_fixed(state_dict, config) -> a minikv.GPT whose logits are those of the model
    the Hugging Face-layout state dict was made from (within 1e-5), with the LM head still tied,
    without calling GPT.from_gpt2_state_dict."""
    name = "load_gpt2_fixed"
    target, tok = load_course_model("target", "cpu")
    g = torch.Generator().manual_seed(5)
    cases = [(tiny_model(11), "a tiny random model (2 layers, n_embd 64)", True),
             (tiny_model(12, n_layer=3, n_head=2, n_embd=48), "a 3-layer random model, no "
              "'lm_head.weight' in the checkpoint", False),
             (target, "the course target", True)]
    for model, label, head in cases:
        case = f"{label}: load_gpt2_fixed(its Hugging Face-layout state dict, its config)"
        sd = _hf_layout(model, head)
        idx = (torch.tensor([tok.encode("The color of dog can vary widely.")]) if model is target
               else torch.randint(0, model.config.vocab_size, (2, 11), generator=g))
        with torch.inference_mode():
            want = model(idx)
        with forbid(name, GPT.from_gpt2_state_dict):
            got = call_hinted(name, case, _loader_error_hint, load_gpt2_fixed,
                              {k: v.clone() for k, v in sd.items()}, model.config)
        if not isinstance(got, GPT):
            fail(name, case, "a minikv.GPT", type(got).__name__,
                 "return the model you loaded the weights into"
                 + (" (did you forget to return it?)" if got is None else ""))
        got.eval()
        if got.lm_head.weight is not got.transformer.wte.weight:
            fail(name, case, "lm_head.weight IS transformer.wte.weight (tied)",
                 "two different tensors", "GPT-2 ties the LM head to the token embedding: load "
                 "the weights into the tensors GPT(config) made (copy_ into them), do not replace "
                 "a parameter with a new one")
        with torch.inference_mode():
            logits = got(idx)
        if _close(logits, want):
            continue
        with torch.inference_mode():
            buggy = _buggy_load(_hf_layout(model, head), model.config)(idx)
        wrong = [n for n, t in got.state_dict().items()
                 if n in model.state_dict() and not torch.equal(t, model.state_dict()[n])]
        hint = (f"weights that differ from the checkpoint's model: {wrong[:4]}"
                + (" ..." if len(wrong) > 4 else "") + ". ")
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
    with torch.device("meta"):
        return GPT(GPTConfig(n_embd=n_embd, **WIDTH_SHAPE)).num_params() * 4


def _widest(budget: int) -> int:
    """The largest multiple of 8 whose model's float32 weights fit `budget` bytes (the bytes grow
    with the width, so a binary search over the engine's own models finds it)."""
    lo, hi = 1, 128  # in units of 8: n_embd = 8 fits any budget here, 1024 none
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _weight_bytes(8 * mid) <= budget else (lo, mid)
    return 8 * lo


@guarded
def check_choose_width(choose_width) -> None:
    """choose_width() -> the largest n_embd (a multiple of n_head = 8) whose model's float32
    weights fit in 24 MiB, measured on the engine's models."""
    name = "choose_width"
    got = call(name, "choose_width()", choose_width)
    width = as_int(got)
    case = (f"GPTConfig(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=your "
            f"choice), float32 weights within 24 MiB = {WIDTH_BUDGET:,} bytes")
    if width is None or width <= 0:
        fail(name, case, "a positive int n_embd", got, "return the width you choose, an int")
    best = _widest(WIDTH_BUDGET)
    if width % WIDTH_SHAPE["n_head"]:
        fail(name, case, "an n_embd that 8 heads split evenly", width,
             f"GPTConfig refuses n_embd={width} with n_head=8 (each head gets n_embd / n_head "
             f"dimensions): choose a multiple of 8")
    used = _weight_bytes(width)
    if used > WIDTH_BUDGET:
        with torch.device("meta"):
            model = GPT(GPTConfig(n_embd=width, **WIDTH_SHAPE))
        C = width
        embeddings = (model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel())
        hint = ("over budget: count every parameter (section 2 lists them), the tied head once, "
                "4 bytes each (float32)")
        if (used - 4 * embeddings) <= WIDTH_BUDGET:
            hint = (f"over budget: you left out the embeddings; wte and wpe hold "
                    f"{embeddings:,} parameters at n_embd={C} ({4 * embeddings / 2**20:.1f} MiB)")
        elif used // 2 <= WIDTH_BUDGET:
            hint = ("over budget: you counted 2 bytes per parameter; the budget is for float32 "
                    "weights, 4 bytes each")
        fail(name, case, f"at most {WIDTH_BUDGET:,} bytes",
             f"n_embd={width}: {used:,} bytes ({used / 2**20:.2f} MiB)", hint)
    if width != best:
        hint = (f"n_embd={width} fits ({used / 2**20:.2f} MiB), but a wider model fits too, and "
                f"the goal is the widest")
        if width == _widest(24 * 10**6):
            hint += (": 24 MiB is 24 x 2**20 bytes, not 24 x 10**6 (the widest for 24 MB "
                     "is the one you chose)")
        fail(name, case, "the widest n_embd whose weights fit",
             f"n_embd={width}: {used:,} bytes ({used / 2**20:.2f} MiB)", hint)
    print(f"✓ {name}: n_embd={width} is the widest that fits ({used / 2**20:.2f} MiB of 24)")
