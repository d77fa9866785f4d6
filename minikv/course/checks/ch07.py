"""Checkers for chapter 07 (shrinking the cache), each against the engine, in a few CPU seconds:
gqa_attention (causal_attention on random tensors, then inside target-gqa2 and target-mqa);
quantize_block / dequantize_block (the engine's quantize, per token; per channel on the transposed
block); held_positions (a table: what a real SinkWindowCache holds after each pass); predict_bytes
(predict, then measure two caches' nbytes); window_cache (debug: the fixed class against
SinkWindowCache at every step); choose_window (design: sinks and window for a byte budget, against
the held-out loss).
"""
from __future__ import annotations

import contextlib
import math
import sys
from functools import lru_cache, partial

import torch
import torch.nn.functional as F

from ...engine import GPT, Cache, KVCache, causal_attention
from ...engine.attention import window_attention
from ...engine.model import sdpa
from ...engine.quantized import QuantizedKVCache, dequantize, quantize
from ...engine.window import SinkWindowCache, feed
from ..checkpoint import load_course_model
from ..evaluate import heldout_losses
from . import (
    CheckFailed,
    Exercise,
    Refused,
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

TEXT = ("A coin's state is heads. Alice flips, then Bob flips, then Carol does not flip. "
        "What's the state? A:")


def _no_return(got) -> str:
    return " (did you forget to return it?)" if got is None else ""


# --- exercise 1: grouped-query attention -------------------------------------------------------

@contextlib.contextmanager
def _no_kernel(exercise: str):
    """forbid, also for PyTorch's scaled_dot_product_attention (enable_gqa does the exercise): a
    builtin has no code object, so it is watched by its "c_call" profile event."""
    called = []
    with forbid(exercise, causal_attention, sdpa):
        engine_watch = sys.getprofile()  # forbid's: it sees the engine's Python functions
        sys.setprofile(lambda frame, event, arg: engine_watch(frame, event, arg) or (
            event == "c_call" and arg is F.scaled_dot_product_attention and called.append(arg)))
        try:
            yield
        finally:
            sys.setprofile(engine_watch)
    if called:
        raise CheckFailed(f"{exercise}: your function called torch.nn.functional.scaled_dot_product"
                          f"_attention(); the exercise is to write attention yourself: expand K "
                          f"and V to the query heads, then softmax(q kᵀ / sqrt(head_dim)) v under "
                          f"a causal mask")


# (B, n_head, n_kv_head, T, head_dim): the first tells every usual mistake apart (two K/V heads
# of four query heads: repeat and repeat_interleave differ; several queries: the mask shows)
GQA_SHAPES = [(1, 4, 2, 5, 8), (2, 8, 2, 7, 16), (1, 8, 1, 6, 32), (1, 4, 4, 5, 8),
              (1, 6, 3, 4, 4), (2, 8, 4, 9, 8), (1, 2, 1, 1, 4), (1, 12, 4, 11, 16)]
GQA_MODELS = ("target-gqa2", "target-mqa")


def _attend(q, k, v, tile=False, mask="tril", diagonal=0, scale=None, dim=-1, after=False):
    """softmax(q kᵀ x scale) v over K/V heads expanded to the query heads, and its classic bugs."""
    group, T = q.size(1) // k.size(1), q.size(-2)
    k, v = (t.repeat(1, group, 1, 1) if tile else t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    allowed = getattr(torch.ones(T, T, dtype=torch.bool), mask)(diagonal) if mask else None
    if allowed is not None and not after:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=dim)
    return (weights * allowed if allowed is not None and after else weights) @ v


GQA_MISTAKES = {  # hint -> a wrong gqa_attention
    "this is what you get with k.repeat(1, group, 1, 1) (or a group axis in the wrong place), "
    "which gives query head i the K/V head i % n_kv_head: the K/V heads are tiled, 0 1 0 1 ... A "
    "K/V head serves a CONTIGUOUS group of n_head // n_kv_head query heads, as the grouped model "
    "was trained: query head i reads K/V head i // group; use k.repeat_interleave(group, dim=1) "
    "(0 0 1 1 ...)": partial(_attend, tile=True),
    "this is what you get with no causal mask: query i sees the keys after it, its future; fill "
    "the scores above the diagonal (key j > query i) with -inf before the softmax":
        partial(_attend, mask=None),
    "this is what you get when the scores are not divided by sqrt(head_dim): "
    "softmax(q kᵀ / sqrt(head_dim))": partial(_attend, scale=1.0),
    "this is what you get when you divide by head_dim: divide by sqrt(head_dim)":
        lambda q, k, v: _attend(q, k, v, scale=1 / q.size(-1)),
    "this is what you get with the softmax over the queries (dim=-2): each query's weights over "
    "the keys must sum to 1, so take it over the keys, dim=-1": partial(_attend, dim=-2),
    "this is what you get when the mask is applied after the softmax: mask the scores with -inf "
    "first, so each row's weights still sum to 1": partial(_attend, after=True),
    "this is what you get with the mask transposed (triu, the upper triangle): query i may see "
    "keys 0 .. i, the lower triangle, torch.ones(T, T).tril()": partial(_attend, mask="triu"),
    "this is what you get when each query also sees the next key: the mask's diagonal is off by "
    "one (tril(), not tril(1))": partial(_attend, diagonal=1),
}

GQA_SHAPE_MISTAKES = {  # hint -> a wrong gqa_attention, told by its shape
    "heads in dim 1: return (B, n_head, T, head_dim), as q is":
        lambda q, k, v: _attend(q, k, v).transpose(1, 2),
    "return the heads apart, (B, n_head, T, head_dim): the model puts them side by side itself":
        lambda q, k, v: _attend(q, k, v).transpose(1, 2).flatten(2),
    "one output per QUERY head: expand k and v to n_head heads (each K/V head repeated for its "
    "group), then attend with every query head": lambda q, k, v: v,
}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def _gqa_crash_hint(nh: int, nkv: int):
    return lambda error: (
        f"k and v have n_kv_head = {nkv} heads and q has n_head = {nh}: q @ kᵀ needs a K/V head "
        f"for every query head. Repeat each K/V head for its group of n_head // n_kv_head = "
        f"{nh // nkv} query heads (repeat_interleave on dim 1)"
        if isinstance(error, RuntimeError) and nkv not in (1, nh) else
        "your function raised on this input")


def _check_gqa_output(name: str, case: str, got, q, k, v, given) -> None:
    want, nh, nkv = causal_attention(q, k, v), q.size(1), k.size(1)  # SDPA with enable_gqa
    for label, before, after in zip("qkv", (q, k, v), given):
        if not torch.equal(before, after):
            fail(name, case, f"{label} left unchanged", f"{label} changed in place",
                 "compute on new tensors (q = q / ..., not q /= ...; repeat_interleave, not an "
                 "in-place write): inside the model k and v are the cache's own tensors")
    if not isinstance(got, torch.Tensor):
        fail(name, case, f"a torch tensor of shape {tuple(want.shape)} (B, n_head, T, head_dim)",
             kind(got), "return the attention output as one torch tensor (not numpy, not a "
             "tuple)" + _no_return(got))
    if got.shape != want.shape:
        fail(name, case, f"shape {tuple(want.shape)} (B, n_head, T, head_dim)",
             f"shape {tuple(got.shape)}", diagnose(GQA_SHAPE_MISTAKES, [((q, k, v), got)],
                                                   same=lambda a, b: a.shape == b.shape)
             or "one output row per query and query head: (B, n_head, T, head_dim), as q is")
    if got.dtype != q.dtype:
        fail(name, case, f"dtype {q.dtype}, q's", f"dtype {got.dtype}",
             "compute in q's dtype: the next layer multiplies the output with its weights")
    if got.isnan().any():
        fail(name, case, "no NaN", "NaN in the output",
             "a query whose keys are all masked (softmax of a row of -inf): query i must see keys "
             "0 .. i, its own key included; is the mask inverted (True must mean 'may attend') "
             "or its diagonal off by one?")
    if not _close(got, want):
        heads = [i for i in range(nh) if not _close(got[:, i], want[:, i])]
        fail(name, case, "the engine's attention output (to 1e-5)",
             f"an output off by up to {(got.double() - want.double()).abs().max():.4g}",
             diagnose(GQA_MISTAKES, [((q, k, v), got)], same=_close) or (
                 "softmax(q kᵀ / sqrt(head_dim)) v over the keys, query i seeing keys 0 .. i, "
                 f"query head i reading K/V head i // (n_head // n_kv_head) = i // {nh // nkv}; "
                 f"wrong query heads: {heads}"))


@guarded
@torch.no_grad()
def check_gqa_attention(gqa_attention) -> None:
    """gqa_attention(q, k, v) -> (B, n_head, T, head_dim), query head i reading K/V head i // g."""
    name = "gqa_attention"
    gen = torch.Generator().manual_seed(70)
    for B, nh, nkv, T, hs in GQA_SHAPES:
        heads = ("multi-query, one K/V head" if nkv == 1 else
                 "as many K/V heads as query heads (plain multi-head)" if nkv == nh else
                 f"groups of {nh // nkv} query heads")
        case = (f"q ({B}, {nh}, {T}, {hs}), k and v ({B}, {nkv}, {T}, {hs}): n_head = {nh}, "
                f"n_kv_head = {nkv}, {heads}")
        q = torch.randn(B, nh, T, hs, generator=gen) * 1.5
        k, v = (torch.randn(B, nkv, T, hs, generator=gen) * 1.5 for _ in range(2))
        given = [t.clone() for t in (q, k, v)]
        with _no_kernel(name):
            got = call_hinted(name, case, _gqa_crash_hint(nh, nkv), gqa_attention, *given)
        _check_gqa_output(name, case, got, q, k, v, given)
    for model_name in GQA_MODELS:
        model, tok = load_course_model(model_name, "cpu")
        cfg, ids = model.config, torch.tensor([tok.encode(TEXT)])
        case = (f"the course model {model_name} ({cfg.n_head} query heads, {cfg.kv_heads} K/V "
                f"head{'s' * (cfg.kv_heads > 1)}), model(idx, attention=gqa_attention) on a "
                f"{ids.size(1)}-token prompt")
        want = model(ids)
        with _no_kernel(name):
            got = call_hinted(name, case, _gqa_crash_hint(cfg.n_head, cfg.kv_heads), model, ids,
                               None, None, False, gqa_attention)
        if not _close(got, want, 1e-4):
            fail(name, case, "the model's own logits (to 1e-4)",
                 f"logits off by up to {(got - want).abs().max():.4g}",
                 "query head i reads K/V head i // (n_head // n_kv_head): the heads the model "
                 "was trained with")
    passed(name, len(GQA_SHAPES) + len(GQA_MODELS))


# --- exercise 2: a quantized block of keys ------------------------------------------------------

def _real_kv() -> tuple[torch.Tensor, ...]:
    """The target's layer-0/5 keys and layer-3 values, (1, 8, T, 24): T = 20 != head_dim."""
    target, tok = load_course_model("target", "cpu")
    ids = tok.encode(TEXT)[:20]
    cache = KVCache.for_model(target, max_len=len(ids))
    target(torch.tensor([ids]), cache=cache)
    return tuple(t[:, :, :len(ids)].clone()
                 for t in (cache.keys[0], cache.keys[5], cache.values[3]))


def quant_cases() -> list[tuple[str, torch.Tensor, int, str]]:
    """(what the case is about, x, bits, per); the first tells most mistakes apart. Per channel
    (KIVI's keys), a channel's scale spans the positions; T != head_dim shows an axis mix-up."""
    k0, k5, v3 = _real_kv()
    gen, gen72 = torch.Generator().manual_seed(71), torch.Generator().manual_seed(72)
    outlier = torch.randn(1, 2, 9, 6, generator=gen72)
    outlier[..., 3] *= 25.0                      # a channel large at every position
    outlier[..., 1] = 0.0                        # a channel that is all zeros
    head = torch.randn(6, 5, generator=gen) * 3
    head[2] = 0.0                               # a position whose vector is all zeros
    head[4] = torch.tensor([0.5, -4.0, 1.0, 3.5, -0.25])  # its largest magnitude is negative
    wide = (torch.randn(2, 3, 10, 7, generator=gen, dtype=torch.float64)
            * torch.logspace(-3, 2, 10, dtype=torch.float64)[:, None])
    real = f"the course target's {{}} for a {k0.size(2)}-token prompt, {tuple(k0.shape)}"
    edges = ("one head's keys, (T, hs) = (6, 5): position 2 all zeros, position 4's largest "
             "element negative")
    k0_label = real.format("layer-0 keys")
    return [(k0_label, k0, 8, "token"), (k0_label, k0, 4, "token"),
            (real.format("layer-5 keys"), k5, 4, "token"),
            (real.format("layer-3 values (values are quantized the same way)"), v3, 8, "token"),
            (edges, head, 8, "token"), (edges, head, 4, "token"),
            ("float64 keys (2, 3, 10, 7), positions from 1e-3 to 1e2 in size", wide, 4, "token"),
            (k0_label, k0, 8, "channel"), (k0_label, k0, 4, "channel"),
            ("keys (1, 2, 9, 6) with an outlier channel (3, 25x larger everywhere) and an "
             "all-zero channel (1)", outlier, 4, "channel")]


def engine_quantized(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """The engine's signed codes (int64, in [-qmax, qmax]), scales (..., T, 1) and dequantized x
    (it stores code + 2^(bits-1) as uint8, two codes a byte at 4 bits)."""
    packed, scales = quantize(x, bits)
    codes = dequantize(packed, torch.ones_like(scales), bits, x.size(-1))  # code x 1, exactly
    return codes.round().long(), scales, dequantize(packed, scales, bits, x.size(-1))


def _scale_hint(x: torch.Tensor, scales: torch.Tensor, bits: int) -> str:
    qmax = 2 ** (bits - 1) - 1
    amax = x.double().abs().amax(-1, keepdim=True)
    r = amax[amax > 0] / scales.double()[amax > 0]  # N, when every scale is max|x| / N
    one_n = r.numel() > 0 and torch.isfinite(r).all() and (r - r[0]).abs().max() <= 1e-4 * r[0]
    n = float(r[0]) if one_n else None
    levels = f"qmax = 2^(bits-1) - 1 = {qmax}"
    if n is not None and abs(n - round(n)) < 1e-4:
        n = round(n)
        if n == 2 ** (bits - 1):
            return (f"this is what you get with scale = max|x| / 2^(bits-1) = max|x| / {n}: off "
                    f"by one level. The largest element's code is then {n}, one more than the "
                    f"largest signed code {qmax} (the range is symmetric, -{qmax} .. {qmax}): "
                    f"unclamped it overflows (int8 wraps 128 to -128), clamped it is off by a "
                    f"whole scale. Divide by {levels}")
        if n == 2 ** bits:
            return (f"this is what you get with scale = max|x| / 2^bits = max|x| / {n}: that is "
                    f"the number of levels of an UNSIGNED code; signed codes run from -{qmax} to "
                    f"{qmax}, so the largest element's code would be {n}, far past {qmax}. "
                    f"Divide by {levels}")
        if n == 2 ** bits - 1:
            return (f"this is what you get with scale = max|x| / (2^bits - 1) = max|x| / {n}: "
                    f"the largest unsigned code; signed codes run from -{qmax} to {qmax}. "
                    f"Divide by {levels}")
        if 0 < n < qmax:
            unused = f"{qmax}" if n == qmax - 1 else f"{n + 1} .. {qmax}"
            wasted = "a level" if n == qmax - 1 else f"{qmax - n} levels"
            return (f"this is what you get with scale = max|x| / {n}: the largest code is then "
                    f"{n}, and ±{unused} are never used: it wastes {wasted}, a coarser grid for "
                    f"nothing. Divide by {levels}")
        if n > qmax:
            return (f"this is what you get with scale = max|x| / {n}: the largest element's code "
                    f"is then {n}, past the largest signed code {qmax}. Divide by {levels}")
    if n is not None:
        return f"your scales are max|x| / {n:.4g}: divide by {levels}"
    for hint, wrong in {  # the scales of a usual mistake
            "this is what you get with x.amax(...), the largest element, not the largest "
            "MAGNITUDE: a position whose largest element in size is negative gets too small (or "
            "a negative) scale; take x.abs().amax(dim=-1, keepdim=True)":
                x.double().amax(-1, keepdim=True) / qmax,
            f"your scales are {qmax} / max|x|, upside down: scale = max|x| / {qmax}, so that x / "
            f"scale reaches ±{qmax}": qmax / amax.clamp(min=1e-300),
            f"your scales are 2 max|x| / {qmax}, the range -max .. max spread over {qmax} levels; "
            f"the codes run from -{qmax} to {qmax}: scale = max|x| / {qmax}": amax / qmax * 2,
    }.items():
        if torch.allclose(scales.double(), wrong, rtol=1e-5, atol=0):
            return hint
    return (f"one scale per position: max|x| over that position's head_dim elements, divided by "
            f"{levels}")


def _scales_shape_hint(shape: tuple, xshape: tuple) -> str:
    *lead, T, hs = xshape
    return {
        (*lead, 1, hs): "one scale per CHANNEL: this is what you get with the max over the "
        "positions (dim=-2). Quantize per token, as the engine does: each position is quantized "
        "the moment it is written, when the positions to come are unknown, so its scale is the "
        "max over its own head_dim elements, x.abs().amax(dim=-1, keepdim=True)",
        (*lead, hs): "one scale per CHANNEL (the max over the positions, dim=-2): quantize per "
        "token, x.abs().amax(dim=-1, keepdim=True), (..., T, 1)",
        (*lead, T): "one scale per position, kept as a column: (..., T, 1), keepdim=True, so that "
        "x / scales divides each row by its own scale",
    }.get(shape) or ("one scale for the whole block (per tensor): quantize per token, one scale "
                     "per position and head, x.abs().amax(dim=-1, keepdim=True): one large "
                     "position would otherwise make every small one round to 0"
                     if math.prod(shape) == 1 else "one scale per position and head: "
                     "x.abs().amax(dim=-1, keepdim=True), (..., T, 1)")


CODE_MISTAKES = {  # hint -> the codes a wrong rounding of x / scale gives (clamped or not)
    "this is what you get by truncating x / scale (.to(int) or .int() drops the fraction): the "
    "error reaches a whole scale; round to the nearest level first, torch.round(x / scale)":
        lambda x, s: (x / s).double().trunc(),  # in x's dtype, as the learner divides
    "this is what you get with floor: the error reaches a whole scale; round to the nearest "
    "level, torch.round(x / scale)": lambda x, s: (x / s).double().floor(),
    "this is what you get with ceil: round to the nearest level, torch.round(x / scale)":
        lambda x, s: (x / s).double().ceil(),
    "codes are x / scale (divide), rounded: you multiplied":
        lambda x, s: (x.double() * s.double()).round(),
}
QUANT_FORBIDDEN = (quantize, dequantize, QuantizedKVCache.update)


def _check_quantized(name, case, x, bits, got) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's (codes, scales) for x, checked against the engine; returned when right."""
    qmax = 2 ** (bits - 1) - 1
    want_codes, want_scales, _ = engine_quantized(x, bits)
    shape, sshape = tuple(x.shape), tuple(want_scales.shape)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        fail(name, case, f"a pair (codes {shape}, scales {sshape})", kind(got),
             "return codes, scales" + _no_return(got))
    codes, scales = got
    if not isinstance(scales, torch.Tensor):
        fail(name, case, f"scales: a tensor of shape {sshape}", kind(scales),
             "return the scales as a torch tensor, one per position: (..., T, 1)")
    if tuple(scales.shape) != sshape:
        fail(name, case, f"scales of shape {sshape}, one per position (..., T, 1)",
             f"scales of shape {tuple(scales.shape)}",
             _scales_shape_hint(tuple(scales.shape), shape))
    if not scales.is_floating_point() or scales.dtype != x.dtype:
        fail(name, case, f"scales in x's dtype, {x.dtype}", f"scales in {scales.dtype}",
             "the scales are real numbers, in x's dtype: dequantizing multiplies by them")
    live = x.abs().amax(-1, keepdim=True) > 0
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bad.any():
        fail(name, case, "positive, finite scales", f"{scales[bad][:4].tolist()} ...",
             "a position whose vector is all zeros has max|x| = 0: a scale of 0 makes x / scale "
             "0 / 0 = NaN, and NaN cast to an integer is garbage. Keep the scale positive: clamp "
             "max|x| to a tiny positive number first, as the engine does, "
             ".clamp(min=torch.finfo(x.dtype).tiny)" if (bad & ~live).any() else
             "every scale must be a positive number: max|x| / qmax, max of the MAGNITUDES "
             "(x.abs())")
    if not torch.allclose(scales[live].double(), want_scales[live].double(), rtol=1e-5, atol=0):
        i = int((~torch.isclose(scales.double(), want_scales.double(), rtol=1e-5, atol=0)
                 & live).flatten().nonzero()[0])
        fail(name, case, f"the engine's scales, max|x| / {qmax} (e.g. "
             f"{want_scales.flatten()[i].item():.6g})",
             f"e.g. {scales.flatten()[i].item():.6g}", _scale_hint(x, scales, bits))
    if not isinstance(codes, torch.Tensor):
        fail(name, case, f"codes: an integer tensor of shape {shape}", kind(codes),
             "return the codes as a torch tensor of integers (torch.int8 holds 8-bit codes)")
    if tuple(codes.shape) != shape:
        fail(name, case, f"codes of shape {shape}, one per element of x",
             f"codes of shape {tuple(codes.shape)}",
             "one code per element of x, x's shape: no packing (the engine packs two 4-bit codes "
             "a byte; this exercise does not)")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        fail(name, case, "codes of an integer dtype (torch.int8, say)", f"dtype {codes.dtype}",
             "the codes are what the cache stores: small integers, 1 byte each at 8 bits; after "
             "torch.round, convert with .to(torch.int8)")
    c = codes.long()
    if (c.abs() > qmax).any():
        fail(name, case, f"codes in [-{qmax}, {qmax}]",
             f"codes from {int(c.min())} to {int(c.max())}",
             f"these are the engine's stored codes, code + 2^(bits-1), unsigned (1 .. "
             f"{2 * qmax + 1}): return the signed codes themselves, -{qmax} .. {qmax}"
             if torch.equal(c, want_codes + qmax + 1) else
             f"clamp the codes to [-{qmax}, {qmax}] (the signed range of a {bits}-bit code, "
             f"symmetric): x / scale may not reach past ±{qmax}")
    y = x.double() / want_scales.double()
    off = (c.double() - y).abs() > 0.5 + 1e-3  # a code may differ from the engine's at a tie
    if off.any():
        i = int(off.flatten().nonzero()[0])
        fail(name, case, f"code round(x / scale) = {int(want_codes.flatten()[i])} where x / scale "
             f"= {y.flatten()[i].item():.4f}", f"code {int(c.flatten()[i])}",
             diagnose(CODE_MISTAKES, [((x, want_scales), c.double())], same=lambda r, c: (
                 torch.equal(c, r) or torch.equal(c, r.clamp(-qmax, qmax))))
             or "code = torch.round(x / scale), clamped to [-qmax, qmax]")
    return codes, scales


_CHANNEL_WORDS = [("per position", "per channel"), ("(..., T, 1)", "(..., 1, hs)"),
                  ("that position's head_dim elements", "that channel's T positions"),
                  ("its own head_dim elements", "its own T positions"),
                  ("amax(dim=-1, keepdim=True)", "amax(dim=-2, keepdim=True)"),
                  ("a position whose vector is all zeros", "a channel that is all zeros"),
                  ("one scale per position and head", "one scale per channel and head"),
                  ("position", "channel")]


def _check_channel_quantized(name, case, x, bits, got) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel codes and scales of x, checked as the per-token ones of x transposed (the
    engine's quantize on the transposed block is the reference); hints in channel words."""
    *lead, T, hs = x.shape
    pair = isinstance(got, (tuple, list)) and len(got) == 2
    if pair and isinstance(got[0], torch.Tensor) and tuple(got[0].shape) != tuple(x.shape):
        fail(name, case, f"codes of shape {tuple(x.shape)}, one per element of x",
             f"codes of shape {tuple(got[0].shape)}", "one code per element of x, x's shape")
    if pair and isinstance(got[1], torch.Tensor):
        shape = tuple(got[1].shape)
        if shape == (*lead, T, 1):
            fail(name, case, f"scales of shape {(*lead, 1, hs)}, one per channel",
                 f"scales of shape {shape}",
                 "these are per-TOKEN scales (one per position): per channel, a channel's scale "
                 "is the largest magnitude of that channel over the block's positions, "
                 "x.abs().amax(dim=-2, keepdim=True), (..., 1, hs)")
        if shape != (*lead, 1, hs):
            fail(name, case, f"scales of shape {(*lead, 1, hs)}, one per channel (..., 1, hs)",
                 f"scales of shape {shape}", "one scale per channel and head, kept as a row: "
                 "x.abs().amax(dim=-2, keepdim=True)")
        got = tuple(t.transpose(-1, -2) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t
                    for t in got)
    try:
        codes, scales = _check_quantized(name, case, x.transpose(-1, -2), bits, got)
    except CheckFailed as e:
        message = str(e)
        for token_word, channel_word in _CHANNEL_WORDS:
            message = message.replace(token_word, channel_word)
        raise CheckFailed(message + " (per channel: the same rule, over the other axis)") from None
    return codes.transpose(-1, -2), scales.transpose(-1, -2)


@guarded
@torch.no_grad()
def check_quantize(quantize_block, dequantize_block) -> None:
    """quantize_block(x, bits, per) -> (codes, scales); dequantize_block(codes, scales) -> x̂."""
    name = "quantize_block"
    cases = quant_cases()
    for label, x, bits, per in cases:
        case = f"{label}, bits={bits}" + (", per='channel'" if per == "channel" else "")
        given = x.clone()
        with forbid(name, *QUANT_FORBIDDEN):
            got = call_hinted(name, case, _quant_crash_hint, quantize_block, given, bits,
                              **({} if per == "token" else {"per": "channel"}))
        if not torch.equal(given, x):
            fail(name, case, "x left unchanged", "x changed in place",
                 "compute on new tensors (x / scales, not x /= scales or x.div_): x is the "
                 "model's keys, which attention still reads")
        check = _check_quantized if per == "token" else _check_channel_quantized
        codes, scales = check(name, case, x, bits, got)
        mine = (codes.clone(), scales.clone())
        with forbid("dequantize_block", *QUANT_FORBIDDEN):
            out = call("dequantize_block", case, dequantize_block, *mine)
        _check_dequantized(case, x, codes, scales, mine, out)
    passed("quantize_block and dequantize_block", len(cases))


def _quant_crash_hint(error: Exception) -> str:
    return ("shapes that do not broadcast: the scales must be (..., T, 1), one per position, kept "
            "as a column (amax(dim=-1, keepdim=True)), so that x / scales divides each position "
            "by its own" if isinstance(error, RuntimeError) and "size of tensor" in str(error)
            else "your function raised on this input")


DEQUANT_MISTAKES = {  # hint -> a wrong dequantize_block
    "this is the codes themselves: multiply them back by their scales, x ≈ codes * scales":
        lambda codes, scales: codes.double(),
    "you divided by the scales: x ≈ codes * scales, multiply":
        lambda codes, scales: codes.double() / scales.double(),
}


def _check_dequantized(case, x, codes, scales, mine, out) -> None:
    name, shape = "dequantize_block", tuple(x.shape)
    if not (torch.equal(mine[0], codes) and torch.equal(mine[1], scales)):
        fail(name, case, "codes and scales left unchanged", "changed in place",
             "compute on new tensors: the cache keeps the codes and scales, and reads them "
             "again at every step")
    if not isinstance(out, torch.Tensor):
        fail(name, case, f"a tensor of shape {shape}", kind(out),
             "return x̂ as a torch tensor" + _no_return(out))
    if tuple(out.shape) != shape:
        fail(name, case, f"shape {shape}, x's", f"shape {tuple(out.shape)}",
             "one value per code: codes (..., T, hs) times scales (..., T, 1), broadcast")
    if not out.is_floating_point() or out.dtype != scales.dtype:
        fail(name, case, f"dtype {scales.dtype}, the scales'", f"dtype {out.dtype}",
             "dequantized values are real numbers, in the scales' dtype: codes.to(scales.dtype) "
             "* scales")
    o, want = out.double(), codes.double() * scales.double()
    if not torch.allclose(o, want, rtol=1e-5, atol=1e-30):
        i = int((~torch.isclose(o, want, rtol=1e-5, atol=1e-30)).flatten().nonzero()[0])
        fail(name, case, f"codes * scales (e.g. {want.flatten()[i].item():.6g})",
             f"e.g. {o.flatten()[i].item():.6g}", diagnose(
                 DEQUANT_MISTAKES, [((codes, scales), o)],
                 same=lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=0))
             or "x ≈ codes * scales: each position's codes times that position's scale")
    if ((o - x.double()).abs() > scales.double() / 2 * (1 + 1e-4) + 1e-30).any():
        fail(name, case, "every element within half a scale of x", "a larger error",
             "round x / scale to the nearest code: the reconstruction is then within scale / 2")


# --- exercise 3: which positions a sink-and-window cache holds ----------------------------------

N_TOKENS = 24  # each (sinks, window) is fed N_TOKENS tokens one per pass, t = 0 .. N_TOKENS - 1
WINDOW_PAIRS = [(2, 4), (0, 5), (4, 8), (1, 1), (0, 1), (3, 2), (5, 3), (4, 12)]


def _right(t: int, s: int, w: int) -> list[int]:
    seen = t + 1
    return list(range(seen)) if seen <= s + w else list(range(s)) + list(range(seen - w, seen))


def _recent(t: int, n: int) -> list[int]:
    return list(range(max(0, t - n + 1), t + 1))


@lru_cache(maxsize=None)
def engine_positions(sinks: int, window: int, n_tokens: int = N_TOKENS) -> list[list[int]]:
    """The positions a real SinkWindowCache holds after each pass, fed one token per pass."""
    model = tiny_model(7, n_layer=1)
    cache = SinkWindowCache.for_model(model, sinks=sinks, window=window)
    gen = torch.Generator().manual_seed(72 + 10 * sinks + window)
    tokens = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=gen).tolist()
    return [(feed(model, [token], cache), list(cache.positions))[1] for token in tokens]


def _held_list(got, t, sinks, window):
    if isinstance(got, (set, frozenset)):
        raise Refused("return a list, in the order the cache holds them (its slots): the sinks "
                      "first, then the window, oldest first")
    held = list(got) if isinstance(got, range) else int_list(got)
    if held is None:
        raise Refused("return a list of ints, the absolute positions held")
    return held


def _held_otherwise(answers) -> str:
    (t, sinks, window), held = next((c, g) for c, g in answers if g != _right(*c))
    if sorted(held) == _right(t, sinks, window):
        return ("the right positions in the wrong order: list them as the cache holds them, "
                "the sinks first, then the window, oldest first (ascending)")
    if len(set(held)) < len(held):
        return "a position is held once: no duplicates"
    if any(p > t or p < 0 for p in held):
        return f"only positions 0 .. {t} have been written"
    return ("after each pass the cache keeps the first `sinks` positions and the last `window` "
            "(the one just written among them), and evicts the rest; until more than sinks + "
            "window positions are written, it holds them all")


HELD = Exercise(
    "held_positions",
    cases=[(t, s, w) for s, w in WINDOW_PAIRS for t in range(N_TOKENS)],
    describe=lambda t, sinks, window: (f"t={t}, sinks={sinks}, window={window} (fed one token "
                                       f"per pass: positions 0 .. {t} written)"),
    reference=lambda t, sinks, window: engine_positions(sinks, window)[t],
    returns=_held_list, forbid=(SinkWindowCache.update, feed), solution=_right,
    mistakes={
        "this is what you get keeping window + 1 recent positions: the cache keeps the last "
        "`window` positions after each pass, the one just written (t) among them: t - window + 1 "
        ".. t": lambda t, s, w: sorted(set(range(min(s, t + 1))) | set(_recent(t, w + 1))),
        "this is what you get keeping window - 1 recent positions: the last `window` positions "
        "are t - window + 1 .. t, the one just written among them":
            lambda t, s, w: sorted(set(range(min(s, t + 1))) | set(_recent(t, w - 1))),
        "this is what you get when the sinks are counted twice: before anything is evicted (t < "
        "sinks + window) the first positions are both sinks and recent; a position is held once. "
        "Nothing is evicted until more than sinks + window positions are written":
            lambda t, s, w: list(range(min(s, t + 1))) + _recent(t, w),
        "this lists sinks that are not written yet: after the pass that wrote position t only "
        "positions 0 .. t exist; while t < sinks the cache holds just those":
            lambda t, s, w: sorted(set(range(s)) | set(_recent(t, w))),
        "this is what you get without the sinks: the cache keeps the FIRST `sinks` positions too "
        "(the attention sinks), evicting only the positions between them and the window":
            lambda t, s, w: _recent(t, w),
        "this is what you get keeping the last sinks + window positions: the first `sinks` "
        "positions stay for good (the sinks); only the middle is evicted":
            lambda t, s, w: _recent(t, s + w),
        "these are the cache's slots, 0 .. held - 1, not the positions: return the ABSOLUTE "
        "position each slot holds (what SinkWindowCache.positions lists)":
            lambda t, s, w: list(range(len(_right(t, s, w)))),
        "this is what you get when t counts the tokens seen: t is the position just written, so "
        "t + 1 tokens (positions 0 .. t) have been fed":
            lambda t, s, w: _right(t - 1, s, w) if t > 0 else [],
    },
    otherwise=_held_otherwise)
check_held_positions = HELD.check
EXERCISES = (HELD,)


# --- exercise 4 (predict, then measure): the bytes of two caches that combine savings ----------

BYTES_TEXT = ("Once upon a time there was a little cat named Tom. Tom liked to play in the garden "
              "with his red ball. One day the ball rolled under a big tree, and Tom could not "
              "find it.")
BYTES_TOKENS, BYTES_KEYS = 50, ("gqa2_int4", "mqa_window")


def measure_bytes() -> dict[str, int]:
    """nbytes after 50 tokens: target-gqa2 with a 4-bit QuantizedKVCache (one pass), target-mqa
    with a SinkWindowCache(4, 16) (one token per pass)."""
    (gqa2, tok), (mqa, _) = (load_course_model(m, "cpu") for m in ("target-gqa2", "target-mqa"))
    ids = tok.encode(BYTES_TEXT)[:BYTES_TOKENS]
    assert len(ids) == BYTES_TOKENS
    quantized = QuantizedKVCache.for_model(gqa2, max_len=BYTES_TOKENS, bits=4)
    window = SinkWindowCache.for_model(mqa, sinks=4, window=16)
    gqa2(torch.tensor([ids]), cache=quantized)
    feed(mqa, ids, window)
    return {"gqa2_int4": quantized.nbytes, "mqa_window": window.nbytes}


def _bytes_mistakes(key: str) -> list[tuple[int, str]]:
    layers, hs, n, heads, per = 12, 24, BYTES_TOKENS, 2, 12 * 2 * 1 * 24 * 4  # per: an mqa slot
    return [
        (layers * 2 * heads * (hs // 2) * n, "you forgot the scales: every position of every K/V "
         "head stores a 4-byte fp32 scale next to its 12 bytes of 4-bit codes, so int4 saves 6x "
         "over fp32, not 8x"),
        (layers * 2 * heads * (hs + 4) * n, "a 4-bit code is half a byte: two codes share a byte "
         "(24 values: 12 bytes), plus the 4-byte scale"),
        (layers * 2 * 8 * (hs // 2 + 4) * n,
         "target-gqa2 caches 2 K/V heads, not the 8 query heads: the grouped heads share"),
        (layers * heads * (hs // 2 + 4) * n, "K and V: both are cached, each with its scale"),
        (2 * heads * (hs // 2 + 4) * n, "every one of the 12 layers has its own K/V"),
        (layers * 2 * heads * hs * 4 * n,
         "this is the fp32 cache: the int4 one holds codes and scales"),
        (layers * 2 * heads * (hs // 2 + 4) * (n - 1),
         "the prompt's 50 tokens are all fed: the cache holds 50 positions"),
    ] if key == "gqa2_int4" else [
        (per * n, "the window cache evicts: it holds the 4 sinks and the last 16 positions, not "
                  "all 50"),
        (per * 21, "it evicts after every pass: sinks + window = 20 positions, the newest "
                   "included"),
        (per * 16, "the 4 sinks stay too: sinks + window positions"),
        (layers * 2 * 8 * hs * 4 * 20, "target-mqa caches ONE K/V head, not 8"),
        (layers * 8 * hs * 4 * 20 // 8, "K and V: both are cached"),
        (2 * hs * 4 * 20, "every one of the 12 layers has its own K/V"),
        (per * 20 // 2, "the window cache stores fp32 (4 bytes a value): it is not quantized"),
    ]


@guarded
@torch.no_grad()
def check_predict_bytes(predict_bytes) -> None:
    """predict_bytes() -> {"gqa2_int4": ..., "mqa_window": ...}, against measure_bytes()."""
    name = "predict_bytes"
    case = ("after the first 50 tokens of a story: target-gqa2 with a 4-bit "
            "QuantizedKVCache, target-mqa with SinkWindowCache(sinks=4, window=16)")
    got = prediction(name, case, predict_bytes, GPT.forward, feed)
    if not isinstance(got, dict) or sorted(got) != sorted(BYTES_KEYS):
        fail(name, case, f"a dict with the keys {list(BYTES_KEYS)}",
             sorted(got) if isinstance(got, dict) else got,
             "return your two predictions, in bytes, as ints" + _no_return(got))
    for key in BYTES_KEYS:
        if isinstance(got[key], bool) or not isinstance(got[key], int):
            fail(name, f"{case}: {key}", "an int", got[key], "bytes are whole: an int")
    measured = measure_bytes()
    for key in BYTES_KEYS:
        if got[key] != measured[key]:
            hints = dict.fromkeys(h for w, h in _bytes_mistakes(key)
                                  if w == got[key] and w != measured[key])
            reason = "; or ".join(hints) or (
                "per position: layers × (K and V) × K/V heads × what one head's vector costs "
                "(4 bytes a value in fp32; half a byte a value plus a 4-byte scale at 4 bits); "
                "then how many positions the cache holds")
            fail(name, f"{case}: {key}", measured[key], got[key],
                 f"you predicted {got[key]:,} bytes; the cache holds {measured[key]:,}: {reason}")
    full = 12 * 2 * 8 * 24 * 4 * BYTES_TOKENS
    print(f"  measured: {measured['gqa2_int4']:,} and {measured['mqa_window']:,} bytes, "
          f"{full / measured['gqa2_int4']:.1f}x and {full / measured['mqa_window']:.1f}x less "
          f"than the target's fp32 cache ({full:,})")
    passed(name, len(BYTES_KEYS))


# --- exercise 5 (debug): a sink-and-window cache --------------------------------------------------

class BuggyWindowCache(Cache):
    """The notebook's broken window cache, verbatim: the next token's position is the number of
    slots held, not the number of tokens seen."""

    def __init__(self, model, sinks, window):
        cfg = model.config
        empty = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim)
        self.keys, self.values = [empty] * cfg.n_layer, [empty] * cfg.n_layer
        self.n_layer, self.n_head, self.head_dim = cfg.n_layer, cfg.kv_heads, cfg.head_dim
        self.sinks, self.window = sinks, window
        self.positions = []   # the absolute position each held slot holds
        self.batch_size, self.device, self.dtype = 1, torch.device("cpu"), torch.float32

    def get_seq_length(self, layer_idx=0):
        """Where the next token's position starts."""
        return len(self.positions)

    def check_fits(self, cfg, batch_size, n_new, device, dtype):
        pass

    def update(self, key, value, layer_idx):
        """Append this pass's K/V; once the last layer is written, evict all but the first
        `sinks` and the last `window` slots."""
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=2)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx == self.n_layer - 1:
            start = self.get_seq_length()
            self.positions += range(start, start + key.shape[2])
            if len(self.positions) > self.sinks + self.window:
                keep = list(range(self.sinks)) + list(range(len(self.positions) - self.window,
                                                            len(self.positions)))
                index = torch.tensor(keep)
                self.keys = [t.index_select(2, index) for t in self.keys]
                self.values = [t.index_select(2, index) for t in self.values]
                self.positions = [self.positions[i] for i in keep]
        return k, v


WINDOW_SYMPTOM = ("symptom: the logits match the engine's until the first eviction (after sinks "
                  "+ window tokens), then drift. From then on the cache holds sinks + window "
                  "slots at every step, so a position taken from the slots held stops growing: "
                  "every new token is embedded at the same position. GPT-2's positions are "
                  "absolute: a new token's position is the number of tokens SEEN, which keeps "
                  "growing after evictions (the held slots keep their true positions)")
DEBUG_PAIRS = [(4, 8), (2, 5), (0, 6), (1, 1)]


@guarded
@torch.no_grad()
def check_window_cache(cache_class) -> None:
    """cache_class(model, sinks, window) fed one token per pass, against SinkWindowCache."""
    name = "window_cache"
    if not (isinstance(cache_class, type) and issubclass(cache_class, Cache)):
        fail(name, "the class", "a Cache subclass (of BuggyWindowCache)", cache_class,
             "pass the class itself, fixed")
    model = tiny_model(3)
    ids = [(7 * i * i + 3 * i + 1) % 500 for i in range(26)]
    same_as_buggy = True
    for sinks, window in DEBUG_PAIRS:
        engine = SinkWindowCache.for_model(model, sinks=sinks, window=window)
        buggy = BuggyWindowCache(model, sinks, window)
        case = f"sinks={sinks}, window={window}, a {len(ids)}-token text fed one token per pass"
        mine = call(name, case, cache_class, model, sinks, window)
        for t, token in enumerate(ids):
            x = torch.tensor([[token]])
            want, from_buggy = (model(x, cache=c)[0, -1] for c in (engine, buggy))
            with forbid(name, SinkWindowCache.update, SinkWindowCache.get_seq_length):
                got = call(name, f"{case}, at position {t}", model, x, cache=mine)[0, -1]
            same_as_buggy &= torch.allclose(got, from_buggy, atol=1e-5)
            where = f"{case}: the pass that feeds position {t}"
            if not torch.allclose(got, want, atol=1e-4):
                fail(name, where, "the engine's logits (max |Δ| < 1e-4)",
                     f"max |Δ| = {float((got - want).abs().max()):.3g}",
                     "this is BuggyWindowCache unchanged: " + WINDOW_SYMPTOM
                     if torch.allclose(got, from_buggy, atol=1e-5) else
                     "wrong before anything is evicted: keep appending every pass's K/V, in "
                     "every layer, as the buggy cache does" if t < sinks + window else
                     WINDOW_SYMPTOM)
            if list(mine.positions) != engine.positions:
                ahead = bool(mine.positions) and max(mine.positions) > max(engine.positions)
                fail(name, where, f"positions {engine.positions}", f"{list(mine.positions)}",
                     "your positions run ahead of the tokens: update runs once per LAYER in "
                     "every pass, so count a pass's tokens once (when the last layer is "
                     "written), not in every layer" if ahead else
                     "the held slots' absolute positions: the first `sinks` and the last "
                     "`window` of every position written so far")
    if same_as_buggy:
        fail(name, "every case", "a fixed cache", "BuggyWindowCache's logits",
             "this is the buggy cache unchanged: " + WINDOW_SYMPTOM)
    passed(name, len(DEBUG_PAIRS) * len(ids))


# --- exercise 6 (design): sinks and window under a memory budget ----------------------------------

DESIGN_BUDGET = 300_000          # bytes of K/V per sequence, fp32 target: 16 positions
OTHER_BUDGETS = (450_000, 100_000, 40_000, 30_000)  # the last two: room for 2 positions, 1
DESIGN_DOCS, SINK_CANDIDATES = 12, (0, 1, 2, 3, 4, 6, 8)
LOSS_MARGIN = 0.02               # within 2% of the best split counts as best


def window_loss(sinks: int, window: int) -> float:
    """The target's held-out coin-flip loss, each token seeing what SinkWindowCache holds."""
    target, tok = load_course_model("target", "cpu")
    return heldout_losses(target, tok, corpora=("coinflip",), n_docs=DESIGN_DOCS,
                          attention=window_attention(sinks, window))["coinflip"]


def window_bytes(sinks: int, window: int) -> int:
    """The nbytes of a SinkWindowCache(sinks, window) of the target, once it evicts."""
    target, tok = load_course_model("target", "cpu")
    cache = SinkWindowCache.for_model(target, sinks=sinks, window=window)
    feed(target, tok.encode(TEXT)[:sinks + window + 2], cache)
    return cache.nbytes


@guarded
@torch.no_grad()
def check_choose_window(choose_window) -> None:
    """choose_window(budget_bytes) -> (sinks, window): fits, and within 2% of the best loss."""
    name = "choose_window"
    per_position = window_bytes(0, 1)
    for budget in (DESIGN_BUDGET,) + OTHER_BUDGETS:
        case = f"a budget of {budget:,} bytes of K/V per sequence (the fp32 course target)"
        got = call(name, case, choose_window, budget)
        pair = int_list(got) if isinstance(got, (tuple, list)) else None
        if pair is None or len(pair) != 2 or pair[0] < 0 or pair[1] < 1:
            fail(name, case, "(sinks, window): two ints, sinks ≥ 0, window ≥ 1", got,
                 "return the pair (sinks, window)" + _no_return(got))
        (sinks, window), slots = pair, budget // per_position
        held = window_bytes(sinks, window)
        if held > budget:
            fail(name, case, f"at most {budget:,} bytes held", f"{held:,} bytes for "
                 f"{sinks} sinks + {window} window",
                 f"the cache holds sinks + window positions after every pass, "
                 f"{per_position:,} bytes each (12 layers × K and V × 8 heads × 24 values × 4 "
                 f"bytes): {slots} positions fit in {budget:,} bytes")
        if sinks + window < slots:
            fail(name, case, f"sinks + window = {slots}, the positions the budget pays for",
                 f"{sinks} + {window} = {sinks + window}",
                 "a position the budget pays for and the cache does not hold is memory wasted: a "
                 "longer window (or another sink) only helps")
        if budget != DESIGN_BUDGET:
            continue
        losses = {s: window_loss(s, slots - s) for s in SINK_CANDIDATES if s < slots}
        mine = losses[sinks] if sinks in losses else window_loss(sinks, window)
        best = min(losses.values())
        if mine > best * (1 + LOSS_MARGIN):
            best_s = min(losses, key=losses.get)
            hint = ("no sinks: a trained model parks attention on the first tokens, and without "
                    "them the softmax loses its anchor (StreamingLLM); keep a few" if sinks == 0
                    else "too many sinks: every sink is a position taken from the window, and the "
                    "recent tokens are what the next token needs most" if sinks > best_s else
                    "too few sinks: a few more first positions anchor attention better")
            table = ", ".join(f"{s} sinks: {v:.3f}" for s, v in losses.items())
            fail(name, case, f"a split within {100 * LOSS_MARGIN:.0f}% of the best held-out "
                 f"loss ({best:.3f}, {best_s} sinks + {slots - best_s} window)",
                 f"{sinks} sinks + {window} window: loss {mine:.3f}",
                 f"{hint} (losses by sinks, window = {slots} - sinks: {table})")
    passed(name, 1 + len(OTHER_BUDGETS))
