"""Chapter 07's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake: the mistakes a checker writes itself (GQA_MISTAKES, the bytes') are fed to it from its
own data, the rest are listed here; held_positions' table is tested in test_checks_table.py."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import ch07
from minikv.engine import Cache, causal_attention
from minikv.engine.quantized import QuantizedKVCache, quantize

from conftest import assert_mistake_named, assert_right_ways_pass, checker_id, stub

GQA, QUANT, HELD, BYTES, CACHE, CHOOSE = (
    ch07.check_gqa_attention, ch07.check_quantize, ch07.check_held_positions,
    ch07.check_predict_bytes, ch07.check_window_cache, ch07.check_choose_window)
SLOT = 12 * 2 * 8 * 24 * 4  # bytes of one position of the fp32 target's cache


def gqa_attention(q, k, v, diagonal=0, expand=True):
    group = q.size(1) // k.size(1)
    if expand:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
    causal = torch.ones(q.size(-2), q.size(-2), dtype=torch.bool).tril(diagonal)
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def gqa_grouped_view(q, k, v):  # also right: each K/V head broadcast over its group, no copy
    B, nh, T, hs = q.shape
    scores = q.view(B, k.size(1), -1, T, hs) @ k[:, :, None].transpose(-2, -1) / hs ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v[:, :, None]).reshape(B, nh, T, hs)


def quantize_block(x, bits, per="token", n=None, signed=False, rounding=torch.round, clamp=True,
                   tiny=True, dtype=torch.int8):  # the solution; its keywords make mistakes
    qmax = 2 ** (bits - 1) - 1
    dim = {"token": -1, "channel": -2, "tensor": tuple(range(x.dim()))}[per]
    amax = (x if signed else x.abs()).amax(dim=dim, keepdim=True)
    scales = (amax.clamp(min=torch.finfo(x.dtype).tiny) if tiny else amax) / (n or qmax)
    codes = rounding(x / scales)
    return (codes.clamp(-qmax, qmax) if clamp else codes).to(dtype), scales


def dequantize_block(codes, scales):
    return codes.to(scales.dtype) * scales


def quantize_where_zero(x, bits, per="token"):  # also right: scale 1 for a zero vector, no clamp
    amax = x.abs().amax(dim=-1 if per == "token" else -2, keepdim=True)
    scales = torch.where(amax > 0, amax / (2 ** (bits - 1) - 1), torch.ones_like(amax))
    return torch.round(x / scales).long(), scales


def quantize_by_multiplying(x, bits, per="token"):  # also right (a code may differ at a tie)
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax(dim=-1 if per == "token" else -2, keepdim=True).clamp(
        min=torch.finfo(x.dtype).tiny)
    return torch.round(x * (qmax / amax)).to(torch.int16), amax / qmax


def held_positions(t, sinks, window):
    seen = t + 1
    return list(range(seen)) if seen <= sinks + window else (
        list(range(sinks)) + list(range(seen - window, seen)))


def predict_bytes():
    return {"gqa2_int4": 12 * 2 * 2 * (12 + 4) * 50, "mqa_window": 12 * 2 * 1 * 24 * 4 * 20}


class BuggyWindowCache(Cache):
    """The notebook's broken window cache, verbatim: the next token's position is the number of
    slots held, not the number of tokens seen."""

    def __init__(self, model, sinks, window):
        cfg = model.config
        self.batch_size, self.device, self.dtype = 1, model.device, model.dtype
        # empty K/V that the model's are concatenated onto: on its device, in its dtype
        empty = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim, device=self.device, dtype=self.dtype)
        self.keys, self.values = [empty] * cfg.n_layer, [empty] * cfg.n_layer
        self.n_layer, self.n_head, self.head_dim = cfg.n_layer, cfg.kv_heads, cfg.head_dim
        self.sinks, self.window = sinks, window
        self.positions = []   # the absolute position each held slot holds

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
                index = torch.tensor(keep, device=key.device)
                self.keys = [t.index_select(2, index) for t in self.keys]
                self.values = [t.index_select(2, index) for t in self.values]
                self.positions = [self.positions[i] for i in keep]
        return k, v


class WindowCacheFixed(BuggyWindowCache):
    seen, per_layer, v_scale = 0, False, 1.0  # tokens seen; the other two make mistakes

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, key, value, layer_idx):
        self.seen += key.shape[2] * self.per_layer
        k, v = super().update(key, value, layer_idx)
        self.seen += key.shape[2] * (not self.per_layer and layer_idx == self.n_layer - 1)
        return k, v * self.v_scale


class WindowCacheLastPlusOne(BuggyWindowCache):  # also right: the last position + 1
    def get_seq_length(self, layer_idx=0):
        return self.positions[-1] + 1 if self.positions else 0


def choose_window(budget_bytes):  # a few sinks (StreamingLLM's 4), the rest a window
    slots = budget_bytes // SLOT
    return min(4, slots // 4), slots - min(4, slots // 4)


Q, D = quantize_block, dequantize_block
WRONG = {  # checker -> (the learner's function(s), a fragment of the hint)
    GQA: [(lambda q, k, v: gqa_attention(q, k, v, diagonal=-1), "its own key included"),
          (lambda q, k, v: gqa_attention(q, k, v, expand=False), "repeat_interleave on dim 1"),
          (lambda q, k, v: ch07._attend(q.div_(q.size(-1) ** 0.5), k, v, scale=1.0), "in place"),
          (lambda *a: gqa_attention(*(t.double() for t in a)), "compute in q's dtype"),
          (lambda *a: gqa_attention(*a).numpy(), "one torch tensor"),
          (lambda *a: None, "did you forget to return it"),
          (lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True),
           "called torch.nn.functional.scaled_dot_product_attention"),
          (causal_attention, "called minikv's own minikv.engine.model.causal_attention")] + [
          (wrong, hint) for hint, wrong in ch07.GQA_MISTAKES.items()],
    QUANT: [((wrong, D), fragment) for wrong, fragment in [
        (lambda x, b: Q(x, b, per="channel"), "one scale per CHANNEL"),
        (lambda x, b: (Q(x, b)[0], Q(x, b, per="channel")[1].squeeze(-2)), "per CHANNEL (the"),
        (lambda x, b: Q(x, b, per="tensor"), "per tensor"),
        (lambda x, b: Q(x, b, n=2 ** b), "max|x| / 2^bits"),
        (lambda x, b: Q(x, b, n=2 ** (b - 1)), "off by one level"),
        (lambda x, b: Q(x, b, n=2 ** (b - 1), clamp=False, dtype=torch.int16), "unclamped it"),
        (lambda x, b: Q(x, b, n=2 ** b - 1), "max|x| / (2^bits - 1)"),
        (lambda x, b: Q(x, b, n=2 ** (b - 1) - 2), "wastes a level"),
        (lambda x, b: Q(x, b, signed=True), "not the largest MAGNITUDE"),
        (lambda x, b: Q(x, b, rounding=lambda y: y), "truncating"),
        (lambda x, b: Q(x, b, rounding=torch.floor), "floor"),
        (lambda x, b: Q(x, b, tiny=False), "all zeros"),
        (lambda x, b: ((Q(x, b)[0] + 2 ** (b - 1)).to(torch.uint8), Q(x, b)[1]), "stored codes"),
        (lambda x, b: Q(x, b, dtype=torch.float32), "small integers, 1 byte each"),
        (lambda x, b: (Q(x, b)[0], Q(x, b)[1][..., 0]), "keepdim=True"),
        (lambda x, b: (Q(x, b), x.zero_())[0], "x is the model's keys"),
        (lambda x, b: None, "did you forget to return it"),
        (lambda x, b: (Q(x, b)[0], quantize(x, b)[1]), "minikv's own minikv.engine.quantized"),
        (lambda x, b, per="token": Q(x, b), "per-TOKEN scales"),
        (lambda x, b, per="token": (Q(x, b, per)[0], Q(x, b, per)[1].flatten(
            -2 if per == "channel" else -1)), "one scale per channel and head"),
        (lambda x, b, per="token": Q(x, b, per, tiny=per == "token"), "a channel that is all"),
        (lambda x, b, per="token": Q(x, b, per, n=2 ** (b - 1) if per != "token" else None),
         "off by one level")]] + [
        ((Q, lambda c, s: c.to(s.dtype)), "multiply them back by their scales"),
        ((Q, lambda c, s: c.to(s.dtype) / s), "you divided by the scales"),
        ((Q, lambda c, s: c), "dequantized values are real numbers")],
    HELD: [(lambda *a: set(held_positions(*a)), "return a list, in the order the cache holds"),
           (lambda t, s, w: held_positions(t, s, w)[min(s, t + 1):] + list(range(min(s, t + 1))),
            "the right positions in the wrong order"),
           (lambda *a: len(held_positions(*a)), "return a list of ints"),
           (lambda *a: None, "did you forget to return it"),
           (lambda t, s, w: ch07.engine_positions.__wrapped__(s, w, t + 1)[-1],
            "called minikv's own minikv.engine.window.feed")],
    BYTES: [(lambda: {**predict_bytes(), "mqa_window": 46_080.0}, "an int"),
            (lambda: (38_400, 46_080), "a dict with the keys"),
            (lambda: {"gqa2_int4": ch07.measure_bytes()["gqa2_int4"], "mqa_window": 46_080},
             "a prediction is made before the measurement")] + [
            (lambda key=key, w=w: {**predict_bytes(), key: w}, hint)
            for key in ch07.BYTES_KEYS for w, hint in ch07._bytes_mistakes(key)],
    CACHE: [(BuggyWindowCache, "BuggyWindowCache unchanged"),
            (type("PerLayer", (WindowCacheFixed,), {"per_layer": True}), "once per LAYER"),
            (type("NoEviction", (BuggyWindowCache,), {"__init__": lambda self, m, s, w: (
                BuggyWindowCache.__init__(self, m, 0, 10_000))}), "the first `sinks` and"),
            (type("HalvesV", (WindowCacheFixed,), {"v_scale": 0.5}), "before anything is evicted"),
            (type("ByTheEngine", (minikv.SinkWindowCache,), {"__new__": lambda cls, m, s, w: (
                minikv.SinkWindowCache.for_model(m, sinks=s, window=w))}), "called minikv's own"),
            (minikv.SinkWindowCache.__init__, "a Cache subclass")],
    CHOOSE: [(lambda b: (0, b // SLOT), "no sinks"),
             (lambda b: (b // SLOT // 2, b // SLOT - b // SLOT // 2), "too many sinks"),
             (lambda b: (4, b // SLOT - 3), "sinks + window positions after every pass"),
             (lambda b: (4, b // SLOT - 6), "memory wasted"),
             (lambda b: (4, 2 * b // SLOT - 4), "12 layers × K and V"),
             (lambda b: {"sinks": 4, "window": b // SLOT - 4}, "return the pair")],
}
RIGHT = {GQA: [(gqa_attention,), (gqa_grouped_view,)],
         QUANT: [(Q, D), (quantize_where_zero, D), (quantize_by_multiplying, D)],
         HELD: [(held_positions,), (lambda *a: np.array(held_positions(*a)),)],  # numpy ints
         BYTES: [(predict_bytes,)], CACHE: [(WindowCacheFixed,), (WindowCacheLastPlusOne,)],
         CHOOSE: [(choose_window,)]}


STUBS = {QUANT: [(stub, stub), (Q, stub)],  # a stubbed dequantize_block after a written quantize
         CACHE: [(type("Stub", (BuggyWindowCache,), {"get_seq_length": stub}),)]}


@pytest.mark.parametrize("checker", RIGHT, ids=checker_id)
def test_right_ways_pass_leaving_the_random_state_and_a_stub_goes_through(checker, capsys):
    assert_right_ways_pass(checker, RIGHT[checker], STUBS.get(checker, [(stub,)]), capsys)


@pytest.mark.parametrize("checker, wrong, fragment",
                         [(c, w, f) for c, ws in WRONG.items() for w, f in ws], ids=checker_id)
def test_every_mistake_is_named(checker, wrong, fragment):
    assert_mistake_named(checker, wrong, fragment)


# --- the checkers' cases are sound ----------------------------------------------------------------

def test_the_cases_cover_the_edges():
    shapes, quants = ch07.GQA_SHAPES, ch07.quant_cases()
    assert 1 < shapes[0][2] < shapes[0][1] and shapes[0][3] > 1  # tells the mistakes apart
    assert {1, 2, 3, 4} <= {nh // nkv for _, nh, nkv, _, _ in shapes}
    assert any(T == 1 for *_, T, _ in shapes) and any(B > 1 for B, *_ in shapes)
    assert {(8, "token"), (4, "token"), (4, "channel")} <= {(b, per) for _, _, b, per in quants}
    assert all(x.size(-1) != x.size(-2) for _, x, _, _ in quants)  # per channel shows in shape
    assert any((x.abs().amax(-1) == 0).any() for _, x, _, _ in quants)
    assert any((x.amax(-1) < x.abs().amax(-1)).any() for _, x, _, _ in quants)
    assert any(x.dtype == torch.float64 for _, x, _, _ in quants)
    pairs = ch07.WINDOW_PAIRS
    assert any(s == 0 for s, _ in pairs) and any(w == 1 for _, w in pairs)
    assert all(s + w < ch07.N_TOKENS for s, w in pairs) and any(s > w for s, w in pairs)


def test_quantize_reference_is_what_the_quantized_cache_holds():
    """engine_quantized is what QuantizedKVCache stores for the course target's layer-0 keys (the
    layer whose keys no quantization upstream has changed)."""
    model, tok = minikv.load_course_model("target", "cpu")
    ids, keys = torch.tensor([tok.encode(ch07.TEXT)[:20]]), ch07._real_kv()[0]
    for bits in (8, 4):
        cache = QuantizedKVCache.for_model(model, max_len=21, bits=bits)
        with torch.no_grad():
            model(ids, cache=cache)
        one = torch.zeros(1, model.config.kv_heads, 1, model.config.head_dim)
        held, _ = cache.update(one, one, 0)  # dequantized K, layer 0
        codes, scales, dequantized = ch07.engine_quantized(keys, bits)
        torch.testing.assert_close(held[:, :, :20], dequantized, atol=0, rtol=0)
        torch.testing.assert_close(cache.key_scales[0][:, :, :20], scales, atol=0, rtol=0)
        assert codes.abs().max() == 2 ** (bits - 1) - 1
