"""Chapter 07's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake; their references are the engine's (a grouped model's own attention, the quantized cache's
codes, a window cache's positions), and they are quick and leave the caller's random state alone."""
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import CheckFailed, ch07
from minikv.engine import causal_attention
from minikv.engine.quantized import QuantizedKVCache, quantize
from minikv.engine.window import SinkWindowCache

from conftest import solution_check_cells, stub

# --- exercise 1: gqa_attention --------------------------------------------------------------------


def attend(q, k, v, expand="interleave", mask="causal", scale=None, dim=-1, after=False):
    group = q.size(1) // k.size(1)
    if expand == "interleave":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    elif expand == "repeat":
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    T, hs = q.size(-2), q.size(-1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(hs) if scale is None else scale)
    ones = torch.ones(T, T, dtype=torch.bool)
    allowed = {"causal": ones.tril(), "none": None, "triu": ones.triu(), "next": ones.tril(1),
               "self": ones.tril(-1)}[mask]
    if allowed is not None and not after:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=dim)
    if allowed is not None and after:
        weights = weights * allowed
    return weights @ v


def gqa_attention(q, k, v):
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    T, hs = q.size(-2), q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def gqa_grouped_view(q, k, v):
    """Also right: the query heads viewed as (n_kv_head, group), each K/V head broadcast over its
    group, no copy of K and V."""
    B, nh, T, hs = q.shape
    nkv = k.size(1)
    qg = q.view(B, nkv, nh // nkv, T, hs)
    scores = qg @ k[:, :, None].transpose(-2, -1) / hs ** 0.5       # (B, nkv, group, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v[:, :, None]).reshape(B, nh, T, hs)


def gqa_head_by_head(q, k, v):
    """Also right: a loop over the query heads, each reading K/V head i // group."""
    group = q.size(1) // k.size(1)
    return torch.stack([attend(q[:, i:i + 1], k[:, i // group:i // group + 1],
                               v[:, i // group:i // group + 1]) for i in range(q.size(1))], dim=1
                       )[:, :, 0]


def gqa_repeat(q, k, v):
    return attend(q, k, v, expand="repeat")


def gqa_group_axis_swapped(q, k, v):
    B, nh, T, hs = q.shape
    nkv = k.size(1)
    qg = q.view(B, nh // nkv, nkv, T, hs)                 # query head i in group i % nkv
    scores = qg @ k[:, None].transpose(-2, -1) / hs ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v[:, None]).reshape(B, nh, T, hs)


def gqa_no_mask(q, k, v):
    return attend(q, k, v, mask="none")


def gqa_unscaled(q, k, v):
    return attend(q, k, v, scale=1.0)


def gqa_by_hs(q, k, v):
    return attend(q, k, v, scale=1 / q.size(-1))


def gqa_softmax_queries(q, k, v):
    return attend(q, k, v, dim=-2)


def gqa_mask_after(q, k, v):
    return attend(q, k, v, after=True)


def gqa_mask_transposed(q, k, v):
    return attend(q, k, v, mask="triu")


def gqa_sees_next(q, k, v):
    return attend(q, k, v, mask="next")


def gqa_not_itself(q, k, v):
    return attend(q, k, v, mask="self")


def gqa_no_expand(q, k, v):
    return attend(q, k, v, expand="none")


def gqa_heads_last(q, k, v):
    return gqa_attention(q, k, v).transpose(1, 2)


def gqa_kv_heads_out(q, k, v):
    group = q.size(1) // k.size(1)
    B, nh, T, hs = q.shape
    return gqa_attention(q, k, v).view(B, nh // group, group, T, hs).mean(2)


def gqa_in_place(q, k, v):
    q /= math.sqrt(q.size(-1))
    return attend(q, k, v, scale=1.0)


def gqa_float64(q, k, v):
    return gqa_attention(q.double(), k.double(), v.double())


def gqa_numpy(q, k, v):
    return gqa_attention(q, k, v).numpy()


def gqa_forgets_to_return(q, k, v):
    gqa_attention(q, k, v)


def gqa_by_torch(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def gqa_by_the_engine(q, k, v):
    return causal_attention(q, k, v)


GQA_WRONG = [
    (gqa_repeat, "k.repeat"),
    (gqa_group_axis_swapped, "K/V head i % n_kv_head"),
    (gqa_no_mask, "no causal mask"),
    (gqa_unscaled, "not divided by sqrt"),
    (gqa_by_hs, "divide by head_dim"),
    (gqa_softmax_queries, "softmax over the queries"),
    (gqa_mask_after, "after the softmax"),
    (gqa_mask_transposed, "mask transposed"),
    (gqa_sees_next, "diagonal is off by one"),
    (gqa_not_itself, "its own key included"),
    (gqa_no_expand, "repeat_interleave on dim 1"),
    (gqa_heads_last, "heads in dim 1"),
    (gqa_kv_heads_out, "one output per QUERY head"),
    (gqa_in_place, "changed in place"),
    (gqa_float64, "compute in q's dtype"),
    (gqa_numpy, "one torch tensor"),
    (gqa_forgets_to_return, "did you forget to return it"),
    (gqa_by_torch, "called torch.nn.functional.scaled_dot_product_attention"),
    (gqa_by_the_engine, "called minikv's own minikv.engine.model.causal_attention"),
]

# --- exercise 2: quantize_block and dequantize_block ----------------------------------------------


def quantize_with(x, bits, n=None, dim=-1, signed=False, rounding=torch.round, clamp=True,
                  clamp_scale=True, dtype=torch.int8):
    qmax = 2 ** (bits - 1) - 1
    amax = (x if signed else x.abs()).amax(dim=dim, keepdim=True)
    if clamp_scale:
        amax = amax.clamp(min=torch.finfo(x.dtype).tiny)
    scales = amax / (qmax if n is None else n(bits))
    codes = rounding(x / scales)
    if clamp:
        codes = codes.clamp(-qmax, qmax)
    return codes.to(dtype), scales


def quantize_block(x, bits, per="token"):
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax(dim=-1 if per == "token" else -2, keepdim=True)
    scales = amax.clamp(min=torch.finfo(x.dtype).tiny) / qmax
    codes = torch.round(x / scales).clamp(-qmax, qmax).to(torch.int8)
    return codes, scales


def dequantize_block(codes, scales):
    return codes.to(scales.dtype) * scales


def quantize_where_zero(x, bits, per="token"):
    """Also right: a zero vector given the scale 1 (any positive scale codes it as zeros), codes
    as int64, no clamp (with the right scale x / scale never passes ±qmax)."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax(dim=-1 if per == "token" else -2, keepdim=True)
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.round(x / scales).long(), scales


def quantize_by_multiplying(x, bits, per="token"):
    """Also right: x * (qmax / max|x|) instead of x / scale (a code may differ at a tie)."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax(dim=-1 if per == "token" else -2, keepdim=True).clamp(
        min=torch.finfo(x.dtype).tiny)
    return torch.round(x * (qmax / amax)).to(torch.int16), amax / qmax


def quantize_per_channel(x, bits):
    return quantize_with(x, bits, dim=-2)


def quantize_per_channel_no_keepdim(x, bits):
    codes, scales = quantize_with(x, bits, dim=-2)
    return codes, scales.squeeze(-2)


def quantize_per_tensor(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().max() / qmax
    return torch.round(x / scale).to(torch.int8), scale


def quantize_over_2_to_bits(x, bits):
    return quantize_with(x, bits, n=lambda b: 2 ** b)


def quantize_over_2_to_bits_minus_1(x, bits):
    return quantize_with(x, bits, n=lambda b: 2 ** (b - 1))


def quantize_overflow_no_clamp(x, bits):
    return quantize_with(x, bits, n=lambda b: 2 ** (b - 1), clamp=False, dtype=torch.int16)


def quantize_unsigned_range(x, bits):
    return quantize_with(x, bits, n=lambda b: 2 ** b - 1)


def quantize_wastes_a_level(x, bits):
    return quantize_with(x, bits, n=lambda b: 2 ** (b - 1) - 2)


def quantize_no_abs(x, bits):
    return quantize_with(x, bits, signed=True)


def quantize_truncates(x, bits):
    return quantize_with(x, bits, rounding=lambda y: y)  # .to(int8) truncates toward zero


def quantize_floors(x, bits):
    return quantize_with(x, bits, rounding=torch.floor)


def quantize_zero_scale(x, bits):
    return quantize_with(x, bits, clamp_scale=False)


def quantize_unsigned_codes(x, bits):
    codes, scales = quantize_block(x, bits)
    return (codes.long() + 2 ** (bits - 1)).to(torch.uint8), scales


def quantize_float_codes(x, bits):
    codes, scales = quantize_block(x, bits)
    return codes.float(), scales


def quantize_scales_flat(x, bits):
    codes, scales = quantize_block(x, bits)
    return codes, scales[..., 0]


def quantize_in_place(x, bits):
    qmax = 2 ** (bits - 1) - 1
    scales = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / qmax
    x /= scales
    return x.round().to(torch.int8), scales


def quantize_forgets_to_return(x, bits):
    quantize_block(x, bits)


def quantize_by_the_engine(x, bits):
    packed, scales = quantize(x, bits)
    return quantize_block(x, bits)[0], scales


def dequantize_no_scale(codes, scales):
    return codes.to(scales.dtype)


def dequantize_divides(codes, scales):
    return codes.to(scales.dtype) / scales


def dequantize_int(codes, scales):
    return codes


# (quantize_block, dequantize_block, a fragment of the hint)
QUANT_WRONG = [
    (quantize_per_channel, dequantize_block, "one scale per CHANNEL"),
    (quantize_per_channel_no_keepdim, dequantize_block, "one scale per CHANNEL"),
    (quantize_per_tensor, dequantize_block, "per tensor"),
    (quantize_over_2_to_bits, dequantize_block, r"max\|x\| / 2\^bits"),
    (quantize_over_2_to_bits_minus_1, dequantize_block, "off by one level"),
    (quantize_overflow_no_clamp, dequantize_block, "unclamped it overflows"),
    (quantize_unsigned_range, dequantize_block, r"max\|x\| / \(2\^bits - 1\)"),
    (quantize_wastes_a_level, dequantize_block, "wastes a level"),
    (quantize_no_abs, dequantize_block, "not the largest MAGNITUDE"),
    (quantize_truncates, dequantize_block, "truncating"),
    (quantize_floors, dequantize_block, "floor"),
    (quantize_zero_scale, dequantize_block, "all zeros"),
    (quantize_unsigned_codes, dequantize_block, "the engine's stored codes"),
    (quantize_float_codes, dequantize_block, "integer dtype"),
    (quantize_scales_flat, dequantize_block, "keepdim=True"),
    (quantize_in_place, dequantize_block, "x changed in place"),
    (quantize_forgets_to_return, dequantize_block, "did you forget to return it"),
    (quantize_by_the_engine, dequantize_block,
     "called minikv's own minikv.engine.quantized.quantize"),
    (quantize_block, dequantize_no_scale, "multiply them back by their scales"),
    (quantize_block, dequantize_divides, "you divided by the scales"),
    (quantize_block, dequantize_int, "dequantized values are real numbers"),
]

def quantize_ignores_per(x, bits, per="token"):  # per-token scales whatever is asked
    return quantize_block(x, bits)


def quantize_channel_no_keepdim(x, bits, per="token"):
    codes, scales = quantize_block(x, bits, per)
    return codes, scales.squeeze(-2) if per == "channel" else scales


def quantize_channel_zero_scale(x, bits, per="token"):
    if per == "token":
        return quantize_block(x, bits)
    qmax = 2 ** (bits - 1) - 1
    scales = x.abs().amax(dim=-2, keepdim=True) / qmax
    return torch.round(x / scales).clamp(-qmax, qmax).to(torch.int8), scales


def quantize_channel_off_by_one(x, bits, per="token"):
    if per == "token":
        return quantize_block(x, bits)
    return quantize_with(x, bits, dim=-2, n=lambda b: 2 ** (b - 1))


CHANNEL_WRONG = [
    (quantize_ignores_per, dequantize_block, "per-TOKEN scales"),
    (quantize_channel_no_keepdim, dequantize_block, "one scale per channel and head"),
    (quantize_channel_zero_scale, dequantize_block, "a channel that is all zeros"),
    (quantize_channel_off_by_one, dequantize_block, "off by one level"),
]


# --- exercise 3: held_positions -------------------------------------------------------------------


def held_positions(t, sinks, window):
    seen = t + 1
    if seen <= sinks + window:
        return list(range(seen))
    return list(range(sinks)) + list(range(seen - window, seen))


def held_by_simulation(t, sinks, window):
    """Also right: the cache's own bookkeeping replayed, one position a pass, as numpy ints."""
    held = []
    for p in range(t + 1):
        held.append(p)
        if len(held) > sinks + window:
            held = held[:sinks] + held[len(held) - window:]
    return np.array(held, dtype=np.int64)


def held_set_union(t, sinks, window):
    """Also right: the sinks written so far and the window, as a sorted set."""
    return sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))


def held_as_set(t, sinks, window):
    return set(held_positions(t, sinks, window))


def held_window_first(t, sinks, window):
    held = held_positions(t, sinks, window)
    return held[min(sinks, len(held)):] + held[:min(sinks, len(held))]


def held_count(t, sinks, window):
    return len(held_positions(t, sinks, window))


def held_forgets_to_return(t, sinks, window):
    held_positions(t, sinks, window)


def held_by_the_engine(t, sinks, window):
    model = minikv.GPT(minikv.GPTConfig.preset("tiny", n_layer=1)).eval()
    cache = SinkWindowCache.for_model(model, sinks=sinks, window=window)
    minikv.engine.window.feed(model, [1] * (t + 1), cache)
    return cache.positions


WINDOW_WRONG = [
    (held_as_set, "return a list, in the order the cache holds them"),
    (held_window_first, "the right positions in the wrong order"),
    (held_count, "return a list of ints"),
    (held_forgets_to_return, "did you forget to return it"),
    (held_by_the_engine, "called minikv's own minikv.engine.window.feed"),
]

# --- exercise 4 (predict, then measure): bytes ----------------------------------------------------

def predict_bytes():
    return {"gqa2_int4": 12 * 2 * 2 * (12 + 4) * 50, "mqa_window": 12 * 2 * 1 * 24 * 4 * 20}


def _bytes(**changes):
    def predict():
        return {**predict_bytes(), **changes}
    predict.__name__ = "bytes_" + "_".join(f"{k}_{v}" for k, v in changes.items())
    return predict


BYTES_WRONG = [
    (_bytes(gqa2_int4=28_800), "you forgot the scales"),
    (_bytes(gqa2_int4=67_200), "half a byte"),
    (_bytes(gqa2_int4=153_600), "2 K/V heads, not the 8 query heads"),
    (_bytes(gqa2_int4=19_200), "K and V"),
    (_bytes(gqa2_int4=230_400), "the fp32 cache"),
    (_bytes(mqa_window=115_200), "not all 50"),
    (_bytes(mqa_window=48_384), "sinks \\+ window = 20 positions"),
    (_bytes(mqa_window=36_864), "the 4 sinks stay too"),
    (_bytes(mqa_window=368_640), "ONE K/V head"),
    (_bytes(mqa_window=23_040), "it is not quantized"),
    (_bytes(mqa_window=46_080.0), "an int"),
    (lambda: (38_400, 46_080), "a dict with the keys"),
    (lambda: {"gqa2_int4": ch07.measure_bytes()["gqa2_int4"], "mqa_window": 46_080},
     "a prediction is made before the measurement"),
]


# --- exercise 5 (debug): a sink-and-window cache --------------------------------------------------

class WindowCacheFixed(ch07.BuggyWindowCache):
    def __init__(self, model, sinks, window):
        super().__init__(model, sinks, window)
        self.seen = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, key, value, layer_idx):
        out = super().update(key, value, layer_idx)
        if layer_idx == self.n_layer - 1:
            self.seen += key.shape[2]
        return out


class WindowCacheLastPlusOne(ch07.BuggyWindowCache):
    """Takes the last held slot's position + 1: right, the positions are true ones."""

    def get_seq_length(self, layer_idx=0):
        return self.positions[-1] + 1 if self.positions else 0


class WindowCacheCountsSlotsOnce(ch07.BuggyWindowCache):  # counts per layer, not per pass
    def __init__(self, model, sinks, window):
        super().__init__(model, sinks, window)
        self.seen = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, key, value, layer_idx):
        self.seen += key.shape[2]
        return super().update(key, value, layer_idx)


class WindowCacheNoEviction(ch07.BuggyWindowCache):
    def __init__(self, model, sinks, window):
        super().__init__(model, sinks, window)
        self.sinks, self.window = 0, 10_000


class WindowCacheWrongFirstPasses(WindowCacheFixed):
    def update(self, key, value, layer_idx):
        k, v = super().update(key, value, layer_idx)
        return k, v * 0.5


class WindowCacheByTheEngine(minikv.SinkWindowCache):
    def __init__(self, model, sinks, window):
        cfg = model.config
        super().__init__(cfg.n_layer, cfg.kv_heads, cfg.head_dim, sinks, window,
                         block_size=cfg.block_size)


WINDOW_CACHE_WRONG = [
    (ch07.BuggyWindowCache, "BuggyWindowCache unchanged"),
    (WindowCacheCountsSlotsOnce, "once per LAYER"),
    (WindowCacheNoEviction, "the first `sinks` and the last"),
    (WindowCacheWrongFirstPasses, "wrong before anything is evicted"),
    (WindowCacheByTheEngine, "called minikv's own"),
    (ch07.SinkWindowCache.__init__, "a Cache subclass"),
]


def test_window_cache_other_fix_passes():
    ch07.check_window_cache(WindowCacheLastPlusOne)


# --- exercise 6 (design): sinks and window under a budget -----------------------------------------

def choose_window(budget_bytes):  # a few sinks (StreamingLLM's 4), the rest a window
    slots = budget_bytes // (12 * 2 * 8 * 24 * 4)
    sinks = min(4, slots // 4)
    return sinks, slots - sinks


def window_no_sinks(budget_bytes):
    return 0, budget_bytes // 18_432


def window_many_sinks(budget_bytes):
    slots = budget_bytes // 18_432
    return slots // 2, slots - slots // 2


def window_over_budget(budget_bytes):
    slots = budget_bytes // 18_432
    return 4, slots - 3  # "the newest token is held on top of sinks + window"


def window_leaves_room(budget_bytes):
    slots = budget_bytes // 18_432
    return 4, slots - 6


def window_counts_half(budget_bytes):  # keys only: 9,216 bytes a position
    slots = budget_bytes // 9_216
    return 4, slots - 4


def window_as_dict(budget_bytes):
    return {"sinks": 4, "window": budget_bytes // 18_432 - 4}


CHOOSE_WINDOW_WRONG = [
    (window_no_sinks, "no sinks"),
    (window_many_sinks, "too many sinks"),
    (window_over_budget, "sinks \\+ window positions after every pass"),
    (window_leaves_room, "memory wasted"),
    (window_counts_half, "12 layers × K and V"),
    (window_as_dict, "return the pair"),
]


def test_design_losses_rank_a_few_sinks_first():
    """The landscape the design checker relies on: no sinks is clearly worst, a few is best."""
    losses = {s: ch07.window_loss(s, 16 - s) for s in (0, 4, 8)}
    assert losses[0] > 1.05 * losses[4] and losses[8] > losses[4]


# --- all exercises --------------------------------------------------------------------------------

CHECKS = {
    "gqa_attention": (ch07.check_gqa_attention, (gqa_attention,)),
    "quantize_block and dequantize_block": (ch07.check_quantize,
                                            (quantize_block, dequantize_block)),
    "held_positions": (ch07.check_held_positions, (held_positions,)),
    "predict_bytes": (ch07.check_predict_bytes, (predict_bytes,)),
    "window_cache": (ch07.check_window_cache, (WindowCacheFixed,)),
    "choose_window": (ch07.check_choose_window, (choose_window,)),
}
WRONG = ([("gqa_attention", (w,), f) for w, f in GQA_WRONG]
         + [("quantize_block and dequantize_block", (q, d), f)
            for q, d, f in QUANT_WRONG + CHANNEL_WRONG]
         + [("held_positions", (w,), f) for w, f in WINDOW_WRONG]
         + [("predict_bytes", (w,), f) for w, f in BYTES_WRONG]
         + [("window_cache", (w,), f) for w, f in WINDOW_CACHE_WRONG]
         + [("choose_window", (w,), f) for w, f in CHOOSE_WINDOW_WRONG])


def _id(value):
    if isinstance(value, tuple):
        return "+".join(f.__name__ for f in value)
    return None if value in CHECKS else "hint"


@pytest.mark.parametrize("name", CHECKS)
def test_solution_passes(name, capsys):
    checker, solution = CHECKS[name]
    checker(*solution)
    assert f"✓ {name}: all " in capsys.readouterr().out


@pytest.mark.parametrize("checker, right", [
    (ch07.check_gqa_attention, (gqa_grouped_view,)),
    (ch07.check_gqa_attention, (gqa_head_by_head,)),
    (ch07.check_quantize, (quantize_where_zero, dequantize_block)),
    (ch07.check_quantize, (quantize_by_multiplying, dequantize_block)),
    (ch07.check_held_positions, (held_by_simulation,)),
    (ch07.check_held_positions, (held_set_union,)),
], ids=lambda v: _id(v) if isinstance(v, tuple) else v.__name__)
def test_other_right_ways_pass(checker, right, capsys):
    checker(*right)
    assert capsys.readouterr().out.startswith("✓ ")


class StubWindowCache(ch07.BuggyWindowCache):  # the debug exercise as students receive it
    get_seq_length = stub


@pytest.mark.parametrize("name", CHECKS)
def test_stub_raises_not_implemented(name):
    checker, solution = CHECKS[name]
    with pytest.raises(NotImplementedError):
        checker(*([StubWindowCache] if name == "window_cache" else [stub] * len(solution)))
    if len(solution) == 2:  # a stubbed dequantize_block after a written quantize_block
        with pytest.raises(NotImplementedError):
            checker(solution[0], stub)


@pytest.mark.parametrize("name, wrong, fragment", WRONG, ids=_id)
def test_wrong_answer_rejected_with_its_mistake_named(name, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        CHECKS[name][0](*wrong)


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, solution in CHECKS.values():
        checker(*solution)
    assert torch.equal(before, torch.random.get_rng_state())


def test_checkers_are_fast():
    for checker, solution in CHECKS.values():
        start = time.perf_counter()
        checker(*solution)
        assert time.perf_counter() - start < 5, checker.__name__


# --- the checkers' cases are sound ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["target-gqa2", "target-mqa"])
def test_a_grouped_model_attends_as_repeat_interleave_says(name):
    """The course's grouped models give their own logits with the solution's attention (query head
    i reads K/V head i // group), and other logits with the K/V heads tiled (i % n_kv_head)."""
    model, tok = minikv.load_course_model(name, "cpu")
    ids = torch.tensor([tok.encode(ch07.TEXT)])
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(model(ids, attention=gqa_attention), want, atol=1e-4,
                                   rtol=1e-4)
        tiled = model(ids, attention=gqa_repeat)
    assert model.config.kv_heads < model.config.n_head
    if model.config.kv_heads > 1:
        assert (tiled - want).abs().max() > 1e-2


def test_gqa_shapes_cover_the_edges():
    shapes = ch07.GQA_SHAPES
    B, nh, nkv, T, _ = shapes[0]
    assert 1 < nkv < nh and T > 1  # the first case tells every mistake apart
    assert any(nkv == 1 for _, _, nkv, _, _ in shapes)
    assert any(nkv == nh for _, nh, nkv, _, _ in shapes)
    assert any(T == 1 for *_, T, _ in shapes) and any(B > 1 for B, *_ in shapes)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, nh, T, 8, generator=gen)
    k, v = (torch.randn(B, nkv, T, 8, generator=gen) for _ in range(2))
    want = causal_attention(q, k, v)
    wrongs = [w for w, _ in ch07.gqa_mistakes(q, k, v)]
    assert all(not torch.allclose(w, want, atol=1e-4) for w in wrongs)
    assert all(not torch.allclose(a, b, atol=1e-4)
               for i, a in enumerate(wrongs) for b in wrongs[i + 1:])


def test_quantize_reference_is_what_the_quantized_cache_holds():
    """engine_quantized is what QuantizedKVCache stores for the course target's layer-0 keys (the
    layer whose keys no quantization upstream has changed), and the solution agrees with it code
    for code on every case."""
    model, tok = minikv.load_course_model("target", "cpu")
    T, c = 20, model.config
    ids = torch.tensor([tok.encode(ch07.TEXT)[:T]])
    for bits in (8, 4):
        cache = QuantizedKVCache.for_model(model, max_len=T + 1, bits=bits)
        plain = minikv.KVCache.for_model(model, max_len=T)
        with torch.no_grad():
            model(ids, cache=cache)
            model(ids, cache=plain)
        one = torch.zeros(1, c.kv_heads, 1, c.n_embd // c.n_head)
        held, _ = cache.update(one, one, 0)  # dequantized K, layer 0
        codes, scales, dequantized = ch07.engine_quantized(plain.keys[0][:, :, :T], bits)
        torch.testing.assert_close(held[:, :, :T], dequantized, atol=0, rtol=0)
        torch.testing.assert_close(cache.key_scales[0][:, :, :T], scales, atol=0, rtol=0)
        assert codes.abs().max() == 2 ** (bits - 1) - 1
    for _, x, bits in ch07.quant_cases():
        codes, scales, _ = ch07.engine_quantized(x, bits)
        mine, my_scales = quantize_block(x, bits)
        assert torch.equal(mine.long(), codes) and torch.equal(my_scales, scales)


def test_quant_cases_cover_the_edges():
    cases = ch07.quant_cases()
    assert {8, 4} == {bits for *_, bits in cases}
    assert all(x.size(-1) != x.size(-2) for _, x, _ in cases)  # per channel shows in the shape
    assert any((x.abs().amax(-1) == 0).any() for _, x, _ in cases)
    assert any((x.amax(-1) < x.abs().amax(-1)).any() for _, x, _ in cases)
    assert any(x.dtype == torch.float64 for _, x, _ in cases)


def test_window_reference_is_the_formula_and_the_cases_cover_the_edges():
    pairs = ch07.WINDOW_PAIRS
    assert any(s == 0 for s, _ in pairs) and any(w == 1 for _, w in pairs)
    assert all(s + w < ch07.N_TOKENS for s, w in pairs)  # every pair evicts, late enough
    assert any(s > w for s, w in pairs)
    for sinks, window in pairs:
        held = ch07.engine_positions(sinks, window)
        assert [held_positions(t, sinks, window) for t in range(ch07.N_TOKENS)] == held


def test_check_cells_follow_their_exercise():
    cells = solution_check_cells("07_shrinking_the_cache.ipynb", "ch07")
    for before, cell, _, passed in cells:
        assert all(f"def {name}(" in before or f"class {name}(" in before for name in passed)
        assert "✓" in str(cell.outputs)
    assert [called for _, _, called, _ in cells] == [
        "gqa_attention", "quantize", "held_positions", "predict_bytes", "window_cache",
        "choose_window"]
