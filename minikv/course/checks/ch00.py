"""Checkers for chapter 00 (setup and a tiny GPT).

- count_params: against sum(p.numel()) of real models built on the meta device (GPT-2's 124M costs
  nothing), as an int;
- encode_documents: against the course tokenizer, as a flat list of ints;
- forward_by_hand: against the model's own forward pass, on random tiny models of several depths
  and on the course target, without calling GPT.forward.

Each usual mistake is recognised by computing what it would give and named in the hint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine import GPT, GPTConfig
from ...engine.model import causal_attention
from ..checkpoint import load_course_model
from ..tokenizer import load_tokenizer
from . import CheckFailed, as_int, call, expect, fail, forbid, guarded, passed, tiny_model

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
        hint = _count_params_mistakes(cfg).get(value, "per block: two LayerNorms (4·C), c_attn "
                                               "(C·3C + 3C), c_proj (C·C + C), c_fc (C·4C + 4C) "
                                               "and the MLP's c_proj (4C·C + C); plus wte, wpe "
                                               "and ln_f (2·C); the tied head adds nothing")
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
