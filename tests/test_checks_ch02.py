"""Chapter 02's checkers accept the solutions, let the stubs' NotImplementedError through, and
reject every plausible wrong answer with a message that names the mistake; quickly, and without
touching the caller's random state."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import CheckFailed, ch02
from minikv.engine.cache import Cache

from conftest import solution_check_cells, stub

# --- exercises 1 and 2, tables (tests/test_checks_table.py): what a table cannot state ----------
cache_bytes, kv_work = ch02._bytes, ch02._kv_work


def cache_bytes_mib(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    return cache_bytes(cfg, seq_len, batch_size, bytes_per_value, n_kv_head) / 2**20


def cache_bytes_float(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    return float(cache_bytes(cfg, seq_len, batch_size, bytes_per_value, n_kv_head))


def cache_bytes_numpy(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    heads = cfg.n_head if n_kv_head is None else n_kv_head
    return np.prod([cfg.n_layer, 2, batch_size, heads, seq_len, cfg.head_dim, bytes_per_value],
                   dtype=np.float64)


def cache_bytes_engine(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    dtype = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32}[bytes_per_value]
    return minikv.kv_cache_bytes(cfg, seq_len, batch_size, dtype, n_kv_head)


def cache_bytes_real_off(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    return cache_bytes(cfg, seq_len, batch_size, bytes_per_value, n_kv_head) + (seq_len == 37)


def kv_work_float(prompt_len, new_tokens):  # "/ 2": (25.0, 7.0) for the seed's table
    n = new_tokens
    return (n * prompt_len + n * (n - 1) / 2, prompt_len + n - 1) if n else (0, 0)


def kv_work_half_off(prompt_len, new_tokens):  # 25.5 for 25: int() truncation would let it pass
    naive, cached = kv_work(prompt_len, new_tokens)
    return naive + 0.5, cached


def kv_work_engine(prompt_len, new_tokens):  # asks the engine instead of counting
    model = minikv.GPT(minikv.GPTConfig.preset("tiny"))
    ids = list(range(1, prompt_len + 1))
    return (minikv.generate(model, ids, new_tokens, mode="naive").stats.kv_computed,
            minikv.generate(model, ids, new_tokens, mode="cached").stats.kv_computed)


# --- exercise 3: attention over a cache ----------------------------------------------------------
def cached_attention(q, k, v):
    T, L = q.size(-2), k.size(-2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if T > 1:
        mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def cached_attention_sdpa(q, k, v):  # also right: sdpa with the rectangular mask
    T, L = q.size(-2), k.size(-2)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cached_attention_is_causal(q, k, v):  # the training-time kernel, reused over a cache
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cached_attention_is_causal_for_chunks(q, k, v):  # right for T == 1, top-left for chunks
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.size(-2) > 1)


def cached_attention_mask_only_prefill(q, k, v):  # masks only when nothing is cached
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.size(-2) == k.size(-2))


def cached_attention_sees_not_itself(q, k, v):  # diagonal L - T - 1
    T, L = q.size(-2), k.size(-2)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T - 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def cached_attention_inverted_mask(q, k, v):  # masked_fill where the mask is True
    T, L = q.size(-2), k.size(-2)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def cached_attention_in_place(q, k, v):  # scales k in place: inside the model, the cache's k
    T, L = q.size(-2), k.size(-2)
    k /= math.sqrt(q.size(-1))
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)
    return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), -1) @ v


def cached_attention_last_row(q, k, v):  # the old one-row exercise: one output row whatever T
    weights = torch.softmax(q[..., -1:, :] @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return weights @ v


def cached_attention_heads_last(q, k, v):  # returns (B, T, n_head, head_dim), as after transpose
    return cached_attention(q, k, v).transpose(1, 2)


def cached_attention_float64(q, k, v):  # "more precise", but the model's next layer is fp32
    return cached_attention(q.double(), k.double(), v.double())


def cached_attention_numpy(q, k, v):
    return cached_attention(q, k, v).numpy()


def cached_attention_with_weights(q, k, v):  # (output, weights), as some libraries return
    return cached_attention(q, k, v), None


def cached_attention_engine(q, k, v):  # calls the kernel the exercise asks for
    return minikv.engine.causal_attention(q, k, v)


# --- exercise 4: add the cache yourself ----------------------------------------------------------
class MyKVCache(Cache):
    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx=0):
        return self.keys[layer_idx].shape[2] if len(self.keys) > layer_idx else 0

    def check_fits(self, *args):
        pass

    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, max_length):
        self.keys = [k[:, :, :max_length] for k in self.keys]
        self.values = [v[:, :, :max_length] for v in self.values]


class StubCache(Cache):  # the exercise as students receive it
    def __init__(self):
        self.keys, self.values = [], []

    def get_seq_length(self, layer_idx=0):
        stub()

    def check_fits(self, *args):
        pass

    def update(self, key, value, layer_idx):
        stub()

    def crop(self, max_length):
        stub()


class CacheZeroLength(MyKVCache):  # seed 003's bug: every pass's positions restart at 0
    def get_seq_length(self, layer_idx=0):
        return 0


class CacheCountsLayers(MyKVCache):
    def get_seq_length(self, layer_idx=0):
        return len(self.keys)


class CacheCountsEveryUpdate(MyKVCache):  # adds T at every layer's update
    def __init__(self):
        super().__init__()
        self.length = 0

    def get_seq_length(self, layer_idx=0):
        return self.length

    def update(self, key, value, layer_idx):
        self.length += key.shape[2]
        return super().update(key, value, layer_idx)

    def crop(self, max_length):
        super().crop(max_length)
        self.length = max_length


class CacheCountsPasses(MyKVCache):  # one per pass, however many positions it adds
    def __init__(self):
        super().__init__()
        self.passes = 0

    def get_seq_length(self, layer_idx=0):
        return self.passes

    def update(self, key, value, layer_idx):
        self.passes += layer_idx == 0
        return super().update(key, value, layer_idx)


class CacheReadsHeads(MyKVCache):  # size(1) of (B, n_head, L, head_dim)
    def get_seq_length(self, layer_idx=0):
        return self.keys[0].size(1) if self.keys else 0


class CacheFloatLength(MyKVCache):
    def get_seq_length(self, layer_idx=0):
        return float(super().get_seq_length(layer_idx))


class CacheLengthNoReturn(MyKVCache):  # computes the length, forgets to return it
    def get_seq_length(self, layer_idx=0):
        length = self.keys[layer_idx].shape[2] if self.keys else 0  # noqa: F841


class CacheEmptyCrash(MyKVCache):  # fails before the first update
    def get_seq_length(self, layer_idx=0):
        return self.keys[0].shape[2]


class CacheReturnsNew(MyKVCache):  # stores everything, but attention would see this step only
    def update(self, key, value, layer_idx):
        super().update(key, value, layer_idx)
        return key, value


class CacheCatDim1(MyKVCache):  # concatenates along the heads
    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=1)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=1)
        return self.keys[layer_idx], self.values[layer_idx]


class CacheCatLastDim(MyKVCache):  # concatenates along head_dim
    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=-1)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=-1)
        return self.keys[layer_idx], self.values[layer_idx]


class CacheNewFirst(MyKVCache):  # prepends the new positions
    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([key, self.keys[layer_idx]], dim=2)
            self.values[layer_idx] = torch.cat([value, self.values[layer_idx]], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]


class CacheSwapped(MyKVCache):
    def update(self, key, value, layer_idx):
        keys, values = super().update(key, value, layer_idx)
        return values, keys


class CacheKeysTwice(MyKVCache):
    def update(self, key, value, layer_idx):
        keys, _ = super().update(key, value, layer_idx)
        return keys, keys


class CacheReturnsNothing(MyKVCache):
    def update(self, key, value, layer_idx):
        super().update(key, value, layer_idx)


class CacheIgnoresLayer(MyKVCache):  # one growing tensor for every layer
    def update(self, key, value, layer_idx):
        if not self.keys:
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[-1] = torch.cat([self.keys[-1], key], dim=2)
            self.values[-1] = torch.cat([self.values[-1], value], dim=2)
        return self.keys[-1], self.values[-1]


class CacheFirstUpdateCrash(MyKVCache):  # no case for a layer's first update
    def update(self, key, value, layer_idx):
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]


class CacheNeverCrops(MyKVCache):
    def crop(self, max_length):
        pass


class CacheCropsCounter(MyKVCache):  # crop moves a counter; update appends after the old data
    def __init__(self):
        super().__init__()
        self.length = 0

    def get_seq_length(self, layer_idx=0):
        return self.length

    def update(self, key, value, layer_idx):
        if layer_idx == 0:
            self.length += key.shape[2]
        return super().update(key, value, layer_idx)

    def crop(self, max_length):
        self.length = max_length


class CacheCropsLayer0(MyKVCache):
    def crop(self, max_length):
        self.keys[0] = self.keys[0][:, :, :max_length]
        self.values[0] = self.values[0][:, :, :max_length]


class CacheCropsKeysOnly(MyKVCache):
    def crop(self, max_length):
        self.keys = [k[:, :, :max_length] for k in self.keys]


class CacheCropsLast(MyKVCache):  # keeps the newest positions
    def crop(self, max_length):
        self.keys = [k[:, :, k.shape[2] - max_length:] for k in self.keys]
        self.values = [v[:, :, v.shape[2] - max_length:] for v in self.values]


class CacheCropEmpties(MyKVCache):  # crop as reset
    def crop(self, max_length):
        self.keys, self.values = [], []


class CacheCropOffByOne(MyKVCache):  # "the last kept index is max_length - 1", sliced once more
    def crop(self, max_length):
        super().crop(max(max_length - 1, 0))


class CacheClassLists(Cache):  # the lists as class attributes: every instance shares them
    keys: list = []
    values: list = []
    get_seq_length = MyKVCache.get_seq_length
    check_fits = MyKVCache.check_fits
    update = MyKVCache.update

    def crop(self, max_length):
        self.keys[:] = [k[:, :, :max_length] for k in self.keys]
        self.values[:] = [v[:, :, :max_length] for v in self.values]


class CacheNotACache:  # forgets the base class
    __init__ = MyKVCache.__init__
    get_seq_length = MyKVCache.get_seq_length
    check_fits = MyKVCache.check_fits
    update = MyKVCache.update
    crop = MyKVCache.crop


class CacheOnKVCache(minikv.KVCache):  # the engine's cache, renamed
    def __init__(self):
        super().__init__(n_layer=3, batch_size=2, n_head=5, head_dim=7, max_len=64)


class CacheWrapsEngine(MyKVCache):  # the engine's KVCache inside, built on the first update
    def update(self, key, value, layer_idx):
        if not hasattr(self, "inner"):
            B, nh, _, hs = key.shape
            self.inner = minikv.KVCache(1, B, nh, hs, max_len=64)
        self.inner.update(key, value, 0)
        return super().update(key, value, layer_idx)


# --- what the checkers must say ------------------------------------------------------------------
SOLUTIONS = [
    (ch02.check_cached_attention, (cached_attention,), "cached_attention"),
    (ch02.check_cached_attention, (cached_attention_sdpa,), "cached_attention"),
    (ch02.check_my_kv_cache, (MyKVCache, cached_attention), "MyKVCache"),
]

STUBS = [
    (ch02.check_cached_attention, (stub,)),
    (ch02.check_my_kv_cache, (StubCache, stub)),
    (ch02.check_my_kv_cache, (StubCache, cached_attention)),
    (ch02.check_my_kv_cache, (MyKVCache, stub)),  # the cache done, the attention not yet
]

WRONG = [  # (checker, arguments, a fragment of the message that names the mistake)
    (ch02.check_cache_bytes, (cache_bytes_mib,), "a float"),
    (ch02.check_cache_bytes, (cache_bytes_float,), "a float (even 3686400.0) is refused"),
    (ch02.check_cache_bytes, (cache_bytes_numpy,), "a float (even 3686400.0) is refused"),
    (ch02.check_cache_bytes, (cache_bytes_engine,), "called minikv's own"),
    (ch02.check_cache_bytes, (cache_bytes_real_off,), "hint: compare with KVCache.nbytes"),
    (ch02.check_cache_bytes, (lambda *a: None,), "did you forget to return it?"),
    (ch02.check_kv_work, (kv_work_float,), "25.0 as much as 25.5"),
    (ch02.check_kv_work, (kv_work_half_off,), "got:      (25.5, 7)"),
    (ch02.check_kv_work, (lambda p, n: np.array(kv_work(p, n), dtype=np.float32),),
     "a pair (naive, cached) of two ints"),
    (ch02.check_kv_work, (lambda p, n: kv_work(p, n)[0] - kv_work(p, n)[1],),
     "a pair (naive, cached) of two ints"),
    (ch02.check_kv_work, (lambda p, n: (*kv_work(p, n), 0),), "a pair (naive, cached) of two"),
    (ch02.check_kv_work, (kv_work_engine,), "called minikv's own"),
    (ch02.check_cached_attention, (cached_attention_is_causal,), "is_causal=True"),
    (ch02.check_cached_attention, (cached_attention_is_causal_for_chunks,), "top-left corner"),
    (ch02.check_cached_attention, (cached_attention_mask_only_prefill,), "see their future"),
    (ch02.check_cached_attention, (cached_attention_sees_not_itself,), "its own key included"),
    (ch02.check_cached_attention, (cached_attention_inverted_mask,), "mask inverted"),
    (ch02.check_cached_attention, (cached_attention_in_place,), "changed in place"),
    (ch02.check_cached_attention, (cached_attention_last_row,), "one output row per new query"),
    (ch02.check_cached_attention, (cached_attention_heads_last,), "heads in dim 1"),
    (ch02.check_cached_attention, (cached_attention_float64,), "compute in q's dtype"),
    (ch02.check_cached_attention, (cached_attention_numpy,), "a numpy.ndarray"),
    (ch02.check_cached_attention, (cached_attention_with_weights,), "not a tuple"),
    (ch02.check_cached_attention, (cached_attention_engine,), "called minikv's own"),
    (ch02.check_my_kv_cache, (CacheZeroLength, cached_attention), "position-offset bug"),
    (ch02.check_my_kv_cache, (CacheCountsLayers, cached_attention), "number of layers"),
    (ch02.check_my_kv_cache, (CacheCountsEveryUpdate, cached_attention), "once per layer"),
    (ch02.check_my_kv_cache, (CacheCountsPasses, cached_attention), "counts passes"),
    (ch02.check_my_kv_cache, (CacheReadsHeads, cached_attention), "a wrong dimension"),
    (ch02.check_my_kv_cache, (CacheFloatLength, cached_attention), "return a Python int"),
    (ch02.check_my_kv_cache, (CacheLengthNoReturn, cached_attention), "got:      'None'"),
    (ch02.check_my_kv_cache, (CacheEmptyCrash, cached_attention), "holds 0 positions"),
    (ch02.check_my_kv_cache, (CacheReturnsNew, cached_attention), "only this step's"),
    (ch02.check_my_kv_cache, (CacheCatDim1, cached_attention), "along the wrong dimension"),
    (ch02.check_my_kv_cache, (CacheCatLastDim, cached_attention), "along the wrong dimension"),
    (ch02.check_my_kv_cache, (CacheNewFirst, cached_attention), "new positions came first"),
    (ch02.check_my_kv_cache, (CacheSwapped, cached_attention), "the pair is swapped"),
    (ch02.check_my_kv_cache, (CacheKeysTwice, cached_attention), "the other tensor"),
    (ch02.check_my_kv_cache, (CacheReturnsNothing, cached_attention), "return keys, values"),
    (ch02.check_my_kv_cache, (CacheIgnoresLayer, cached_attention), "self.keys[layer_idx]"),
    (ch02.check_my_kv_cache, (CacheFirstUpdateCrash, cached_attention), "first update of a"),
    (ch02.check_my_kv_cache, (CacheNeverCrops, cached_attention), "grows but never crops"),
    (ch02.check_my_kv_cache, (CacheCropsCounter, cached_attention), "positions crop removed"),
    (ch02.check_my_kv_cache, (CacheCropsLayer0, cached_attention), "every layer's keys and"),
    (ch02.check_my_kv_cache, (CacheCropsKeysOnly, cached_attention), "only the keys"),
    (ch02.check_my_kv_cache, (CacheCropsLast, cached_attention), "kept the LAST"),
    (ch02.check_my_kv_cache, (CacheCropEmpties, cached_attention), "crop emptied the cache"),
    (ch02.check_my_kv_cache, (CacheCropOffByOne, cached_attention), "off by one"),
    (ch02.check_my_kv_cache, (CacheClassLists, cached_attention), "not as class attributes"),
    (ch02.check_my_kv_cache, (CacheNotACache, cached_attention), "subclass minikv.engine"),
    (ch02.check_my_kv_cache, (CacheOnKVCache, cached_attention), "not on KVCache"),
    (ch02.check_my_kv_cache, (CacheWrapsEngine, cached_attention), "called minikv's own"),
    (ch02.check_my_kv_cache, (MyKVCache(), cached_attention), "the class itself"),
    (ch02.check_my_kv_cache, (MyKVCache, ch02._attend), "exercise 3"),
    (ch02.check_my_kv_cache, (MyKVCache, cached_attention_is_causal), "exercise 3"),
]


def _name(x):
    return getattr(x, "__name__", type(x).__name__)


@pytest.mark.parametrize("checker, args, exercise", SOLUTIONS,
                         ids=lambda x: _name(x) if callable(x) else "")
def test_checker_accepts_solution(checker, args, exercise, capsys):
    checker(*args)
    assert capsys.readouterr().out.startswith(f"✓ {exercise}: all ")


@pytest.mark.parametrize("checker, args", STUBS,
                         ids=lambda x: "-".join(map(_name, x)) if isinstance(x, tuple) else "")
def test_stub_raises_not_implemented_through_the_checker(checker, args):
    with pytest.raises(NotImplementedError):
        checker(*args)


@pytest.mark.parametrize("checker, args, fragment", WRONG, ids=lambda x: (
    _name(x[0]) if isinstance(x, tuple) else ""))
def test_checker_names_the_mistake(checker, args, fragment):
    with pytest.raises(CheckFailed) as failure:
        checker(*args)
    message = str(failure.value)
    assert fragment in message, message


@pytest.mark.parametrize("hint, wrong", ch02.ATTENTION_MISTAKES.items(), ids=lambda x: (
    x[23:50] if isinstance(x, str) else ""))
def test_cached_attention_names_every_mistake(hint, wrong):
    with pytest.raises(CheckFailed) as failure:
        ch02.check_cached_attention(wrong)
    if "may not see its own key" in hint:  # a 1-query, 1-key case leaves a row all masked first
        hint = "a query row whose keys are all masked"
    assert f"\n  hint: {hint}" in str(failure.value), str(failure.value)


def test_checkers_leave_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for checker, args, _ in SOLUTIONS:
        checker(*args)
    assert torch.equal(torch.rand(3), expected)


def test_a_learner_drawing_random_numbers_leaves_the_rng_alone():
    def noisy(prompt_len, new_tokens):  # right, but draws from the global generator
        torch.rand(1)
        return kv_work(prompt_len, new_tokens)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ch02.check_kv_work(noisy)
    assert torch.equal(torch.rand(3), expected)


def test_a_replaced_engine_function_is_refused(monkeypatch):
    import minikv.course.checks as checks

    def fake_generate(*args, **kwargs):  # would make generate agree with any answer
        raise AssertionError("never called")
    monkeypatch.setattr(minikv, "generate", fake_generate)
    with pytest.raises(CheckFailed, match="minikv.generate is not the packaged one"):
        checks.fresh("ch02")


def test_check_cells_are_two_lines_after_their_exercise():
    """Each exercise cell of the solution is followed by exactly one check cell, in the shared
    two-line form, which calls the checker on what that cell defines."""
    cells = solution_check_cells("02_kv_cache_guide.ipynb", "ch02")
    for before, _, _, passed in cells:
        assert f" {passed[0]}(" in before
    assert [called for _, _, called, _ in cells] == [
        "cache_bytes", "kv_work", "cached_attention", "my_kv_cache", "predict_attention_pairs",
        "fixed_cache", "choose_kv_heads"]


# --- exercise 5: predict, then measure: attention pairs -------------------------------------------
@pytest.mark.parametrize("wrong, fragment", [
    (lambda: (25, 7), "these are the K/V vectors computed"),
    (lambda: (35, 15), "the count for a 1-token prompt"),
    (lambda: (80, 7), "that is the cached decoder's K/V count"),
    (lambda: (80, 10), "one key per decode step?"),
    (lambda: (135, 28), "a triangle, not a square"),
    (lambda: (80, 31), "the prefill's queries are masked too"),
    (lambda: (116, 28), "N tokens take N passes"),
    (lambda: (80, 36), "no pass scores its query"),
    (lambda: (80, 22), "the prefill scores pairs too"),
    (lambda: (28, 80), "the pair is swapped"),
    (lambda: (80, 80), "a cached decode step has ONE query"),
    (lambda: (960, 336), "you summed the layers"),
    (lambda: (640, 224), "you summed the heads"),
    (lambda: (80, 30), "count pass by pass"),
    (lambda: 108, "a pair of ints"),
    (lambda: (80.0, 28.0), "a pair of ints"),
    (lambda: minikv.generate(minikv.GPT(minikv.GPTConfig.preset("tiny")), [1], 2).stats,
     "called minikv's own"),
])
def test_predict_attention_pairs_names_the_mistake(wrong, fragment):
    with pytest.raises(CheckFailed) as failure:
        ch02.check_predict_attention_pairs(wrong)
    assert fragment in str(failure.value), str(failure.value)


# --- exercise 6: debug a preallocated cache -------------------------------------------------------
def _prealloc(when: str):
    """The notebook's PreallocatedCache, its length moving on at `when` (ch02._Prealloc's bugs)."""
    def init(self, model, max_len):
        ch02._Prealloc.__init__(self, model, max_len, when)
    return type(f"Prealloc_{when}", (ch02._Prealloc,), {"__init__": init})


PreallocatedCache, FixedCache = _prealloc("every"), ch02._Prealloc  # as shipped, and fixed


class FixedCachePerLayer(PreallocatedCache):
    """Also right: a length per layer; the model's positions come from the last layer's."""
    def __init__(self, model, max_len):
        super().__init__(model, max_len)
        self.lengths = [0] * len(self.keys)

    def get_seq_length(self, layer_idx=0):
        return self.lengths[-1]

    def update(self, key, value, layer_idx):
        start = self.lengths[layer_idx]
        end = start + key.shape[2]
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def crop(self, max_length):
        self.lengths = [max_length] * len(self.keys)


class CacheReturnsNewOnly(FixedCache):
    def update(self, key, value, layer_idx):
        super().update(key, value, layer_idx)
        return key, value


class CacheOverEngine(Cache):  # the engine's KVCache inside
    def __init__(self, model, max_len):
        self.inner = minikv.KVCache.for_model(model, max_len=max_len)
        self.keys = self.inner.keys

    def get_seq_length(self, layer_idx=0):
        return self.inner.get_seq_length()

    def check_fits(self, *args):
        pass

    def update(self, key, value, layer_idx):
        return self.inner.update(key, value, layer_idx)

    def crop(self, max_length):
        self.inner.crop(max_length)


@pytest.mark.parametrize("wrong, fragments", [
    (PreallocatedCache, ["pass 1 (a prefill of 5 tokens)", "expected: 5", "got:      10",
                         "the shipped update's behaviour", "the bug hides"]),
    (_prealloc("first"), ["moved on after layer 0's update"]),
    (_prealloc("never"), ["the length never moves"]),
    (CacheReturnsNewOnly, ["returns all of its live ones"]),
    (CacheOverEngine, ["called minikv's own"]),
    (FixedCache(minikv.GPT(minikv.GPTConfig.preset("tiny")), 8), ["the class itself"]),
])
def test_fixed_cache_names_the_mistake(wrong, fragments):
    with pytest.raises(CheckFailed) as failure:
        ch02.check_fixed_cache(wrong)
    for fragment in fragments:
        assert fragment in str(failure.value), str(failure.value)


# --- exercise 7: design: K/V heads ----------------------------------------------------------------
@pytest.mark.parametrize("wrong, fragment", [
    (lambda: 10, "GPTConfig refuses it"),
    (lambda: 12, "must divide 32"),
    (lambda: 16, "you counted only the keys"),
    (lambda: 32, "plain multi-head attention"),
    (lambda: 4, "more K/V heads fit too"),
    (lambda: 1, "more K/V heads fit too"),
    (lambda: 0, "a positive int"),
    (lambda: 8.0, "a positive int"),
])
def test_choose_kv_heads_names_the_mistake(wrong, fragment):
    with pytest.raises(CheckFailed) as failure:
        ch02.check_choose_kv_heads(wrong)
    assert fragment in str(failure.value), str(failure.value)


def test_new_exercises_pass_and_leave_the_random_state_alone(capsys):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ch02.check_predict_attention_pairs(lambda: (80, 28))
    ch02.check_fixed_cache(FixedCache)
    ch02.check_fixed_cache(FixedCachePerLayer)
    ch02.check_choose_kv_heads(lambda: 8)
    assert capsys.readouterr().out.count("✓") == 4
    assert torch.equal(torch.rand(3), expected)


class StubFixedCache(PreallocatedCache):
    def update(self, key, value, layer_idx):
        stub()


@pytest.mark.parametrize("checker, args", [
    (ch02.check_predict_attention_pairs, stub), (ch02.check_fixed_cache, StubFixedCache),
    (ch02.check_choose_kv_heads, stub)])
def test_new_stubs_raise_not_implemented(checker, args):
    with pytest.raises(NotImplementedError):
        checker(args)
