"""Chapter 07's checkers (shrinking the cache), against the engine on the CPU, leaving the caller's
random state alone: gqa_attention, quantize_block/dequantize_block, predict_bytes, window_cache and
choose_window (code); held_positions (a table). The hints are in hints/ch07.toml."""
from __future__ import annotations

import contextlib
import math
from functools import lru_cache, partial

import torch

from ...engine import GPT, Cache, KVCache, causal_attention
from ...engine.attention import window_attention
from ...engine.model import sdpa
from ...engine.quantized import QuantizedKVCache, dequantize, quantize
from ...engine.window import SinkWindowCache, feed
from .. import checks as ck
from ..checkpoint import load_course_model
from ..evaluate import heldout_losses

H = ck.hints("ch07")
TEXT = ("A coin's state is heads. Alice flips, then Bob flips, then Carol does not flip. "
        "What's the state? A:")

# --- exercise 1: grouped-query attention -------------------------------------------------------
G = H["gqa_attention"]
# (B, n_head, n_kv_head, T, head_dim): the first tells every usual mistake apart (two K/V heads
# of four query heads: repeat and repeat_interleave differ; several queries: the mask shows)
GQA_SHAPES = [(1, 4, 2, 5, 8), (2, 8, 2, 7, 16), (1, 8, 1, 6, 32), (1, 4, 4, 5, 8),
              (1, 6, 3, 4, 4), (2, 8, 4, 9, 8), (1, 2, 1, 1, 4), (1, 12, 4, 11, 16)]
GQA_MODELS = ("target-gqa2", "target-mqa")


@contextlib.contextmanager
def _no_kernel(exercise: str):
    """forbid, also for PyTorch's scaled_dot_product_attention (enable_gqa does the exercise)."""
    try:
        with ck.forbid(exercise, causal_attention, sdpa, "scaled_dot_product_attention"):
            yield
    except ck.EngineCalled as e:
        if e.called != "torch.scaled_dot_product_attention":
            raise
        raise ck.CheckFailed(f"{exercise}: {G['kernel']}") from None


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


GQA_MISTAKES = {  # hint -> a wrong gqa_attention; the last three are told apart by their shape
    G["tiled"]: partial(_attend, tile=True), G["no_mask"]: partial(_attend, mask=None),
    G["no_scale"]: partial(_attend, scale=1.0),
    G["head_dim"]: lambda q, k, v: _attend(q, k, v, scale=1 / q.size(-1)),
    G["over_queries"]: partial(_attend, dim=-2), G["mask_after"]: partial(_attend, after=True),
    G["triu"]: partial(_attend, mask="triu"), G["diagonal"]: partial(_attend, diagonal=1),
    G["heads_in_dim_1"]: lambda q, k, v: _attend(q, k, v).transpose(1, 2),
    G["heads_apart"]: lambda q, k, v: _attend(q, k, v).transpose(1, 2).flatten(2),
    G["per_query_head"]: lambda q, k, v: v,
}


def _gqa_crash_hint(nh: int, nkv: int):  # a crash only unexpanded K/V heads explain
    return ck.raised_as(RuntimeError if nkv not in (1, nh) else (),
                        G["crash"].format(nkv=nkv, nh=nh, group=nh // nkv))


@ck.guarded
@torch.no_grad()
def check_gqa_attention(gqa_attention) -> None:
    """gqa_attention(q, k, v) -> (B, n_head, T, head_dim), query head i reading K/V head i // g."""
    name, gen = "gqa_attention", torch.Generator().manual_seed(70)
    for B, nh, nkv, T, hs in GQA_SHAPES:
        heads = ("multi-query, one K/V head" if nkv == 1 else
                 "as many K/V heads as query heads (plain multi-head)" if nkv == nh else
                 f"groups of {nh // nkv} query heads")
        case = (f"q ({B}, {nh}, {T}, {hs}), k and v ({B}, {nkv}, {T}, {hs}): n_head = {nh}, "
                f"n_kv_head = {nkv}, {heads}")
        q = torch.randn(B, nh, T, hs, generator=gen) * 1.5
        k, v = (torch.randn(B, nkv, T, hs, generator=gen) * 1.5 for _ in range(2))
        with _no_kernel(name):
            got = ck.call_kept(name, case, G["unchanged"], gqa_attention, q, k, v,
                               raised=_gqa_crash_hint(nh, nkv))
        want = causal_attention(q, k, v)  # SDPA with enable_gqa
        ck.expect_tensor(name, case, got, want, shape_words=" (B, n_head, T, head_dim)",
                         values="the engine's attention output (to 1e-5)", mistakes=GQA_MISTAKES,
                         inputs=(q, k, v), hints={**G, "close": lambda got: G["close"].format(
                             group=nh // nkv, heads=[i for i in range(nh) if not ck.close(
                                 got[:, i], want[:, i])])})
    for model_name in GQA_MODELS:
        model, tok = load_course_model(model_name, "cpu")
        cfg, ids = model.config, torch.tensor([tok.encode(TEXT)])
        case = (f"the course model {model_name} ({cfg.n_head} query heads, {cfg.kv_heads} K/V "
                f"head{'s' * (cfg.kv_heads > 1)}), model(idx, attention=gqa_attention) on a "
                f"{ids.size(1)}-token prompt")
        want = model(ids)
        with _no_kernel(name):
            got = ck.call_hinted(name, case, _gqa_crash_hint(cfg.n_head, cfg.kv_heads), model,
                                 ids, None, None, False, gqa_attention)
        if not ck.close(got, want, 1e-4):
            ck.fail(name, case, "the model's own logits (to 1e-4)",
                    f"logits off by up to {(got - want).abs().max():.4g}", G["model"])
    ck.passed(name, len(GQA_SHAPES) + len(GQA_MODELS))


# --- exercise 2: a quantized block of keys ------------------------------------------------------
Q = H["quantize_block"]
QUANT_FORBIDDEN = (quantize, dequantize, QuantizedKVCache.update)


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
    """The engine's signed codes (int64, in [-qmax, qmax]), scales (..., T, 1) and dequantized x."""
    packed, scales = quantize(x, bits)  # it stores code + 2^(bits-1), two codes a byte at 4 bits
    codes = dequantize(packed, torch.ones_like(scales), bits, x.size(-1))  # code x 1, exactly
    return codes.round().long(), scales, dequantize(packed, scales, bits, x.size(-1))


def _scale_hint(x: torch.Tensor, scales: torch.Tensor, bits: int) -> str:
    """Which wrong divisor N of scale = max|x| / N, or which other usual mistake, these are."""
    qmax, amax = 2 ** (bits - 1) - 1, x.double().abs().amax(-1, keepdim=True)
    r = amax[amax > 0] / scales.double()[amax > 0]  # N, when every scale is max|x| / N
    one_n = r.numel() > 0 and torch.isfinite(r).all() and (r - r[0]).abs().max() <= 1e-4 * r[0]
    n = float(r[0]) if one_n else None
    if n is not None and abs(n - round(n)) < 1e-4:
        n = round(n)
        key = {2 ** (bits - 1): "off_by_one", 2 ** bits: "unsigned_levels", 2 ** bits - 1:
               "unsigned_code"}.get(n, "wastes" if 0 < n < qmax else "past" if n > qmax else "")
        if key:
            return Q[key].format(n=n, qmax=qmax, unused=qmax if n == qmax - 1 else
                                 f"{n + 1} .. {qmax}", wasted="a level" if n == qmax - 1 else
                                 f"{qmax - n} levels")
    if n is not None:
        return Q["ratio"].format(n=n, qmax=qmax)
    for key, wrong in (("not_magnitude", x.double().amax(-1, keepdim=True) / qmax),
                       ("upside_down", qmax / amax.clamp(min=1e-300)),
                       ("doubled", amax / qmax * 2)):
        if torch.allclose(scales.double(), wrong, rtol=1e-5, atol=0):
            return Q[key].format(qmax=qmax)
    return Q["scales"].format(qmax=qmax)


CODE_MISTAKES = {  # hint -> the codes a wrong rounding of x / scale gives (clamped or not)
    Q["truncated"]: lambda x, s: (x / s).double().trunc(),  # in x's dtype, as the learner divides
    Q["floor"]: lambda x, s: (x / s).double().floor(),
    Q["ceil"]: lambda x, s: (x / s).double().ceil(),
    Q["multiplied"]: lambda x, s: (x.double() * s.double()).round(),
}


def _check_quantized(name, case, x, bits, got) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's (codes, scales) for x, checked against the engine; returned when right."""
    qmax, live, (*lead, T, hs) = 2 ** (bits - 1) - 1, x.abs().amax(-1, keepdim=True) > 0, x.shape
    want_codes, want_scales, _ = engine_quantized(x, bits)
    ck.expect(isinstance(got, (tuple, list)) and len(got) == 2, name, case, f"a pair (codes "
              f"{tuple(x.shape)}, scales {tuple(want_scales.shape)})", ck.kind(got),
              Q["pair"] + ck.FORGOT * (got is None))
    codes, scales = got

    def scales_hint(s: torch.Tensor) -> str:  # not all positive, or which wrong scales
        bad = ~(torch.isfinite(s) & (s > 0))
        return Q["zero" if (bad & ~live).any() else "positive"] if bad.any() else _scale_hint(
            x, s, bits)
    ck.expect_tensor(name, case, scales, want_scales, shape_words=", one per position (..., T, "
                     "1)", values=f"the engine's scales, max|x| / {qmax}", hints={
                         "tensor": Q["scales_tensor"], "dtype": Q["scales_dtype"],
                         "nan": scales_hint, "close": scales_hint, "shape": lambda s: Q[{
                             (*lead, 1, hs): "per_channel", (*lead, hs): "per_channel_flat",
                             (*lead, T): "column"}.get(tuple(s.shape)) or (
                             "per_tensor" if s.numel() == 1 else "scales_shape")]},
                     same=lambda s, w: bool((torch.isfinite(s) & (s > 0)).all()) and bool(
                         torch.allclose(s[live].double(), w[live].double(), rtol=1e-5, atol=0)))
    y = x.double() / want_scales.double()

    def codes_hint(c: torch.Tensor) -> str:  # out of range, or which wrong rounding
        if (c.long().abs() > qmax).any():
            return (Q["stored"].format(top=2 * qmax + 1, qmax=qmax) if torch.equal(
                c.long(), want_codes + qmax + 1) else Q["clamp"].format(qmax=qmax, bits=bits))
        return ck.diagnose(CODE_MISTAKES, [((x, want_scales), c.double())], same=lambda r, c: (
            torch.equal(c, r) or torch.equal(c, r.clamp(-qmax, qmax)))) or Q["round"]
    integer = isinstance(codes, torch.Tensor) and not (
        codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool)
    ck.expect_tensor(name, case, codes, want_codes.to(codes.dtype if integer else torch.int8),
                     shape_words=", one per element of x", values="round(x / scale), clamped",
                     hints={"tensor": Q["codes_tensor"], "shape": Q["codes_shape"],
                            "dtype": Q["codes_dtype"], "close": codes_hint},
                     same=lambda c, w: bool((c.long().abs() <= qmax).all()) and not bool(
                         ((c.double() - y).abs() > 0.5 + 1e-3).any()))  # ties may round apart
    return codes, scales


def _check_channel_quantized(name, case, x, bits, got) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel codes and scales of x, checked as the per-token ones of x transposed (the
    engine's quantize on the transposed block is the reference); hints in channel words."""
    *lead, T, hs = x.shape
    pair = isinstance(got, (tuple, list)) and len(got) == 2
    if pair and isinstance(got[0], torch.Tensor):
        ck.expect(got[0].shape == x.shape, name, case, f"codes of shape {tuple(x.shape)}, one "
                  f"per element of x", f"codes of shape {tuple(got[0].shape)}",
                  Q["channel_codes_shape"])
    if pair and isinstance(got[1], torch.Tensor):
        shape, want = tuple(got[1].shape), f"scales of shape {(*lead, 1, hs)}, one per channel"
        ck.expect(shape != (*lead, T, 1), name, case, want, f"scales of shape {shape}",
                  Q["per_token"])
        ck.expect(shape == (*lead, 1, hs), name, case, f"{want} (..., 1, hs)",
                  f"scales of shape {shape}", Q["row"])
        got = tuple(t.transpose(-1, -2) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t
                    for t in got)
    try:
        codes, scales = _check_quantized(name, case, x.transpose(-1, -2), bits, got)
    except ck.CheckFailed as e:
        message = str(e)
        for token_word, channel_word in Q["channel_words"]:
            message = message.replace(token_word, channel_word)
        raise ck.CheckFailed(message + Q["per_channel_too"]) from None
    return codes.transpose(-1, -2), scales.transpose(-1, -2)


@ck.guarded
@torch.no_grad()
def check_quantize(quantize_block, dequantize_block) -> None:
    """quantize_block(x, bits, per) -> (codes, scales); dequantize_block(codes, scales) -> x̂."""
    name, cases = "quantize_block", quant_cases()
    for label, x, bits, per in cases:
        case = f"{label}, bits={bits}" + (", per='channel'" if per == "channel" else "")
        with ck.forbid(name, *QUANT_FORBIDDEN):
            got = ck.call_kept(name, case, Q["unchanged"], quantize_block, x, bits,
                               raised=ck.raised_as(RuntimeError, Q["broadcast"], "size of tensor"),
                               **({"per": per} if per != "token" else {}))
        check = _check_quantized if per == "token" else _check_channel_quantized
        codes, scales = check(name, case, x, bits, got)
        with ck.forbid("dequantize_block", *QUANT_FORBIDDEN):
            out = ck.call_kept("dequantize_block", case, D["unchanged"], dequantize_block, codes,
                               scales)
        _check_dequantized(case, x, codes, scales, out)
    ck.passed("quantize_block and dequantize_block", len(cases))


D = H["dequantize_block"]
DEQUANT_MISTAKES = {D["codes"]: lambda codes, scales: codes.double(),  # a wrong dequantize_block
                    D["divided"]: lambda codes, scales: codes.double() / scales.double()}


def _check_dequantized(case, x, codes, scales, out) -> None:
    name = "dequantize_block"
    ck.expect_tensor(name, case, out, (codes.double() * scales.double()).to(scales.dtype),
                     shape_words=", x's", values="codes * scales", hints={**D, "nan": D["close"]},
                     mistakes=DEQUANT_MISTAKES, inputs=(codes, scales), same=lambda a, b: bool(
                         torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-30)))
    ck.expect(not ((out.double() - x.double()).abs() > scales.double() / 2 * (1 + 1e-4) + 1e-30)
              .any(), name, case, "every element within half a scale of x", "a larger error",
              D["half"])


# --- exercise 3: which positions a sink-and-window cache holds ----------------------------------
HELD_HINTS = H["held_positions"]
N_TOKENS = 24  # each (sinks, window) is fed N_TOKENS tokens one per pass, t = 0 .. N_TOKENS - 1
WINDOW_PAIRS = [(2, 4), (0, 5), (4, 8), (1, 1), (0, 1), (3, 2), (5, 3), (4, 12)]


def _right(t: int, s: int, w: int) -> list[int]:  # with w ± 1: the window's off-by-ones
    return sorted(set(range(min(s, t + 1))) | set(_recent(t, w)))


def _recent(t: int, n: int) -> list[int]:
    return list(range(max(0, t - n + 1), t + 1))


@lru_cache(maxsize=None)
def engine_positions(sinks: int, window: int, n_tokens: int = N_TOKENS) -> list[list[int]]:
    """The positions a real SinkWindowCache holds after each pass, fed one token per pass."""
    model = ck.tiny_model(7, n_layer=1)
    cache = SinkWindowCache.for_model(model, sinks=sinks, window=window)
    gen = torch.Generator().manual_seed(72 + 10 * sinks + window)
    tokens = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=gen).tolist()
    return [(feed(model, [token], cache), list(cache.positions))[1] for token in tokens]


def _held_list(got, t, sinks, window):
    if isinstance(got, (set, frozenset)):
        raise ck.Refused(HELD_HINTS["set"])
    held = list(got) if isinstance(got, range) else ck.int_list(got)
    if held is None:
        raise ck.Refused(HELD_HINTS["ints"])
    return held


def _held_otherwise(answers) -> str:
    (t, sinks, window), held = next((c, g) for c, g in answers if g != _right(*c))
    if sorted(held) == _right(t, sinks, window):
        return HELD_HINTS["order"]
    if len(set(held)) < len(held):
        return HELD_HINTS["duplicates"]
    if any(p > t or p < 0 for p in held):
        return HELD_HINTS["written"].format(t=t)
    return HELD_HINTS["otherwise"]


HELD = ck.Exercise(
    "held_positions",
    cases=[(t, s, w) for s, w in WINDOW_PAIRS for t in range(N_TOKENS)],
    describe=lambda t, sinks, window: (f"t={t}, sinks={sinks}, window={window} (fed one token "
                                       f"per pass: positions 0 .. {t} written)"),
    reference=lambda t, sinks, window: engine_positions(sinks, window)[t],
    returns=_held_list, forbid=(SinkWindowCache.update, feed), solution=_right,
    mistakes=ck.named(
        HELD_HINTS, window_plus_one=lambda t, s, w: _right(t, s, w + 1),
        window_minus_one=lambda t, s, w: _right(t, s, w - 1),
        sinks_twice=lambda t, s, w: list(range(min(s, t + 1))) + _recent(t, w),
        unwritten_sinks=lambda t, s, w: sorted(set(range(s)) | set(_recent(t, w))),
        no_sinks=lambda t, s, w: _recent(t, w), last_all=lambda t, s, w: _recent(t, s + w),
        slots=lambda t, s, w: list(range(len(_right(t, s, w)))),
        tokens_seen=lambda t, s, w: _right(t - 1, s, w) if t > 0 else []),
    otherwise=_held_otherwise)
check_held_positions = HELD.check
EXERCISES = (HELD,)

# --- exercise 4 (predict, then measure): the bytes of two caches that combine savings ----------
B = H["predict_bytes"]
BYTES_TEXT = ("Once upon a time there was a little cat named Tom. Tom liked to play in the garden "
              "with his red ball. One day the ball rolled under a big tree, and Tom could not "
              "find it.")
BYTES_TOKENS, BYTES_KEYS = 50, ("gqa2_int4", "mqa_window")


def measure_bytes() -> dict[str, int]:
    """nbytes after 50 tokens: target-gqa2's 4-bit cache, target-mqa's SinkWindowCache(4, 16)."""
    (gqa2, tok), (mqa, _) = (load_course_model(m, "cpu") for m in ("target-gqa2", "target-mqa"))
    ids = tok.encode(BYTES_TEXT)[:BYTES_TOKENS]
    assert len(ids) == BYTES_TOKENS
    quantized = QuantizedKVCache.for_model(gqa2, max_len=BYTES_TOKENS, bits=4)
    window = SinkWindowCache.for_model(mqa, sinks=4, window=16)
    gqa2(torch.tensor([ids]), cache=quantized)
    feed(mqa, ids, window)
    return {"gqa2_int4": quantized.nbytes, "mqa_window": window.nbytes}


def _bytes_mistakes(key: str) -> list[tuple[int, str]]:
    """(bytes, hint): what each usual mistake predicts."""
    layers, hs, n, heads, per = 12, 24, BYTES_TOKENS, 2, 12 * 2 * 1 * 24 * 4  # per: an mqa slot
    return [(wrong, B[hint]) for hint, wrong in (dict(
        no_scales=layers * 2 * heads * (hs // 2) * n, half_byte=layers * 2 * heads * (hs + 4) * n,
        query_heads=layers * 2 * 8 * (hs // 2 + 4) * n, k_and_v=layers * heads * (hs // 2 + 4) * n,
        layers=2 * heads * (hs // 2 + 4) * n, fp32=layers * 2 * heads * hs * 4 * n,
        fed=layers * 2 * heads * (hs // 2 + 4) * (n - 1),
    ) if key == "gqa2_int4" else dict(
        evicts=per * n, newest=per * 21, sinks_stay=per * 16, one_head=layers * 2 * 8 * hs * 4 * 20,
        k_and_v_too=layers * 8 * hs * 4 * 20 // 8, layers=2 * hs * 4 * 20,
        not_quantized=per * 20 // 2)).items()]


@ck.guarded
@torch.no_grad()
def check_predict_bytes(predict_bytes) -> None:
    """predict_bytes() -> {"gqa2_int4": ..., "mqa_window": ...}, against measure_bytes()."""
    name = "predict_bytes"
    case = ("after the first 50 tokens of a story: target-gqa2 with a 4-bit "
            "QuantizedKVCache, target-mqa with SinkWindowCache(sinks=4, window=16)")
    got = ck.predicted(name, case, ck.prediction(name, case, predict_bytes, GPT.forward, feed),
                       BYTES_KEYS, B["dict"], B["int"])
    measured = measure_bytes()
    ck.as_measured(name, case, got, measured, _bytes_mistakes, B["wrong"], B["otherwise"])
    full = 12 * 2 * 8 * 24 * 4 * BYTES_TOKENS
    print(f"  measured: {measured['gqa2_int4']:,} and {measured['mqa_window']:,} bytes, "
          f"{full / measured['gqa2_int4']:.1f}x and {full / measured['mqa_window']:.1f}x less "
          f"than the target's fp32 cache ({full:,})")
    ck.passed(name, len(BYTES_KEYS))


# --- exercise 5 (debug): a sink-and-window cache --------------------------------------------------
W = H["window_cache"]
DEBUG_PAIRS = [(4, 8), (2, 5), (0, 6), (1, 1)]


class _BuggyWindowCache(SinkWindowCache):
    """The notebook's BuggyWindowCache, logit for logit: the next token's position is the number
    of slots held, not the number of tokens seen."""

    def get_seq_length(self, layer_idx=0):
        return len(self.positions)


@ck.guarded
@torch.no_grad()
def check_window_cache(cache_class) -> None:
    """cache_class(model, sinks, window) fed one token per pass, against SinkWindowCache."""
    name, model, same_as_buggy = "window_cache", ck.tiny_model(3), True
    ck.expect(isinstance(cache_class, type) and issubclass(cache_class, Cache), name, "the class",
              "a Cache subclass (of BuggyWindowCache)", cache_class, W["class"])
    ids = [(7 * i * i + 3 * i + 1) % 500 for i in range(26)]
    for sinks, window in DEBUG_PAIRS:
        engine, buggy = (c.for_model(model, sinks=sinks, window=window)
                         for c in (SinkWindowCache, _BuggyWindowCache))
        case = f"sinks={sinks}, window={window}, a {len(ids)}-token text fed one token per pass"
        mine = ck.call(name, case, cache_class, model, sinks, window)
        for t, token in enumerate(ids):
            x, where = torch.tensor([[token]]), f"{case}: the pass that feeds position {t}"
            want, from_buggy = (model(x, cache=c)[0, -1] for c in (engine, buggy))
            with ck.forbid(name, SinkWindowCache.update, SinkWindowCache.get_seq_length):
                got = ck.call(name, f"{case}, at position {t}", model, x, cache=mine)[0, -1]
            as_buggy = torch.allclose(got, from_buggy, atol=1e-5)
            same_as_buggy &= as_buggy
            if not torch.allclose(got, want, atol=1e-4):
                ck.fail(name, where, "the engine's logits (max |Δ| < 1e-4)", f"max |Δ| = "
                        f"{float((got - want).abs().max()):.3g}", W["buggy"] + W["symptom"]
                        if as_buggy else W["before_eviction"] if t < sinks + window else
                        W["symptom"])
            if list(mine.positions) != engine.positions:
                ahead = bool(mine.positions) and max(mine.positions) > max(engine.positions)
                ck.fail(name, where, f"positions {engine.positions}", f"{list(mine.positions)}",
                        W["ahead" if ahead else "positions"])
    ck.expect(not same_as_buggy, name, "every case", "a fixed cache", "BuggyWindowCache's logits",
              W["buggy_everywhere"] + W["symptom"])
    ck.passed(name, len(DEBUG_PAIRS) * len(ids))


# --- exercise 6 (design): sinks and window under a memory budget ----------------------------------
CW = H["choose_window"]
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


def _split(got):
    """The contract: (sinks, window), sinks ≥ 0 and window ≥ 1."""
    pair = ck.int_list(got) if isinstance(got, (tuple, list)) else None
    if pair is None or len(pair) != 2 or pair[0] < 0 or pair[1] < 1:
        raise ck.Refused(CW["pair"])
    return pair


@ck.guarded
@torch.no_grad()
def check_choose_window(choose_window) -> None:
    """choose_window(budget_bytes) -> (sinks, window): fits, and within 2% of the best loss."""
    name, per_position = "choose_window", window_bytes(0, 1)
    for budget in (DESIGN_BUDGET,) + OTHER_BUDGETS:
        case = f"a budget of {budget:,} bytes of K/V per sequence (the fp32 course target)"
        sinks, window = ck.obeyed(name, case, _split, ck.call(name, case, choose_window, budget),
                                  expected="(sinks, window): two ints, sinks ≥ 0, window ≥ 1")
        slots = budget // per_position
        held = window_bytes(sinks, window)
        ck.expect(held <= budget, name, case, f"at most {budget:,} bytes held", f"{held:,} bytes "
                  f"for {sinks} sinks + {window} window",
                  CW["too_big"].format(per=per_position, slots=slots, budget=budget))
        ck.expect(sinks + window >= slots, name, case, f"sinks + window = {slots}, the positions "
                  f"the budget pays for", f"{sinks} + {window} = {sinks + window}", CW["wasted"])
        if budget != DESIGN_BUDGET:
            continue
        losses = {s: window_loss(s, slots - s) for s in SINK_CANDIDATES if s < slots}
        mine = losses[sinks] if sinks in losses else window_loss(sinks, window)
        best, best_s = min(losses.values()), min(losses, key=losses.get)
        if mine > best * (1 + LOSS_MARGIN):
            hint = CW["no_sinks" if sinks == 0 else "too_many" if sinks > best_s else "too_few"]
            table = ", ".join(f"{s} sinks: {v:.3f}" for s, v in losses.items())
            ck.fail(name, case, f"a split within {100 * LOSS_MARGIN:.0f}% of the best held-out "
                    f"loss ({best:.3f}, {best_s} sinks + {slots - best_s} window)",
                    f"{sinks} sinks + {window} window: loss {mine:.3f}",
                    CW["losses"].format(hint=hint, slots=slots, table=table))
    ck.passed(name, 1 + len(OTHER_BUDGETS))
