"""Chapter 02's checkers that are code accept the solutions, let a stub's NotImplementedError
through and name every plausible mistake, leaving the caller's random state alone. The tables
(cache_bytes, kv_work) are tested from their own mistakes in test_checks_table.py; here, only what
a table cannot state (wrong types, the engine called), then the stateful exercises' mutants."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.course.checks import CheckFailed, ch02
from minikv.engine.cache import Cache

from conftest import stub

cache_bytes, kv_work = ch02._bytes, ch02._kv_work
BYTES, WORK, ATTENTION, CACHE, PAIRS, FIXED, HEADS = (
    ch02.check_cache_bytes, ch02.check_kv_work, ch02.check_cached_attention,
    ch02.check_my_kv_cache, ch02.check_predict_attention_pairs, ch02.check_fixed_cache,
    ch02.check_choose_kv_heads)


def rectangle(q, k):  # new query i of T sees keys 0 .. L - T + i
    return torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(k.size(-2) - q.size(-2))


def cached_attention(q, k, v, fill=lambda mask: ~mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(fill(rectangle(q, k)), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


# --- exercise 4: a right MyKVCache, and its mutants (a method or two replaced) -------------------
def crops(keep):
    """A crop keeping keep(t, max_length) of every layer's keys and values."""
    def crop(self, max_length):
        self.keys, self.values = ([keep(t, max_length) for t in ts]
                                  for ts in (self.keys, self.values))
    return crop


class MyKVCache(Cache):
    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx=0):
        return self.keys[layer_idx].shape[2] if len(self.keys) > layer_idx else 0

    def check_fits(self, *args):
        pass

    def cat(self, cached, new):
        return torch.cat([cached, new], dim=2)

    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = self.cat(self.keys[layer_idx], key)
            self.values[layer_idx] = self.cat(self.values[layer_idx], value)
        return self.keys[layer_idx], self.values[layer_idx]

    crop = crops(lambda t, n: t[:, :, :n])


class Counted(MyKVCache):  # a length that update moves on by adds(layer_idx, T)
    length = 0

    def get_seq_length(self, layer_idx=0):
        return self.length

    def update(self, key, value, layer_idx):
        self.length += self.adds(layer_idx, key.shape[2])
        return super().update(key, value, layer_idx)


def mutant(base=MyKVCache, **methods):
    return type("Mutant", (base,), methods)


StubCache = mutant(get_seq_length=stub, update=stub, crop=stub)
update = MyKVCache.update
CACHE_MUTANTS = [  # (a wrong MyKVCache, a fragment of the message that names the mistake)
    (mutant(get_seq_length=lambda s, i=0: 0), "position-offset bug"),
    (mutant(get_seq_length=lambda s, i=0: len(s.keys)), "number of layers"),
    (mutant(get_seq_length=lambda s, i=0: sum(k.shape[2] for k in s.keys)), "once per layer"),
    (mutant(Counted, adds=lambda s, i, T: i == 0), "counts passes"),
    (mutant(get_seq_length=lambda s, i=0: s.keys[0].size(1) if s.keys else 0), "wrong dimension"),
    (mutant(get_seq_length=lambda s, i=0: float(MyKVCache.get_seq_length(s))), "a Python int"),
    (mutant(get_seq_length=lambda s, i=0: None), "got:      'None'"),
    (mutant(get_seq_length=lambda s, i=0: s.keys[0].shape[2]), "holds 0 positions"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, i) and (k, v)), "only this step's"),
    (mutant(cat=lambda s, old, new: torch.cat([old, new], dim=1)), "along the wrong dimension"),
    (mutant(cat=lambda s, old, new: torch.cat([old, new], dim=-1)), "along the wrong dimension"),
    (mutant(cat=lambda s, old, new: torch.cat([new, old], dim=2)), "new positions came first"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, i)[::-1]), "the pair is swapped"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, i)[:1] * 2), "the other tensor"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, i) and None), "return keys, values"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, 0)), "self.keys[layer_idx]"),
    (mutant(update=lambda s, k, v, i: update(s, k, v, i) if s.keys[i:] else s.keys[i]),
     "first update of a"),
    (mutant(crop=lambda s, n: None), "grows but never crops"),
    (mutant(Counted, adds=lambda s, i, T: T * (i == 0), crop=lambda s, n: setattr(s, "length", n)),
     "positions crop removed"),
    (mutant(crop=lambda s, n: [ts.__setitem__(0, ts[0][:, :, :n]) for ts in (s.keys, s.values)]
            and None), "every layer's keys and"),  # crops layer 0 only
    (mutant(crop=lambda s, n: setattr(s, "keys", [k[:, :, :n] for k in s.keys])), "only the keys"),
    (mutant(crop=crops(lambda t, n: t[:, :, t.shape[2] - n:])), "kept the LAST"),
    (mutant(crop=lambda s, n: MyKVCache.__init__(s)), "crop emptied the cache"),
    (mutant(crop=crops(lambda t, n: t[:, :, :max(n - 1, 0)])), "off by one"),
    (mutant(keys=[], values=[], __init__=lambda s: None), "not as class attributes"),
    (type("NotACache", (), {}), "subclass minikv.engine"),
    (mutant(minikv.KVCache), "not on KVCache"),
    (mutant(__init__=lambda s: MyKVCache.__init__(s) or minikv.KVCache(1, 1, 1, 1, 1) and None),
     "called minikv's own"),
    (MyKVCache(), "the class itself"),
]

# --- exercise 6: FixedCache, right (as ch02._Prealloc simulates it, or a length per layer) -------
FixedCache = ch02._Prealloc


def prealloc(when: str):
    """The notebook's PreallocatedCache, its length moving on at `when` (ch02._Prealloc's bugs)."""
    return mutant(FixedCache, __init__=lambda s, m, n: FixedCache.__init__(s, m, n, when))


class FixedCachePerLayer(prealloc("every")):  # also right: a length per layer, the last's read
    def __init__(self, model, max_len):
        super().__init__(model, max_len)
        self.lengths = [0] * len(self.keys)

    def get_seq_length(self, layer_idx=0):
        return self.lengths[-1]

    def update(self, key, value, layer_idx):
        self.length = self.lengths[layer_idx]
        self.lengths[layer_idx] += key.shape[2]
        return super().update(key, value, layer_idx)

    def crop(self, max_length):
        self.lengths = [max_length] * len(self.keys)


SOLUTIONS = [  # (checker, arguments, what its ✓ line starts with)
    (ATTENTION, (cached_attention,), "cached_attention: all 10"),
    (ATTENTION, (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, rectangle(q, k)),),
     "cached_attention: all 10"),
    (CACHE, (MyKVCache, cached_attention), "MyKVCache: all 16"),
    (PAIRS, (lambda: (80, 28),), "predict_attention_pairs: as counted, 80"),
    (FIXED, (FixedCache,), "FixedCache: all 4"),
    (FIXED, (FixedCachePerLayer,), "FixedCache: all 4"),
    (HEADS, (lambda budget=40 * 2**30: ch02._most_heads(budget),), "choose_kv_heads: 8 K/V heads"),
    (WORK, (lambda p, n: (torch.rand(1), kv_work(p, n))[1],), "kv_work: all 9"),  # draws
]

STUBS = [(ATTENTION, (stub,)), (CACHE, (StubCache, stub)), (CACHE, (StubCache, cached_attention)),
         (CACHE, (MyKVCache, stub)), (PAIRS, (stub,)), (FIXED, (mutant(FixedCache, update=stub),)),
         (HEADS, (stub,))]


def answers(checker, *pairs):  # (checker, (a function returning the answer,), fragment)
    return [(checker, (lambda a=answer: a,), fragment) for answer, fragment in pairs]


WRONG = [  # (checker, arguments, a fragment of the message that names the mistake)
    (BYTES, (lambda *a: cache_bytes(*a) / 2**20,), "a float"),
    (BYTES, (lambda *a: float(cache_bytes(*a)),), "a float (even 3686400.0) is refused"),
    (BYTES, (lambda *a: np.float64(cache_bytes(*a)),), "a float (even 3686400.0) is refused"),
    (BYTES, (lambda cfg, s, b, nb, kvh: minikv.kv_cache_bytes(cfg, s, b, torch.float16, kvh),),
     "called minikv's own"),
    (BYTES, (lambda *a: cache_bytes(*a) + (a[1] == 37),), "hint: compare with KVCache.nbytes"),
    (BYTES, (lambda *a: None,), "did you forget to return it?"),
    (WORK, (lambda p, n: (n * p + n * (n - 1) / 2, p + n - 1) if n else (0, 0),),
     "25.0 as much as 25.5"),
    (WORK, (lambda p, n: (kv_work(p, n)[0] + 0.5, kv_work(p, n)[1]),), "got:      (25.5, 7)"),
    (WORK, (lambda p, n: np.array(kv_work(p, n), dtype=np.float32),), "a pair (naive, cached)"),
    (WORK, (lambda p, n: kv_work(p, n)[0] - kv_work(p, n)[1],), "a pair (naive, cached)"),
    (WORK, (lambda p, n: (*kv_work(p, n), 0),), "a pair (naive, cached) of two"),
    (WORK, (lambda p, n: minikv.generate(minikv.GPT(minikv.GPTConfig.preset("tiny")), [1] * p,
                                         n).stats.kv_computed,), "called minikv's own"),
    (ATTENTION, (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),),
     "is_causal=True"),
    (ATTENTION, (lambda q, k, v: cached_attention(q, k, v, fill=lambda mask: mask),),
     "mask inverted"),
    (ATTENTION, (lambda q, k, v: cached_attention(q, k.mul_(1.0001), v),), "changed in place"),
    (ATTENTION, (lambda q, k, v: cached_attention(q[..., -1:, :], k, v),),
     "one output row per new query"),
    (ATTENTION, (lambda q, k, v: cached_attention(q, k, v).transpose(1, 2),), "heads in dim 1"),
    (ATTENTION, (lambda q, k, v: cached_attention(q.double(), k.double(), v.double()),),
     "compute in q's dtype"),
    (ATTENTION, (lambda q, k, v: cached_attention(q, k, v).numpy(),), "a numpy.ndarray"),
    (ATTENTION, (lambda q, k, v: (cached_attention(q, k, v), None),), "not a tuple"),
    (ATTENTION, (minikv.engine.causal_attention,), "called minikv's own"),
    *[(CACHE, (wrong, cached_attention), fragment) for wrong, fragment in CACHE_MUTANTS],
    (CACHE, (MyKVCache, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
     "exercise 3"),
    *answers(PAIRS, ((25, 7), "these are the K/V vectors computed"),
             ((35, 15), "the count for a 1-token prompt"),
             ((80, 7), "that is the cached decoder's K/V count"),
             ((80, 10), "one key per decode step?"), ((135, 28), "a triangle, not a square"),
             ((80, 31), "the prefill's queries are masked too"),
             ((116, 28), "N tokens take N passes"), ((80, 36), "no pass scores its query"),
             ((80, 22), "the prefill scores pairs too"), ((28, 80), "the pair is swapped"),
             ((80, 80), "a cached decode step has ONE query"),
             ((960, 336), "you summed the layers"), ((640, 224), "you summed the heads"),
             ((80, 30), "count pass by pass"), (108, "a pair of ints"),
             ((80.0, 28.0), "a pair of ints")),
    (PAIRS, (lambda: minikv.generate(minikv.GPT(minikv.GPTConfig.preset("tiny")), [1], 2).stats,),
     "called minikv's own"),
    (FIXED, (prealloc("every"),),
     "(a prefill of 5 tokens): get_seq_length() after it\n  expected: 5\n  got:      10\n  "
     "hint: this is the shipped update's behaviour"),
    (FIXED, (prealloc("first"),), "moved on after layer 0's update"),
    (FIXED, (prealloc("never"),), "the length never moves"),
    (FIXED, (mutant(FixedCache, update=lambda s, k, v, i: FixedCache.update(s, k, v, i)
                    and (k, v)),), "returns all of its live ones"),
    (FIXED, (mutant(FixedCache, crop=lambda s, n: minikv.KVCache.crop(s, n)),),
     "called minikv's own"),
    (FIXED, (FixedCache(minikv.GPT(minikv.GPTConfig.preset("tiny")), 8),), "the class itself"),
    *answers(HEADS, (10, "GPTConfig refuses it"), (12, "must divide 32"),
             (16, "you counted only the keys"), (32, "plain multi-head attention"),
             (4, "more K/V heads fit too"), (1, "more K/V heads fit too"),
             (0, "a positive int"), (8.0, "a positive int")),
    (HEADS, (lambda *budget: 8,), "choose from the `budget` argument"),
]


def _id(x):
    return getattr(x, "__name__", "") if callable(x) else ""


@pytest.mark.parametrize("checker, args, passed", SOLUTIONS, ids=_id)
def test_the_solutions_pass_and_the_random_state_stays(checker, args, passed, capsys):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checker(*args)
    assert capsys.readouterr().out.startswith(f"✓ {passed}")
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("checker, args", STUBS, ids=_id)
def test_a_stub_goes_through(checker, args):
    with pytest.raises(NotImplementedError):
        checker(*args)


@pytest.mark.parametrize("checker, args, fragment", WRONG, ids=_id)
def test_every_mistake_is_named(checker, args, fragment):
    with pytest.raises(CheckFailed) as failure:
        checker(*args)
    assert fragment in str(failure.value), str(failure.value)


@pytest.mark.parametrize("hint, wrong", ch02.ATTENTION_MISTAKES.items(), ids=lambda x: (
    x[23:50] if isinstance(x, str) else ""))
def test_cached_attention_names_every_mistake(hint, wrong):
    with pytest.raises(CheckFailed) as failure:
        ATTENTION(wrong)
    if "may not see its own key" in hint:  # a 1-query, 1-key case leaves a row all masked first
        hint = "a query row whose keys are all masked"
    assert f"\n  hint: {hint}" in str(failure.value), str(failure.value)
