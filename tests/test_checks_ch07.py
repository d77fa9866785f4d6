"""Chapter 07's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake: the mistakes a checker writes itself (GQA_MISTAKES, the bytes') are fed to it from its
own data, the rest are listed here; held_positions' table is tested in test_checks_table.py."""
import math
import time
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import CheckFailed, ch07
from minikv.engine import causal_attention
from minikv.engine.quantized import QuantizedKVCache, quantize

from conftest import solution_check_cells, stub

GQA, QUANT, HELD, BYTES, CACHE, CHOOSE = (
    ch07.check_gqa_attention, ch07.check_quantize, ch07.check_held_positions,
    ch07.check_predict_bytes, ch07.check_window_cache, ch07.check_choose_window)
SLOT = 12 * 2 * 8 * 24 * 4  # bytes of one position of the fp32 target's cache


def gqa_attention(q, k, v, diagonal=0, expand=True):
    group = q.size(1) // k.size(1)
    if expand:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    causal = torch.ones(q.size(-2), q.size(-2), dtype=torch.bool).tril(diagonal)
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def gqa_grouped_view(q, k, v):  # also right: each K/V head broadcast over its group, no copy
    B, nh, T, hs = q.shape
    scores = q.view(B, k.size(1), -1, T, hs) @ k[:, :, None].transpose(-2, -1) / hs ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v[:, :, None]).reshape(B, nh, T, hs)


def gqa_head_by_head(q, k, v):  # also right: a loop over the query heads
    g = q.size(1) // k.size(1)
    return torch.cat([gqa_attention(q[:, i:i + 1], k[:, i // g:i // g + 1], v[:, i // g:i // g + 1])
                      for i in range(q.size(1))], dim=1)


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


def held_by_simulation(t, sinks, window):  # also right: the cache's bookkeeping, as numpy ints
    held = []
    for p in range(t + 1):
        held.append(p)
        if len(held) > sinks + window:
            held = held[:sinks] + held[len(held) - window:]
    return np.array(held, dtype=np.int64)


def held_set_union(t, sinks, window):  # also right: the sinks written so far and the window
    return sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))


def held_by_the_engine(t, sinks, window):
    model = minikv.GPT(minikv.GPTConfig.preset("tiny", n_layer=1)).eval()
    cache = minikv.SinkWindowCache.for_model(model, sinks=sinks, window=window)
    minikv.engine.window.feed(model, [1] * (t + 1), cache)
    return cache.positions


def predict_bytes():
    return {"gqa2_int4": 12 * 2 * 2 * (12 + 4) * 50, "mqa_window": 12 * 2 * 1 * 24 * 4 * 20}


class WindowCacheFixed(ch07.BuggyWindowCache):
    seen = 0  # tokens seen: the next token's position

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, key, value, layer_idx):
        out = super().update(key, value, layer_idx)
        self.seen += key.shape[2] * (layer_idx == self.n_layer - 1)
        return out


class WindowCacheLastPlusOne(ch07.BuggyWindowCache):  # also right: the last position + 1
    def get_seq_length(self, layer_idx=0):
        return self.positions[-1] + 1 if self.positions else 0


class WindowCacheCountsPerLayer(WindowCacheFixed):  # counts a pass in every layer
    def update(self, key, value, layer_idx):
        self.seen += key.shape[2]
        return ch07.BuggyWindowCache.update(self, key, value, layer_idx)


class WindowCacheNoEviction(ch07.BuggyWindowCache):
    def __init__(self, model, sinks, window):
        super().__init__(model, 0, 10_000)


class WindowCacheWrongFirstPasses(WindowCacheFixed):
    def update(self, key, value, layer_idx):
        k, v = super().update(key, value, layer_idx)
        return k, v * 0.5


class WindowCacheByTheEngine(minikv.SinkWindowCache):
    def __init__(self, model, sinks, window):
        cfg = model.config
        super().__init__(cfg.n_layer, cfg.kv_heads, cfg.head_dim, sinks, window,
                         block_size=cfg.block_size)


def choose_window(budget_bytes):  # a few sinks (StreamingLLM's 4), the rest a window
    slots = budget_bytes // SLOT
    return min(4, slots // 4), slots - min(4, slots // 4)


Q, D = quantize_block, dequantize_block
# (checker, the learner's functions, a fragment of the hint)
WRONG = [
    (GQA, lambda q, k, v: gqa_attention(q, k, v, diagonal=-1), "its own key included"),
    (GQA, lambda q, k, v: gqa_attention(q, k, v, expand=False), "repeat_interleave on dim 1"),
    (GQA, lambda q, k, v: ch07._attend(q.div_(math.sqrt(q.size(-1))), k, v, scale=1.0),
     "changed in place"),
    (GQA, lambda q, k, v: gqa_attention(q.double(), k.double(), v.double()),
     "compute in q's dtype"),
    (GQA, lambda q, k, v: gqa_attention(q, k, v).numpy(), "one torch tensor"),
    (GQA, lambda q, k, v: None, "did you forget to return it"),
    (GQA, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
     "called torch.nn.functional.scaled_dot_product_attention"),
    (GQA, causal_attention, "called minikv's own minikv.engine.model.causal_attention"),
    (QUANT, (lambda x, b: Q(x, b, per="channel"), D), "one scale per CHANNEL"),
    (QUANT, (lambda x, b: (Q(x, b)[0], Q(x, b, per="channel")[1].squeeze(-2)), D),
     "one scale per CHANNEL"),
    (QUANT, (lambda x, b: Q(x, b, per="tensor"), D), "per tensor"),
    (QUANT, (lambda x, b: Q(x, b, n=2 ** b), D), "max|x| / 2^bits"),
    (QUANT, (lambda x, b: Q(x, b, n=2 ** (b - 1)), D), "off by one level"),
    (QUANT, (lambda x, b: Q(x, b, n=2 ** (b - 1), clamp=False, dtype=torch.int16), D),
     "unclamped it overflows"),
    (QUANT, (lambda x, b: Q(x, b, n=2 ** b - 1), D), "max|x| / (2^bits - 1)"),
    (QUANT, (lambda x, b: Q(x, b, n=2 ** (b - 1) - 2), D), "wastes a level"),
    (QUANT, (lambda x, b: Q(x, b, signed=True), D), "not the largest MAGNITUDE"),
    (QUANT, (lambda x, b: Q(x, b, rounding=lambda y: y), D), "truncating"),
    (QUANT, (lambda x, b: Q(x, b, rounding=torch.floor), D), "floor"),
    (QUANT, (lambda x, b: Q(x, b, tiny=False), D), "all zeros"),
    (QUANT, (lambda x, b: ((Q(x, b)[0] + 2 ** (b - 1)).to(torch.uint8), Q(x, b)[1]), D),
     "the engine's stored codes"),
    (QUANT, (lambda x, b: Q(x, b, dtype=torch.float32), D), "integer dtype"),
    (QUANT, (lambda x, b: (Q(x, b)[0], Q(x, b)[1][..., 0]), D), "keepdim=True"),
    (QUANT, (lambda x, b: (Q(x, b), x.zero_())[0], D), "x changed in place"),
    (QUANT, (lambda x, b: None, D), "did you forget to return it"),
    (QUANT, (lambda x, b: (Q(x, b)[0], quantize(x, b)[1]), D),
     "called minikv's own minikv.engine.quantized.quantize"),
    (QUANT, (Q, lambda c, s: c.to(s.dtype)), "multiply them back by their scales"),
    (QUANT, (Q, lambda c, s: c.to(s.dtype) / s), "you divided by the scales"),
    (QUANT, (Q, lambda c, s: c), "dequantized values are real numbers"),
    (QUANT, (lambda x, b, per="token": Q(x, b), D), "per-TOKEN scales"),
    (QUANT, (lambda x, b, per="token": (Q(x, b, per)[0],
                                        Q(x, b, per)[1].flatten(-2 if per == "channel" else -1)),
             D), "one scale per channel and head"),
    (QUANT, (lambda x, b, per="token": Q(x, b, per, tiny=per == "token"), D),
     "a channel that is all zeros"),
    (QUANT, (lambda x, b, per="token": Q(x, b, per, n=2 ** (b - 1) if per != "token" else None),
             D), "off by one level"),
    (HELD, lambda *a: set(held_positions(*a)), "return a list, in the order the cache holds them"),
    (HELD, lambda t, s, w: held_positions(t, s, w)[min(s, t + 1):] + list(range(min(s, t + 1))),
     "the right positions in the wrong order"),
    (HELD, lambda *a: len(held_positions(*a)), "return a list of ints"),
    (HELD, lambda *a: None, "did you forget to return it"),
    (HELD, held_by_the_engine, "called minikv's own minikv.engine.window.feed"),
    (BYTES, lambda: {**predict_bytes(), "mqa_window": 46_080.0}, "an int"),
    (BYTES, lambda: (38_400, 46_080), "a dict with the keys"),
    (BYTES, lambda: {"gqa2_int4": ch07.measure_bytes()["gqa2_int4"], "mqa_window": 46_080},
     "a prediction is made before the measurement"),
    (CACHE, ch07.BuggyWindowCache, "BuggyWindowCache unchanged"),
    (CACHE, WindowCacheCountsPerLayer, "once per LAYER"),
    (CACHE, WindowCacheNoEviction, "the first `sinks` and the last"),
    (CACHE, WindowCacheWrongFirstPasses, "wrong before anything is evicted"),
    (CACHE, WindowCacheByTheEngine, "called minikv's own"),
    (CACHE, minikv.SinkWindowCache.__init__, "a Cache subclass"),
    (CHOOSE, lambda b: (0, b // SLOT), "no sinks"),
    (CHOOSE, lambda b: (b // SLOT // 2, b // SLOT - b // SLOT // 2), "too many sinks"),
    (CHOOSE, lambda b: (4, b // SLOT - 3), "sinks + window positions after every pass"),
    (CHOOSE, lambda b: (4, b // SLOT - 6), "memory wasted"),
    (CHOOSE, lambda b: (4, 2 * b // SLOT - 4), "12 layers × K and V"),
    (CHOOSE, lambda b: {"sinks": 4, "window": b // SLOT - 4}, "return the pair"),
] + [(GQA, wrong, hint) for mistakes in (ch07.GQA_MISTAKES, ch07.GQA_SHAPE_MISTAKES)
      for hint, wrong in mistakes.items()] + [
    (BYTES, lambda key=key, w=w: {**predict_bytes(), key: w}, hint)
    for key in ch07.BYTES_KEYS for w, hint in ch07._bytes_mistakes(key)]
RIGHT = {GQA: [(gqa_attention,), (gqa_grouped_view,), (gqa_head_by_head,)],
         QUANT: [(Q, D), (quantize_where_zero, D), (quantize_by_multiplying, D)],
         HELD: [(held_positions,), (held_by_simulation,), (held_set_union,)],
         BYTES: [(predict_bytes,)], CACHE: [(WindowCacheFixed,), (WindowCacheLastPlusOne,)],
         CHOOSE: [(choose_window,)]}


def _id(value):
    if isinstance(value, tuple):
        return "+".join(getattr(f, "__name__", "?") for f in value)
    return value[:40] if isinstance(value, str) else getattr(value, "__name__", None)


@pytest.mark.parametrize("checker, args", [(c, a) for c, ways in RIGHT.items() for a in ways],
                         ids=_id)
def test_right_answers_pass(checker, args, capsys):
    checker(*args)
    assert capsys.readouterr().out.count("✓ ") == 1


STUBS = {QUANT: [(stub, stub), (Q, stub)],  # a stubbed dequantize_block after a written quantize
         CACHE: [(type("Stub", (ch07.BuggyWindowCache,), {"get_seq_length": stub}),)]}


@pytest.mark.parametrize("checker", RIGHT, ids=_id)
def test_a_stub_goes_through(checker):
    for args in STUBS.get(checker, [(stub,)]):
        with pytest.raises(NotImplementedError):
            checker(*args)


@pytest.mark.parametrize("checker, wrong, fragment", WRONG, ids=_id)
def test_every_mistake_is_named(checker, wrong, fragment):
    with pytest.raises(CheckFailed) as info:
        checker(*wrong if isinstance(wrong, tuple) else (wrong,))
    assert fragment in str(info.value), str(info.value)


def test_checkers_leave_the_random_state_alone_and_are_fast():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, ways in RIGHT.items():
        start = time.perf_counter()
        checker(*ways[0])
        assert time.perf_counter() - start < 5, checker.__name__
    assert torch.equal(before, torch.random.get_rng_state())


# --- the checkers' cases are sound ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["target-gqa2", "target-mqa"])
def test_a_grouped_model_attends_as_repeat_interleave_says(name):
    """The course's grouped models give other logits with the K/V heads tiled (i % n_kv_head)."""
    model, tok = minikv.load_course_model(name, "cpu")
    ids = torch.tensor([tok.encode(ch07.TEXT)])
    with torch.no_grad():
        tiled = model(ids, attention=ch07._attend) - model(ids, attention=partial(ch07._attend,
                                                                              tile=True))
    assert model.config.kv_heads < model.config.n_head
    assert model.config.kv_heads == 1 or tiled.abs().max() > 1e-2


def test_the_cases_cover_the_edges():
    shapes, quants = ch07.GQA_SHAPES, ch07.quant_cases()
    assert 1 < shapes[0][2] < shapes[0][1] and shapes[0][3] > 1  # tells the mistakes apart
    assert {1, 2, 3, 4} <= {nh // nkv for _, nh, nkv, _, _ in shapes}
    assert any(T == 1 for *_, T, _ in shapes) and any(B > 1 for B, *_ in shapes)
    assert {8, 4} == {bits for *_, bits in quants}
    assert all(x.size(-1) != x.size(-2) for _, x, _ in quants)  # per channel shows in the shape
    assert any((x.abs().amax(-1) == 0).any() for _, x, _ in quants)
    assert any((x.amax(-1) < x.abs().amax(-1)).any() for _, x, _ in quants)
    assert any(x.dtype == torch.float64 for _, x, _ in quants)
    pairs = ch07.WINDOW_PAIRS
    assert any(s == 0 for s, _ in pairs) and any(w == 1 for _, w in pairs)
    assert all(s + w < ch07.N_TOKENS for s, w in pairs) and any(s > w for s, w in pairs)
    for sinks, window in pairs:  # the reference is the formula
        assert [held_positions(t, sinks, window) for t in range(ch07.N_TOKENS)] == \
            ch07.engine_positions(sinks, window)
    losses = {s: ch07.window_loss(s, 16 - s) for s in (0, 4, 8)}  # no sinks is clearly worst
    assert losses[0] > 1.05 * losses[4] and losses[8] > losses[4]


def test_quantize_reference_is_what_the_quantized_cache_holds():
    """engine_quantized is what QuantizedKVCache stores for the course target's layer-0 keys (the
    layer whose keys no quantization upstream has changed)."""
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


def test_check_cells_follow_their_exercise():
    cells = solution_check_cells("07_shrinking_the_cache.ipynb", "ch07")
    for before, cell, _, passed in cells:
        assert all(f"def {name}(" in before or f"class {name}(" in before for name in passed)
        assert "✓" in str(cell.outputs)
    assert [called for _, _, called, _ in cells] == [
        "gqa_attention", "quantize", "held_positions", "predict_bytes", "window_cache",
        "choose_window"]
