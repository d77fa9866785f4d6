"""Checkers for chapter 00 (setup): the parameter count against real models (built on the meta
device, so GPT-2's 124M costs nothing), the greedy pick against argmax on random logits, and
documents packed into one token stream against the course tokenizer."""
from __future__ import annotations

import torch

from ...engine import GPT, GPTConfig
from ..tokenizer import load_tokenizer
from . import call, expect, passed


def check_count_params(count_params) -> None:
    """count_params(cfg) == sum(p.numel()) of minikv.GPT(cfg), for several presets and a toy
    config."""
    name = "count_params"
    configs = [GPTConfig.preset(p) for p in ("gpt2", "target", "draft", "tiny", "small")]
    configs.append(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2))
    for cfg in configs:
        with torch.device("meta"):
            expected = GPT(cfg).num_params()
        case = (f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, "
                f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd})")
        got = call(name, case, count_params, cfg)
        hint = ("per block: 12·C² + 13·C; plus wte and wpe, plus the final LayerNorm (2·C); "
                "the tied head adds nothing"
                if got != expected else "")
        expect(got == expected, name, case, expected, got, hint)
    passed(name, len(configs))


def check_next_tokens(next_tokens) -> None:
    """next_tokens(logits) == logits[:, -1].argmax(-1) on random logits whose earlier positions
    mislead."""
    name = "next_tokens"
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 5), (1, 4, 7), (3, 2, 11), (2, 6, 1024)]
    for shape in shapes:
        logits = torch.randn(shape, generator=g)
        logits[:, :-1, 0] = 100.0  # earlier positions favour token 0: reading them is wrong
        expected = logits[:, -1].argmax(-1)
        got = call(name, f"logits of shape {shape}", next_tokens, logits.clone())
        ok = (isinstance(got, torch.Tensor) and got.shape == expected.shape
              and torch.equal(got.long(), expected))
        expect(ok, name, f"logits of shape {shape}", expected.tolist(),
               got.tolist() if isinstance(got, torch.Tensor) else got,
               "argmax over the last dimension, at the last position (index -1 of dim 1), "
               "one id per sequence")
    passed(name, len(shapes))


def check_encode_documents(encode_documents) -> None:
    """encode_documents(tok, docs) == each document's ids followed by <|endoftext|>, as the course
    models were trained."""
    name = "encode_documents"
    tok = load_tokenizer()
    cases = [["The color of dog can vary widely."], ["Once upon a time", " there was a dog."],
             ["héllo wörld ☕", "", "A coin's state is heads."], []]
    for docs in cases:
        expected = [t for doc in docs for t in tok.encode(doc) + [tok.eot_token]]
        got = call(name, f"docs={docs!r}", encode_documents, tok, list(docs))
        got_list = [int(t) for t in got] if isinstance(got, (list, tuple)) else got
        expect(got_list == expected, name, f"docs={docs!r}", expected, got_list,
               "encode each document on its own and put tok.eot_token after every one "
               "(an empty one included)")
        text = tok.decode(got_list)
        expect(text == "".join(d + "<|endoftext|>" for d in docs), name,
               f"decoding your ids for docs={docs!r}",
               "".join(d + "<|endoftext|>" for d in docs), text)
    passed(name, len(cases))
