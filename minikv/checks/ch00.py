"""Checkers for chapter 00 (setup): the parameter count against real models (built on the meta device,
so GPT-2's 124M costs nothing), the greedy pick against argmax on random logits."""
from __future__ import annotations

import torch

from ..config import GPTConfig
from ..model import GPT
from . import expect, fail, passed


def _call(exercise: str, case: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any crash is reported as a wrong answer for this case
        fail(exercise, case, "a result", f"{type(e).__name__}: {e}", "your function raised on this input")


def check_count_params(count_params) -> None:
    name = "count_params"
    configs = [GPTConfig.preset(p) for p in ("gpt2", "target", "draft", "tiny", "small")]
    configs.append(GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=2))
    for cfg in configs:
        with torch.device("meta"):
            expected = GPT(cfg).num_params()
        case = f"GPTConfig(vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, n_layer={cfg.n_layer}, n_embd={cfg.n_embd})"
        got = _call(name, case, count_params, cfg)
        hint = ("per block: 12·C² + 13·C; plus wte and wpe, plus the final LayerNorm (2·C); the tied head adds nothing"
                if got != expected else "")
        expect(got == expected, name, case, expected, got, hint)
    passed(name, len(configs))


def check_next_tokens(next_tokens) -> None:
    name = "next_tokens"
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 5), (1, 4, 7), (3, 2, 11), (2, 6, 1024)]
    for shape in shapes:
        logits = torch.randn(shape, generator=g)
        logits[:, :-1, 0] = 100.0  # earlier positions favour token 0: reading them is wrong
        expected = logits[:, -1].argmax(-1)
        got = _call(name, f"logits of shape {shape}", next_tokens, logits.clone())
        ok = isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got.long(), expected)
        expect(ok, name, f"logits of shape {shape}", expected.tolist(),
               got.tolist() if isinstance(got, torch.Tensor) else got,
               "argmax over the last dimension, at the last position (index -1 of dim 1), one id per sequence")
    passed(name, len(shapes))
