"""Checkers for chapter 02 (seed 003, the KV-cache visual guide), compared with the engine at run
time: cache_bytes and kv_work (tables), cached_attention, MyKVCache (driven directly, then in the
model against `generate`, with rollbacks), predict_attention_pairs, FixedCache and choose_kv_heads.
Every checker leaves the caller's random state alone."""
from __future__ import annotations

import math

import torch

from ...engine import (
    GPT,
    Cache,
    GPTConfig,
    KVCache,
    KVCounter,
    causal_attention,
    generate,
    kv_cache_bytes,
)
from ..checkpoint import load_course_model
from . import (
    CheckFailed,
    Exercise,
    as_int,
    call_hinted,
    diagnose,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    integer,
    ints,
    kind,
    passed,
    prediction,
    same_cache_prefix,
    tiny_model,
)


def _call(name: str, case: str, fn, *args, hint="your code raised on this input", **kw):
    return call_hinted(name, case, hint if callable(hint) else (lambda e: hint), fn, *args, **kw)


# --- exercise 1: cache bytes ----------------------------------------------------------------------

def _bytes(cfg, s, b, nb, kvh):
    """The right count, in the learner's form (the reference calls kv_cache_bytes)."""
    return cfg.n_layer * 2 * b * (cfg.n_head if kvh is None else kvh) * s * cfg.head_dim * nb


_TINY_REAL = tiny_model(0)  # its fp32 cache holding 37 positions is the last case


def _real_bytes(cfg, s, b, nb, kvh):
    if cfg is _TINY_REAL.config:  # what a real cache holds
        cache = KVCache.for_model(_TINY_REAL, max_len=64)
        with torch.no_grad():
            _TINY_REAL(torch.arange(1, s + 1)[None], cache=cache)
        return cache.nbytes
    dtype = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32}[nb]
    return kv_cache_bytes(cfg, s, b, dtype, n_kv_head=kvh)


_GPT2, _LLAMA = GPTConfig.preset("gpt2"), GPTConfig(vocab_size=32000, block_size=4096, n_layer=32,
                                                    n_head=32, n_embd=4096)
CACHE_BYTES = Exercise(
    "cache_bytes", cases=[  # cfg, seq_len, batch_size, bytes_per_value, n_kv_head
        (_GPT2, 100, 1, 2, None), (_GPT2, 100, 3, 4, None), (_GPT2, 1024, 1, 2, None),
        (_GPT2, 0, 1, 2, None), (_GPT2, 100, 1, 2, 4), (_LLAMA, 4096, 1, 2, 8),
        (_LLAMA, 4096, 8, 1, 8), (_LLAMA, 1, 1, 2, 1),
        (GPTConfig.preset("target"), 256, 2, 4, None), (_TINY_REAL.config, 37, 1, 4, None)],
    describe=lambda cfg, s, b, nb, kvh: "the tiny model's real cache holding 37 positions (fp32)"
    if cfg is _TINY_REAL.config else f"n_layer={cfg.n_layer}, n_head={cfg.n_head}, head_dim="
    f"{cfg.head_dim}, seq_len={s}, batch_size={b}, bytes_per_value={nb}, n_kv_head={kvh}",
    reference=_real_bytes,
    returns=integer(float_hint="a number of bytes is an int: a float (even 3686400.0) is refused; "
                               "use integer arithmetic and do not convert to MB or MiB"),
    mistakes={
        "this is what you get when you count only the keys (or only the values): the cache "
        "holds both, so x 2": lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, kvh) // 2,
        "this is what you get when you ignore n_kv_head: with grouped-query attention only "
        "n_kv_head K/V heads are cached, not n_head":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, None),
        "this is what you get when you use the group size n_head // n_kv_head: n_kv_head is "
        "itself the number of cached K/V heads":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, cfg.n_head // kvh if kvh else None),
        "this is what you get when you forget batch_size: every sequence has its own cache":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, 1, nb, kvh),
        "this is what you get when you forget the layers: every layer caches its own K and V":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, kvh) // cfg.n_layer,
        "this is what you get when you count values, not bytes: multiply by bytes_per_value":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, 1, kvh),
        "this is what you get when you count bits: the answer is in bytes":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, kvh) * 8,
        "this is what you get when you multiply by n_embd AND the heads: n_embd = n_head x "
        "head_dim already counts every head":
            lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, kvh) * cfg.n_head},
    otherwise=lambda answers: "compare with KVCache.nbytes" if all(  # only the real cache wrong
        got == _real_bytes(*case) for case, got in answers if case[0] is not _TINY_REAL.config
    ) else (
        "count what the cache holds: in every layer, for every sequence of the batch and every "
        "cached position, a key and a value per cached head, each head_dim numbers of "
        "bytes_per_value bytes"),
    forbid=(kv_cache_bytes,), raised="your code raised on this input", solution=_bytes)
check_cache_bytes = CACHE_BYTES.check


# --- exercise 2: K/V work with and without a cache ------------------------------------------------

def _kv_work(p, n):
    return (n * p + n * (n - 1) // 2, p + n - 1) if n else (0, 0)


def _kv_work_measured(p, n):
    """The K/V vectors the engine counts (stats.kv_computed), naive and cached."""
    return tuple(generate(_TINY_REAL, list(range(1, p + 1)), n, mode=mode).stats.kv_computed
                 for mode in ("naive", "cached"))


KV_WORK = Exercise(  # each mistake as a student would write it, without a case for new_tokens = 0
    "kv_work", cases=[(3, 5), (1, 4), (1, 1), (4, 0), (1, 10), (6, 3), (2, 12), (10, 1), (5, 2)],
    describe=lambda p, n: f"prompt_len={p}, new_tokens={n}", reference=_kv_work_measured,
    returns=ints(2, "return a pair (naive, cached) of two ints",
                 float_hint="K/V vectors are counted in ints: a float is refused, 25.0 as much as "
                            "25.5 (int() would turn 25.5 into 25); use // for the halves"),
    mistakes={
        "new_tokens=0 means no forward pass at all: (0, 0); the formula gives a nonzero count "
        "there": lambda p, n: (n * p + n * (n - 1) // 2, p + n - 1),
        "this is seed 003's N(N+1)/2 and N: right only for a 1-token prompt; here the prompt has "
        "prompt_len tokens": lambda p, n: (n * (n + 1) // 2, n),
        "this is what you get when you also feed the last new token: it is returned, never fed "
        "back, so new_tokens tokens take new_tokens passes":
            lambda p, n: (n * p + n * (n + 1) // 2, p + n),
        "the naive count is right, but the cached prefill computes the prompt's prompt_len K/V "
        "vectors, not 1": lambda p, n: (n * p + n * (n - 1) // 2, n),
        "the cached count is right, but each naive step also recomputes the tokens generated so "
        "far: step i feeds prompt_len + i tokens": lambda p, n: (n * p, p + n - 1),
        "the pair is swapped: return (naive, cached)": lambda p, n: _kv_work(p, n)[::-1]},
    otherwise="naive: step i feeds the prompt plus the i tokens made so far; cached: the prompt "
              "once, then one token per later step; the last new token is never fed",
    forbid=(generate,), raised="your code raised on this input", solution=_kv_work)
check_kv_work = KV_WORK.check
EXERCISES = (CACHE_BYTES, KV_WORK)


# --- exercise 3: attention over a cache, any number of new queries --------------------------------

def _attend(q, k, v, mask=None, scale=None, dim=-1, after=False):
    """softmax(q kᵀ x scale) v with a boolean mask (True = may attend), and its classic bugs."""
    scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if mask is not None and not after:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=dim)
    return (weights * mask if mask is not None and after else weights) @ v


def _tril(q, k, shift: int = 0):
    """The mask under which new query i sees keys 0 .. L - T + i + shift (shift 0 is right)."""
    T, L = q.size(-2), k.size(-2)
    return torch.ones(T, L, dtype=torch.bool).tril(L - T + shift)


ATTENTION_MISTAKES = {  # hint -> a wrong cached_attention(q, k, v)
    "this is what you get with is_causal=True (or a plain .tril()) over a cache: the triangle is "
    "anchored at the top-left corner, as if nothing were cached, so new query 0 sees only key 0; "
    "new query i may see keys 0 .. L - T + i":
        lambda q, k, v: _attend(q, k, v, _tril(q, k, q.size(-2) - k.size(-2))),
    "this is what you get with no mask for T > 1: the new queries see their future; new query i "
    "may see keys 0 .. L - T + i only (no mask is right only when T == 1)": _attend,
    "this is what you get when the scores are not divided by sqrt(head_dim)":
        lambda q, k, v: _attend(q, k, v, _tril(q, k), scale=1.0),
    "this is what you get when you divide by head_dim: divide by sqrt(head_dim)":
        lambda q, k, v: _attend(q, k, v, _tril(q, k), scale=1 / q.size(-1)),
    "this is what you get with softmax over the queries: take it over the keys (dim=-1)":
        lambda q, k, v: _attend(q, k, v, _tril(q, k), dim=-2),
    "this is what you get when the mask is applied after the softmax: mask the scores with -inf "
    "first, so each row's weights still sum to 1":
        lambda q, k, v: _attend(q, k, v, _tril(q, k), after=True),
    "this is what you get when a new query may not see its own key: the mask's diagonal is off "
    "by one": lambda q, k, v: _attend(q, k, v, _tril(q, k, -1)),
    "this is what you get when each new query also sees the next one's key: the mask's diagonal "
    "is off by one": lambda q, k, v: _attend(q, k, v, _tril(q, k, 1)),
}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


def _ids(vocab: int, n: int, a: int, b: int) -> list[int]:
    return [(a * i + b) % vocab for i in range(n)]


@guarded
def check_cached_attention(cached_attention) -> None:
    """cached_attention(q, k, v) -> (B, n_head, T, head_dim) against the engine's kernel on random
    tensors, then inside the model with a real KVCache."""
    name = "cached_attention"
    gen = torch.Generator().manual_seed(2)
    # (B, n_head, T new queries, L keys, head_dim): prefills (T == L), decode steps (T == 1),
    # and chunks over a filled cache (1 < T < L), where a top-left triangle shows
    shapes = [(1, 2, 1, 1, 4), (1, 2, 4, 4, 8), (1, 4, 1, 9, 16), (2, 3, 3, 10, 8),
              (1, 1, 4, 6, 4), (2, 2, 5, 5, 16), (1, 8, 2, 30, 32), (1, 12, 1, 99, 64)]
    for B, nh, T, L, hs in shapes:
        queries = "1 new query" if T == 1 else f"{T} new queries"
        case = (f"q ({B}, {nh}, {T}, {hs}): {queries} over L = {L} keys ({L - T} cached), "
                f"k and v ({B}, {nh}, {L}, {hs})")
        q, k, v = (torch.randn(B, nh, n, hs, generator=gen) * 1.5 for n in (T, L, L))
        inputs = [t.clone() for t in (q, k, v)]
        with forbid(name, causal_attention):
            got = _call(name, case, cached_attention, *inputs)
        want = causal_attention(q, k, v)  # what the engine runs
        shape = tuple(want.shape)
        if not isinstance(got, torch.Tensor):
            fail(name, case, f"a torch tensor of shape {shape} (B, n_head, T, head_dim)", kind(got),
                 "return the attention output as one torch tensor (not numpy, not a tuple)")
        for label, before, after in zip("qkv", (q, k, v), inputs):
            expect(torch.equal(before, after), name, case, f"{label} left unchanged",
                   f"{label} changed in place",
                   "compute on new tensors (q = q / ..., not q /= ...): inside the model k and v "
                   "are the cache's own tensors, so changing them in place corrupts the cache")
        if tuple(got.shape) != shape:
            fail(name, case, f"a tensor of shape {shape} (B, n_head, T, head_dim)",
                 f"shape {tuple(got.shape)}", "one output row per new query and head, heads in "
                                              "dim 1")
        if got.dtype != q.dtype:
            fail(name, case, f"a {q.dtype} tensor, the dtype of q", f"a {got.dtype} tensor",
                 "compute in q's dtype: the next layer multiplies the output with its weights")
        if got.isnan().any():
            fail(name, case, "no NaN", "NaN in the output",
                 "a query row whose keys are all masked (softmax of all -inf): new query i must "
                 "see keys 0 .. L - T + i, its own key included; is the mask inverted (True must "
                 "mean 'may attend') or its diagonal off by one?")
        if not _close(got.float(), want):
            hint = diagnose(ATTENTION_MISTAKES, [((q, k, v), got.float())],
                            same=lambda wrong, answer: _close(answer, wrong)) or (
                "softmax(q kᵀ / sqrt(head_dim)) v over the keys, new query i seeing keys 0 .. "
                "L - T + i")
            fail(name, case, "the engine's attention output (to 1e-5)",
                 f"an output off by up to {(got.float() - want).abs().max():.4g}", hint)
    # plugged into the engine's model with its own KVCache: every pass's logits as the engine's
    target, _ = load_course_model("target", "cpu")
    models = [(tiny_model(5), "a tiny random model"), (target, "the course target")]
    for model, label in models:
        vocab = model.config.vocab_size
        prompt = _ids(vocab, 9, 37, 11)  # 5 tokens, 4 over them, then one token a pass
        chunks = [prompt[:5], prompt[5:]] + [[t] for t in _ids(vocab, 12, 53, 7)]
        ours, theirs = KVCache.for_model(model, max_len=32), KVCache.for_model(model, max_len=32)
        with torch.no_grad():
            for ids in chunks:
                past = ours.get_seq_length()
                want = model(torch.tensor([ids]), cache=ours)
                case = (f"{label}, model(idx, cache=KVCache, attention=cached_attention): "
                        f"{len(ids)} new token(s) over {past} cached")
                with forbid(name, causal_attention):
                    got = _call(name, case, model, torch.tensor([ids]), cache=theirs,
                                attention=cached_attention)
                expect(_close(got, want), name, case, "the engine's logits (to 1e-5)",
                       f"logits off by up to {(got - want).abs().max():.4g}",
                       "new query i of T sees keys 0 .. L - T + i; no mask when T == 1")
    passed(name, len(shapes) + len(models))


# --- exercise 4: add the cache yourself -----------------------------------------------------------

_POSITION_BUG = ("get_seq_length() returned 0 for a cache that holds positions: the model starts "
                 "the new tokens' positions there, so they restart at 0 every pass (seed 003's "
                 "position-offset bug); return the number of cached positions")
_CROP_IGNORED = ("crop did not roll the cache back: a cache that grows but never crops cannot "
                 "undo rejected tokens (speculative decoding, chapter 04); keep only the first "
                 "max_length positions of every layer")
_CROP_EMPTIED = ("crop emptied the cache: it rolls back TO max_length positions, keeping the "
                 "first max_length of every layer")
_CROP_LAST = ("crop kept the LAST max_length positions: keep the first ones, "
              "[:, :, :max_length]; the rolled-back tokens are the newest")
_APPEND_AFTER_CROP = ("update appended after the positions crop removed: crop must really "
                      "discard them (slice every layer's keys and values to [:, :, :max_length]), "
                      "not just move a counter")
_ONLY_NEW = ("update returned only this step's keys and values: return ALL of the layer's "
             "keys and values, cached + new, so attention sees the past")
_WRONG_DIM = ("the keys grew along the wrong dimension: they are (B, n_head, T, head_dim), so "
              "the positions are dim 2 (torch.cat([cached, new], dim=2))")
_MIXED_LAYERS = ("more positions than this layer was given: keep one entry per layer, "
                 "self.keys[layer_idx], and append only this step's T positions to it")
_FIRST_UPDATE = ("the first update of a layer has nothing cached to append to: store its "
                 "(B, n_head, T, head_dim) keys and values as the layer's first tensors")


def _length_hint(got, want, passes, n_layer, shape) -> str:
    """The hint for a wrong get_seq_length(): the first usual mistake that gives `got`."""
    return next(hint for wrong, hint in [
        (got == 0, _POSITION_BUG),
        (got == n_layer, "that is the number of layers (len(self.keys)), not of positions: read "
                         "the positions dimension of one layer, self.keys[0].shape[2]"),
        (got == n_layer * want, "this is what you get when every layer's update adds T: a pass "
                                "adds its T positions once, not once per layer"),
        (got == passes, "this counts passes (update calls), not positions: a pass may add "
                        "several"),
        (abs(got - want) == 1, "off by one: the model's next position is exactly the number of "
                               "cached ones"),
        (got in shape, "a wrong dimension of (B, n_head, L, head_dim) was read: the positions are "
                       "dim 2"),
        (True, "the number of cached positions: each pass adds its T positions to every layer")]
        if wrong)


class _Probe:
    """Drives a learner's cache directly with random tensors, keeping every layer's expected keys
    and values, so each classic mistake can be named."""
    # layers, batch, heads and head_dim apart from each other and from the lengths (5, 10, 11,
    # 12, 7, 9) and their neighbours, so a wrong length tells which mistake made it
    n_layer, shape = 3, (2, 8, 0, 16)

    def __init__(self, name, MyKVCache):
        self.name, self.passes, self.gen = name, 0, torch.Generator().manual_seed(4)
        self.cache = _call(name, "MyKVCache()", MyKVCache,
                           hint="MyKVCache() must work without arguments")
        expect(isinstance(self.cache, Cache), name, "MyKVCache()",
               "an instance of minikv.engine.cache.Cache", kind(self.cache),
               "subclass minikv.engine.cache.Cache: the model accepts no other cache")
        self.keys, self.values = ([torch.empty(self.shape) for _ in range(self.n_layer)]
                                  for _ in "kv")

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def get_length(self, case: str, hint=None) -> None:
        where = case + ": get_seq_length()"
        got = _call(self.name, where, self.cache.get_seq_length,
                    hint="an empty cache (before any update) holds 0 positions")
        value = as_int(got)
        if value is None:
            fail(self.name, where, self.length, kind(got),
                 "return a Python int: the model adds it to torch.arange(T) to get positions")
        if value != self.length:
            fail(self.name, where, self.length, value, (hint and hint(value)) or _length_hint(
                value, self.length, self.passes, self.n_layer, self.shape))

    def step(self, T: int, case: str, longer_hint: str = "") -> None:
        """One pass: every layer updated with T new positions in turn, then all read back."""
        B, nh, _, hs = self.shape
        old = self.length
        case = f"{case} ({T} new position(s) over {old} cached)"
        def raised(e: Exception) -> str:
            return _WRONG_DIM if "Sizes of tensors must match" in str(e) else _FIRST_UPDATE if (
                old == 0 and isinstance(e, (IndexError, KeyError))) else "your update raised"
        for layer in range(self.n_layer):
            k, v = (torch.randn(B, nh, T, hs, generator=self.gen) for _ in "kv")
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
            where = f"{case}: update(key, value, layer_idx={layer})"
            out = _call(self.name, where, self.cache.update, k.clone(), v.clone(), layer,
                        hint=raised)
            self.check_pair(where, out, layer, T, longer_hint)
        self.passes += 1
        self.get_length(f"after {case}")
        self.check_whole(f"after {case}", longer_hint)

    def check_pair(self, where, out, layer, T, longer_hint) -> None:
        want_k, want_v = self.keys[layer], self.values[layer]
        shape = tuple(want_k.shape)
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and all(isinstance(t, torch.Tensor) for t in out)):
            fail(self.name, where, f"a pair (keys, values) of tensors {shape}", kind(out),
                 "update returns the layer's keys and values: return keys, values")
        got_k, got_v = out
        for label, got in (("keys", got_k), ("values", got_v)):
            s = tuple(got.shape)
            if s != shape:
                fail(self.name, where, f"{label} of shape {shape} (B, n_head, L, head_dim)",
                     f"shape {s}", _WRONG_DIM if got.dim() != 4 or s[:2] + s[3:] != shape[:2]
                     + shape[3:] else _ONLY_NEW if s[2] == T != shape[2] else (
                         longer_hint or _MIXED_LAYERS) if s[2] > shape[2] else
                     "all of this layer's positions: the cached ones, then the new ones")
        if torch.equal(got_k, want_v) and torch.equal(got_v, want_k):
            fail(self.name, where, "(keys, values)", "(values, keys)", "the pair is swapped")
        for label, got, want in (("keys", got_k, want_k), ("values", got_v, want_v)):
            old = want.shape[2] - T
            if not torch.equal(got, want):
                fail(self.name, where, f"the layer's {label}: cached, then new",
                     f"different {label}", "the new positions came first: append them after the "
                     "cached ones, torch.cat([cached, new], dim=2)" if torch.equal(got, torch.cat(
                         [want[:, :, old:], want[:, :, :old]], dim=2)) else
                     "these are another layer's (or the other tensor's): each layer keeps its "
                     "own keys and values, indexed by layer_idx" if any(
                         torch.equal(got, other) for other in self.keys + self.values) else
                     "the cached positions (as stored), then the new ones (as given)")

    def check_whole(self, case: str, longer_hint: str = "", value_hint: str = "") -> None:
        """Every layer's keys and values in the learner's self.keys and self.values."""
        keys, values = getattr(self.cache, "keys", None), getattr(self.cache, "values", None)
        shape = (*self.shape[:2], self.length, self.shape[3])
        where = case + ": self.keys and self.values"
        if not (isinstance(keys, list) and isinstance(values, list)
                and len(keys) == len(values) == self.n_layer
                and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in keys + values)):
            fail(self.name, where, f"two lists of {self.n_layer} tensors (one per layer)",
                 f"keys: {kind(keys)}, values: {kind(values)}",
                 "keep layer i's keys and values in self.keys[i] and self.values[i] (the lists "
                 "__init__ creates)")
        shapes = [tuple(t.shape) for t in keys + values]
        if any(s != shape for s in shapes):
            longer = [s[:2] + s[3:] == shape[:2] + shape[3:] and s[2] > shape[2] for s in shapes]
            right = [s == shape for s in shapes]
            fail(self.name, where, f"every layer {shape}", f"shapes {shapes}", (
                longer_hint or "they hold more positions than get_seq_length() says") if all(
                longer) else "some layers (or only the keys, or only the values) hold more "
                "positions than get_seq_length() says: cut every layer's keys and values" if all(
                a or b for a, b in zip(longer, right)) else
                "exactly the cached positions of every layer, in dim 2")
        expect(same_cache_prefix((self.length, self.keys + self.values), self.cache, self.length),
               self.name, where, "every layer's keys and values as given to update",
               "different tensors", value_hint or "store exactly what update received, in "
               "order, layer by layer")

    def crop(self, n: int) -> None:
        before, old_keys = self.length, self.keys
        case = f"crop({n}) of a cache holding {before} positions"
        _call(self.name, case, self.cache.crop, n)
        self.keys, self.values = ([t[:, :, :n] for t in ts] for ts in (self.keys, self.values))
        self.get_length(f"after {case}", lambda got: _CROP_IGNORED if got == before != n else
                        _CROP_EMPTIED if got == 0 else "")
        if n:  # the lists after crop(0) may hold empty tensors or nothing
            keys = getattr(self.cache, "keys", None)
            last = (isinstance(keys, list) and keys and isinstance(keys[0], torch.Tensor)
                    and torch.equal(keys[0], old_keys[0][:, :, before - n:]))
            self.check_whole(f"after {case}", _APPEND_AFTER_CROP, _CROP_LAST if last else "")


def _grew(cache, want: int) -> bool:
    keys = getattr(cache, "keys", None)
    return (isinstance(keys, list) and bool(keys) and isinstance(keys[0], torch.Tensor)
            and keys[0].dim() == 4 and keys[0].shape[2] > want)


_ENGINE_CACHE = (KVCache.__init__, KVCache.update, KVCache.crop, KVCache.get_seq_length,
                 KVCache.fork)  # the engine's own cache code, which MyKVCache must not call


def _mine(name: str, case: str, fn, *args, **kwargs):
    """Run the learner's code (or the model on the learner's cache), forbidding the engine's."""
    with forbid(name, *_ENGINE_CACHE):
        return _call(name, case, fn, *args, **kwargs)


def _compare_caches(name, case, cache, ref: KVCache, length: int, hint: str) -> None:
    """The learner's cache holds, in every layer, the engine's keys and values (to 1e-5)."""
    hint = _APPEND_AFTER_CROP if _grew(cache, length) else hint
    got = as_int(_mine(name, case + ": get_seq_length()", cache.get_seq_length))
    expect(got == length, name, case + ": get_seq_length()", length, got, hint)
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    want = [t[:, :, :length] for t in ref.keys + ref.values]
    tensors = (keys + values) if isinstance(keys, list) and isinstance(values, list) else []
    ok = len(tensors) == len(want) and all(
        isinstance(a, torch.Tensor) and _close(a, b) for a, b in zip(tensors, want))
    expect(ok, name, case + ": every layer's keys and values",
           f"{ref.n_layer} layers of keys and values, each {tuple(want[0].shape)}, as the "
           f"engine's cache holds them", "different", hint)


def _rollbacks(model, seq: list[int]):
    """Two rollbacks of the len(seq) - 1 cached positions (a third of the way, then 3 other tokens
    and 1 more; by 1, then 1 and 1), each with the engine's fresh cache and new rows' logits."""
    vocab, length, plan = model.config.vocab_size, len(seq) - 1, []
    for n_other in (3, 1):
        keep = length // 3 if n_other == 3 else length - 1
        new = [(t + 1) % vocab for t in seq[keep:keep + n_other]] + [(seq[0] + 5) % vocab]
        fresh = KVCache.for_model(model, max_len=keep + len(new))
        with torch.no_grad():
            rows = model(torch.tensor([seq[:keep] + new]), cache=fresh)[0, keep:]
        plan.append((length, keep, new, fresh, rows))
        length, seq = keep + len(new), seq[:keep] + new
    return plan


def _drive(name, model, label, MyKVCache, attention, n_new: int, hint: str = "") -> None:
    """Greedy generation with the learner's cache in the checker's own loop, then two rollbacks:
    tokens, logits, K/V work and every layer of the cache as the engine's."""
    hint = hint or ("update appends each pass's keys and values to every layer and returns all of "
                    "them; get_seq_length() is the number of cached positions")
    prompt = _ids(model.config.vocab_size, 9, 37, 11)
    ref = KVCache.for_model(model, max_len=len(prompt) + n_new)
    expected = generate(model, prompt, n_new, mode="cached", return_logits=True, cache=ref)
    plan = _rollbacks(model, prompt + expected.tokens)
    cache = _mine(name, "MyKVCache()", MyKVCache)
    tokens: list[int] = []
    with KVCounter(model) as counter, torch.no_grad():
        # two prompt chunks give the first token; each later pass feeds the newest token
        for i, ids in enumerate([prompt[:5], prompt[5:]] + [None] * (n_new - 1)):
            ids = ids or tokens[-1:]
            past = 0 if i == 0 else 5 if i == 1 else len(prompt) + i - 2
            what = ("the prefill of 5 prompt tokens" if i == 0 else
                    f"the other {len(ids)} prompt tokens over {past} cached" if i == 1 else
                    f"decode step {i - 1}, over {past} cached")
            case = f"{label}, model(idx, cache=MyKVCache(), attention=...), {what}"
            logits = _mine(name, case, model, torch.tensor([ids]), cache=cache,
                           attention=attention)
            if i == 0:
                continue
            got, want = logits[0, -1], expected.logits[i - 1]
            expect(_close(got, want), name, case, "generate's logits (to 1e-5)",
                   f"logits off by up to {(got - want).abs().max():.4g}", hint)
            tokens.append(int(got.argmax()))
            expect(tokens[-1] == expected.tokens[i - 1], name, case,
                   f"greedy token {expected.tokens[i - 1]}", tokens[-1], hint)
    work = expected.stats.kv_computed
    expect(counter.count == work, name, label, f"{work} K/V vectors computed per layer",
           counter.count, "the cache must spare the model every recomputation")
    _compare_caches(name, f"{label}, after {n_new} greedy tokens", cache, ref,
                    len(prompt) + n_new - 1, hint)
    # rollbacks: crop back, feed other tokens, compare with a fresh computation
    for length, keep, new, fresh, rows in plan:
        case = f"{label}, crop({keep}) of a cache holding {length} positions"
        _mine(name, case, cache.crop, keep)  # its length after crop: tested by _Probe
        for ids, want, past in ((new[:-1], rows[:-1], keep), (new[-1:], rows[-1:],
                                                              keep + len(new) - 1)):
            what = f"{case}, then {len(ids)} other token(s) over {past} cached"
            with torch.no_grad():
                logits = _mine(name, what, model, torch.tensor([ids]), cache=cache,
                               attention=attention)[0]
            expect(_close(logits, want), name, what, "the logits of a fresh computation (to 1e-5)",
                   "different logits",
                   _APPEND_AFTER_CROP if _grew(cache, keep + len(new)) else hint)
        _compare_caches(name, f"{case}, then {len(new)} other tokens", cache, fresh,
                        keep + len(new), hint)


@guarded
def check_my_kv_cache(MyKVCache, cached_attention) -> None:
    """MyKVCache (update, get_seq_length, crop) driven directly, then in the model with minikv's
    attention, then with cached_attention: greedy tokens and rollbacks, as the engine's."""
    name = "MyKVCache"
    if not isinstance(MyKVCache, type):
        fail(name, "MyKVCache", "a class (class MyKVCache(Cache): ...)", kind(MyKVCache),
             "pass the class itself, not an instance")
    expect(not issubclass(MyKVCache, KVCache), name, "MyKVCache", "a subclass of Cache",
           "a subclass of minikv's KVCache", "build it yourself on Cache, not on KVCache")
    with forbid(name, *_ENGINE_CACHE):
        probe = _Probe(name, MyKVCache)
        probe.get_length("an empty MyKVCache()")
        for T, what in (5, "a prefill"), (5, "a second chunk"), (1, "a decode step"), (
                1, "another decode step"):
            probe.step(T, what)
        probe.crop(7)
        probe.step(2, "a chunk after crop(7)", longer_hint=_APPEND_AFTER_CROP)
        probe.crop(probe.length)
        probe.crop(0)
        probe.step(3, "a prefill after crop(0)", longer_hint=_APPEND_AFTER_CROP)
        other = _call(name, "a second MyKVCache()", MyKVCache)
        got = as_int(_call(name, "a second MyKVCache(): get_seq_length()", other.get_seq_length))
        expect(got == 0, name, "a second MyKVCache() made after the first was filled", 0, got,
               "two caches share their lists: create them in __init__, not as class attributes")
    models = [(tiny_model(7), "a tiny random model"),
              (tiny_model(8, n_layer=3, n_head=2, n_embd=48), "a 3-layer, 2-head random model"),
              (load_course_model("target", "cpu")[0], "the course target")]
    for model, label in models:
        _drive(name, model, label, MyKVCache, causal_attention, n_new=50)
    try:
        _drive(name, models[0][0], models[0][1] + " with your cached_attention", MyKVCache,
               cached_attention, n_new=20, hint=(
                   "your MyKVCache passed every test with minikv's own attention, so it is "
                   "cached_attention (exercise 3) that differs"))
    except NotImplementedError:
        print(f"{name} works with minikv's attention; now write cached_attention (exercise 3) "
              f"to plug both in")
        raise
    passed(name, 12 + len(models) + 1)


# --- exercise 5: predict, then measure: attention's work with and without a cache ----------------

def _attention_pairs(model, prompt: list[int], n: int, mode: str) -> int:
    """(query, key) pairs per layer and head scored when `generate` makes n tokens in `mode`: its
    passes replayed with an attention that counts the pairs the causal mask lets through."""
    out = generate(model, prompt, n, mode=mode, trace=True)
    counted = [0]

    def counting(q, k, v):
        T, L = q.size(-2), k.size(-2)
        counted[0] += T * (L - T) + T * (T + 1) // 2  # new query i sees L - T + i + 1 keys
        return causal_attention(q, k, v)
    cache = KVCache.for_model(model, max_len=len(prompt) + n) if mode == "cached" else None
    with torch.no_grad():
        for event in out.trace:
            model(torch.tensor([list(event.input_ids)]), cache=cache, attention=counting)
    return counted[0] // model.config.n_layer


def _pairs_mistakes(P: int, N: int, heads: int, layers: int) -> list[tuple[tuple, str]]:
    """The usual wrong predictions for a P-token prompt and N new tokens, and their hints."""
    tri = [P + i for i in range(N)]  # the sequence length at each naive pass
    naive = sum(t * (t + 1) // 2 for t in tri)
    cached = P * (P + 1) // 2 + sum(range(P + 1, P + N))
    return [  # ((naive or None, cached or None: any), hint)
        ((N * (N + 1) * (N + 2) // 6, N * (N + 1) // 2), "that is the count for a 1-token prompt "
         "(section 5's): here the prompt has P tokens, all fed in the first pass, and the "
         "sequence is P + i tokens long at pass i"),
        ((naive * layers, cached * layers), "per layer AND per head: you summed the layers"),
        ((naive * heads, cached * heads), "per layer AND per head: you summed the heads"),
        ((naive * layers * heads, cached * layers * heads),
         "per layer and per head: you summed layers and heads"),
        ((N * P + N * (N - 1) // 2, P + N - 1), "these are the K/V vectors computed (section 1), "
         "not attention's work: a cached decode step computes one K/V, but its query still "
         "scores every cached key"),
        ((None, P + N - 1), "that is the cached decoder's K/V count: its decode step computes one "
         "K/V, but its one query scores EVERY key in the cache"),
        ((None, P * (P + 1) // 2 + N - 1), "one key per decode step? The new query scores every "
         "cached key and its own: the whole row"),
        ((sum(t * t for t in tri), None), "the causal mask: query i sees keys 0..i, a triangle, "
         "not a square"),
        ((None, P * P + sum(range(P + 1, P + N))), "the prefill's queries are masked too: query i "
         "of the prompt sees keys 0..i, a triangle, not a square"),
        ((naive + (P + N) * (P + N + 1) // 2, None), "the last new token is returned, never fed: "
         "N tokens take N passes"),
        ((None, cached + P + N), "the last new token is returned, never fed: no pass scores its "
         "query"),
        ((None, sum(range(P + 1, P + N))), "the prefill scores pairs too: its P queries over the P "
         "prompt keys, under the mask"),
        ((cached, naive), "the pair is swapped: return (naive, cached)"),
        ((naive, naive), "the cache spares the naive decoder's recomputation of the earlier "
         "queries too: a cached decode step has ONE query, not the whole sequence's")]


@guarded
def check_predict_attention_pairs(predict_attention_pairs) -> None:
    """predict_attention_pairs() -> (naive, cached): the (query, key) pairs per layer and head
    scored in the seed's run ("Once upon a", 5 new tokens), without and with a cache."""
    name = "predict_attention_pairs"
    got = prediction(name, f"{name}()", predict_attention_pairs, GPT.forward, generate)
    pair = int_list(got)
    if pair is None or len(pair) != 2:
        fail(name, f"{name}()", "a pair of ints (naive, cached)", kind(got),
             "return the two counts you predict, as ints: return naive, cached")
    target, tok = load_course_model("target", "cpu")
    prompt, n = tok.encode("Once upon a"), 5
    want = naive, cached = [_attention_pairs(target, prompt, n, m) for m in ("naive", "cached")]
    if pair == want:
        print(f"✓ {name}: as counted, {naive} (query, key) pairs without a cache and {cached} "
              f"with one, per layer and head: the cache makes K/V work linear, not attention's")
        return
    cfg = target.config
    hint = next((h for (a, b), h in _pairs_mistakes(len(prompt), n, cfg.n_head, cfg.n_layer)
                 if (a is None or a == pair[0]) and (b is None or b == pair[1])
                 and not (a in (None, naive) and b in (None, cached))),
                "count pass by pass: each pass's new queries, each scoring the keys the causal "
                "mask lets it see (cached ones included)")
    fail(name, "generate(target, tok.encode('Once upon a'), 5) without and with a cache, "
               "(query, key) pairs per layer and head, counted in every pass",
         tuple(want), tuple(pair), hint)


# --- exercise 6: debug a preallocated cache -----------------------------------------------------

class _Prealloc(Cache):
    """The notebook's PreallocatedCache, its length moving on at `when`: "last" (right: after the
    last layer's update), "every" (as shipped: every layer's), "first" (layer 0's) or "never"."""
    def __init__(self, model, max_len, when="last"):
        cfg = model.config
        shape = (1, cfg.kv_heads, max_len, cfg.head_dim)
        self.keys, self.values = ([torch.zeros(shape) for _ in range(cfg.n_layer)] for _ in "kv")
        self.length, self.when = 0, when

    def get_seq_length(self, layer_idx=0):
        return self.length

    def check_fits(self, cfg, batch_size, n_new, device, dtype):
        if self.length + n_new > self.keys[0].shape[2]:
            raise ValueError("the cache is full")

    def update(self, key, value, layer_idx):
        start, end = self.length, self.length + key.shape[2]
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        if {"every": True, "first": layer_idx == 0, "never": False}.get(
                self.when, layer_idx == len(self.keys) - 1):
            self.length = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def crop(self, max_length):
        self.length = max_length


_PREALLOC_HINTS = {
    "every": ("this is the shipped update's behaviour: the length moves on in EVERY layer's "
              "update, so after a pass of T tokens the cache says n_layer x T, and layers 1.. "
              "wrote their keys and values after layer 0's, at slots no query expects (with one "
              "layer, like the draft, the bug hides). One pass adds T positions to every layer: "
              "the length may move on only once all layers are written"),
    "first": ("the length moved on after layer 0's update: layers 1.. then read it as their "
              "start and write after layer 0's positions. Every layer of a pass writes at the "
              "same slots: move the length on once the LAST layer is written"),
    "never": ("the length never moves: every pass writes at slot 0 and its tokens get positions "
              "from 0 again (seed 003's bug, section 7): move it on once per pass"),
}


def _run_prealloc(model, make, passes):
    """`passes` ((ids, crop_to or None), ...) through the model into the cache make(): ([(logits,
    length after), ...], the exception that stopped it or None)."""
    rows = []
    try:
        cache = make()
        with torch.no_grad():
            for ids, crop_to in passes:
                if crop_to is not None:
                    cache.crop(crop_to)
                rows.append((model(torch.tensor([ids]), cache=cache)[0], cache.get_seq_length()))
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 - a crash is a wrong answer, reported below
        return rows, e
    return rows, None


def _same_run(a, b) -> bool:
    return len(a) == len(b) and all(as_int(x[1]) == y[1] and _close(x[0], y[0])
                                    for x, y in zip(a, b))


@guarded
def check_fixed_cache(FixedCache) -> None:
    """FixedCache(model, max_len): every pass's logits as the engine's (prefill, chunk, decode
    steps, rollbacks) and get_seq_length() after it, on 1-, 2-, 3- and 12-layer models."""
    name = "FixedCache"
    if not isinstance(FixedCache, type):
        fail(name, "FixedCache", "a class (class FixedCache(PreallocatedCache): ...)",
             kind(FixedCache), "pass the class itself, not an instance")
    models = [(load_course_model("draft", "cpu")[0], "the course draft (1 layer)"),
              (tiny_model(7), "a tiny random model (2 layers)"),
              (tiny_model(8, n_layer=3, n_head=2, n_embd=48), "a 3-layer random model"),
              (load_course_model("target", "cpu")[0], "the course target (12 layers)")]
    for model, label in models:
        prompt = _ids(model.config.vocab_size, 9, 37, 11)
        expected = generate(model, prompt, 12, mode="cached", return_logits=True)
        # the passes (ids, crop_to, logits, length after, what): two prompt chunks, then one
        # token a pass, then the rollbacks' tokens
        steps = [(prompt[:5], None, None, 5, "a prefill of 5 tokens"),
                 (prompt[5:], None, expected.logits[0], 9, "the other 4 prompt tokens over 5 "
                                                           "cached")]
        steps += [([t], None, expected.logits[i], 9 + i, f"decode step {i}")
                  for i, t in enumerate(expected.tokens[:-1], 1)]
        for _, keep, new, _, rows in _rollbacks(model, prompt + expected.tokens):
            steps += [(new[:-1], keep, rows[-2], keep + len(new) - 1,
                       f"crop({keep}), then {len(new) - 1} other tokens"),
                      (new[-1:], None, rows[-1], keep + len(new), "then one more token")]
        passes = [step[:2] for step in steps]
        with forbid(name, *_ENGINE_CACHE):
            got, error = _run_prealloc(model, lambda m=model: FixedCache(m, 64), passes)

        def bug(rows) -> str:  # the hint of the known bug whose run so far matches
            return next((h for when, h in _PREALLOC_HINTS.items() if _same_run(rows, _run_prealloc(
                model, lambda m=model: _Prealloc(m, 64, when), passes)[0][:len(rows)])), "")
        for k, ((logits, length), (_, _, want, want_len, what)) in enumerate(zip(got, steps)):
            ok_len = as_int(length) == want_len
            if ok_len and (want is None or _close(logits[-1], want)):
                continue
            case = f"{label}, pass {k + 1} ({what})"
            hint = bug(got[:k + 1])
            if not ok_len:
                fail(name, case + ": get_seq_length() after it", want_len, length,
                     hint or "one pass of T tokens adds T positions, whatever the number of "
                             "layers; crop(n) leaves n")
            fail(name, case, "the engine's logits (to 1e-5)", "different logits",
                 hint or "every layer of a pass writes its keys and values at the same slots, "
                         "after the live ones, and returns all of its live ones")
        if error is not None:
            k = len(got)
            case = f"{label}, pass {k + 1} ({steps[k][4]})" if k < len(steps) else label
            fail(name, case, "a result", f"{type(error).__name__}: {error}",
                 bug(got) or "your cache raised on this pass")
    passed(name, len(models))


# --- exercise 7: design: how many K/V heads fit --------------------------------------------------

SERVE_SHAPE = dict(vocab_size=32000, block_size=8192, n_layer=32, n_head=32, n_embd=4096)
SERVE_BATCH, SERVE_LEN, SERVE_BUDGET = 32, 8192, 40 * 2**30


@guarded
def check_choose_kv_heads(choose_kv_heads) -> None:
    """choose_kv_heads() -> the most K/V heads GPTConfig accepts whose fp16 cache for 32 requests
    of 8,192 positions fits 40 GiB, by kv_cache_bytes."""
    name = "choose_kv_heads"
    got = _call(name, f"{name}()", choose_kv_heads)
    heads = as_int(got)
    case = ("an 8B-like model (32 layers, 32 query heads of 128), fp16 cache, 32 requests of "
            "8,192 positions each, 40 GiB for the cache")
    if heads is None or heads < 1:
        fail(name, case, "a number of K/V heads, a positive int", kind(got),
             "return the n_kv_head you choose")

    def cache(h: int) -> int:
        return kv_cache_bytes(GPTConfig(**SERVE_SHAPE, n_kv_head=h), SERVE_LEN, SERVE_BATCH,
                              torch.float16)
    try:
        used = cache(heads)
    except ValueError as e:
        fail(name, case, "an n_kv_head that GPTConfig accepts", heads,
             f"GPTConfig refuses it ({e}): grouped-query attention splits the 32 query heads "
             f"into equal groups, one per K/V head, so n_kv_head must divide 32")
    best = max(h for h in range(1, 33) if 32 % h == 0 and cache(h) <= SERVE_BUDGET)
    gib = used / 2**30
    if used > SERVE_BUDGET:
        fail(name, case, f"at most {SERVE_BUDGET // 2**30} GiB", f"n_kv_head={heads}: "
             f"{gib:g} GiB", ("over budget: you counted only the keys (or only the values); the "
                              "cache holds both" if used // 2 <= SERVE_BUDGET else "over budget: "
                              "count every layer, both K and V, every request and position")
             + ("; 32 K/V heads is plain multi-head attention, the model's full cache"
                if heads == 32 else ""))
    if heads != best:
        fail(name, case, "the most K/V heads whose cache fits", f"n_kv_head={heads}: {gib:g} GiB",
             "it fits, but more K/V heads fit too, and the more K/V heads, the less the "
             "query heads must share (chapter 07 measures what sharing costs): choose the most "
             "that fit")
    print(f"✓ {name}: {heads} K/V heads, {gib:g} GiB of 40; the next larger choice GPTConfig "
          f"accepts would not fit")
