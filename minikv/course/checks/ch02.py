"""Chapter 02's checkers: cache_bytes and kv_work (tables), cached_attention, MyKVCache (driven
directly, then in the model with rollbacks), predict_attention_pairs, FixedCache and
choose_kv_heads (design). Hints: hints/ch02.toml."""
from __future__ import annotations

import math

import torch

from ...engine import GPT, Cache, GPTConfig, KVCache, causal_attention, generate, kv_cache_bytes
from .. import checks as ck
from ..checkpoint import load_course_model

H = ck.hints("ch02")
BYTES, WORK, ATT, MY, PAIRS, FIXED, HEADS = (H[k] for k in (
    "cache_bytes", "kv_work", "cached_attention", "MyKVCache", "predict_attention_pairs",
    "FixedCache", "choose_kv_heads"))


def _call(name: str, case: str, fn, *args, hint=H["raised"]):
    return ck.call_hinted(name, case, hint if callable(hint) else (lambda e: hint), fn, *args)


# --- exercise 1: cache bytes ----------------------------------------------------------------------
def _bytes(cfg, s, b, nb, kvh):  # the right count, in the learner's form
    return cfg.n_layer * 2 * b * (cfg.n_head if kvh is None else kvh) * s * cfg.head_dim * nb


_TINY_REAL = ck.tiny_model(0)  # its fp32 cache holding 37 positions is the last case


def _real_bytes(cfg, s, b, nb, kvh):
    if cfg is _TINY_REAL.config:  # what a real cache holds
        cache = KVCache.for_model(_TINY_REAL, max_len=64)
        with torch.no_grad():
            _TINY_REAL(torch.arange(1, s + 1)[None], cache=cache)
        return cache.nbytes
    dtype = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32}[nb]
    return kv_cache_bytes(cfg, s, b, dtype, n_kv_head=kvh)


def _times(f):  # a wrong cache_bytes: the right count changed by f(cfg, s, b, nb, kvh, right)
    return lambda cfg, s, b, nb, kvh: f(cfg, s, b, nb, kvh, right=_bytes(cfg, s, b, nb, kvh))


_GPT2, _LLAMA = GPTConfig.preset("gpt2"), GPTConfig(vocab_size=32000, block_size=4096, n_layer=32,
                                                    n_head=32, n_embd=4096)
CACHE_BYTES = ck.Exercise(
    "cache_bytes", cases=[  # cfg, seq_len, batch_size, bytes_per_value, n_kv_head
        (_GPT2, 100, 1, 2, None), (_GPT2, 100, 3, 4, None), (_GPT2, 1024, 1, 2, None),
        (_GPT2, 0, 1, 2, None), (_GPT2, 100, 1, 2, 4), (_LLAMA, 4096, 1, 2, 8),
        (_LLAMA, 4096, 8, 1, 8), (_LLAMA, 1, 1, 2, 1),
        (GPTConfig.preset("target"), 256, 2, 4, None), (_TINY_REAL.config, 37, 1, 4, None)],
    describe=lambda cfg, s, b, nb, kvh: "the tiny model's real cache holding 37 positions (fp32)"
    if cfg is _TINY_REAL.config else f"n_layer={cfg.n_layer}, n_head={cfg.n_head}, head_dim="
    f"{cfg.head_dim}, seq_len={s}, batch_size={b}, bytes_per_value={nb}, n_kv_head={kvh}",
    reference=_real_bytes, returns=ck.integer(float_hint=BYTES["float"]),
    mistakes=ck.named(
        BYTES, keys_only=_times(lambda *a, right: right // 2),
        no_kv_heads=lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, None),
        group_size=lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, nb, cfg.n_head // kvh if kvh
                                                     else None),
        no_batch=lambda cfg, s, b, nb, kvh: _bytes(cfg, s, 1, nb, kvh),
        no_layers=_times(lambda cfg, *a, right: right // cfg.n_layer),
        bits=_times(lambda *a, right: right * 8),
        embd_and_heads=_times(lambda cfg, *a, right: right * cfg.n_head))
    | {ck.hints("ch01")["pass_cost"]["elements"]:  # values, not bytes: chapter 01's hint
       lambda cfg, s, b, nb, kvh: _bytes(cfg, s, b, 1, kvh)},
    otherwise=lambda answers: BYTES["nbytes"] if all(  # only the real cache wrong
        got == _real_bytes(*case) for case, got in answers if case[0] is not _TINY_REAL.config
    ) else BYTES["otherwise"],
    forbid=(kv_cache_bytes,), raised=H["raised"], solution=_bytes)
check_cache_bytes = CACHE_BYTES.check


# --- exercise 2: K/V work with and without a cache ------------------------------------------------
def _kv_work(p, n):
    return (n * p + n * (n - 1) // 2, p + n - 1) if n else (0, 0)


def _kv_work_measured(p, n):  # the K/V vectors the engine counts, naive and cached
    return tuple(generate(_TINY_REAL, list(range(1, p + 1)), n, mode=mode).stats.kv_computed
                 for mode in ("naive", "cached"))


KV_WORK = ck.Exercise(  # each mistake as a student would write it, without a case for n = 0
    "kv_work", cases=[(3, 5), (1, 4), (1, 1), (4, 0), (1, 10), (6, 3), (2, 12), (10, 1), (5, 2)],
    describe=lambda p, n: f"prompt_len={p}, new_tokens={n}", reference=_kv_work_measured,
    returns=ck.ints(2, WORK["refused"], float_hint=WORK["float"]),
    mistakes=ck.named(WORK, no_tokens=lambda p, n: (n * p + n * (n - 1) // 2, p + n - 1),
                      seed=lambda p, n: (n * (n + 1) // 2, n),
                      last_fed=lambda p, n: (n * p + n * (n + 1) // 2, p + n),
                      prefill_one=lambda p, n: (n * p + n * (n - 1) // 2, n),
                      naive_prompt_only=lambda p, n: (n * p, p + n - 1))
    | {H["swapped"]: lambda p, n: _kv_work(p, n)[::-1]},
    otherwise=WORK["otherwise"], forbid=(generate,), raised=H["raised"], solution=_kv_work)
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


def _tril(q, k, shift: int = 0):  # new query i sees keys 0 .. L - T + i + shift (0 is right)
    return torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(k.size(-2) - q.size(-2)
                                                                     + shift)


ATTENTION_MISTAKES = ck.named(  # hint -> a wrong cached_attention(q, k, v)
    ATT, top_left=lambda q, k, v: _attend(q, k, v, _tril(q, k, q.size(-2) - k.size(-2))),
    no_mask=_attend, no_scale=lambda q, k, v: _attend(q, k, v, _tril(q, k), scale=1.0),
    head_dim=lambda q, k, v: _attend(q, k, v, _tril(q, k), scale=1 / q.size(-1)),
    over_queries=lambda q, k, v: _attend(q, k, v, _tril(q, k), dim=-2),
    mask_after=lambda q, k, v: _attend(q, k, v, _tril(q, k), after=True),
    not_own=lambda q, k, v: _attend(q, k, v, _tril(q, k, -1)),
    next_key=lambda q, k, v: _attend(q, k, v, _tril(q, k, 1)))


@ck.guarded
def check_cached_attention(cached_attention) -> None:
    name, gen = "cached_attention", torch.Generator().manual_seed(2)
    # (B, n_head, T new queries, L keys, head_dim): prefills (T == L), decode steps (T == 1),
    # and chunks over a filled cache (1 < T < L), where a top-left triangle shows
    shapes = [(1, 2, 1, 1, 4), (1, 2, 4, 4, 8), (1, 4, 1, 9, 16), (2, 3, 3, 10, 8),
              (1, 1, 4, 6, 4), (2, 2, 5, 5, 16), (1, 8, 2, 30, 32), (1, 12, 1, 99, 64)]
    for B, nh, T, L, hs in shapes:
        case = (f"q ({B}, {nh}, {T}, {hs}): {'1 new query' if T == 1 else f'{T} new queries'} "
                f"over L = {L} keys ({L - T} cached), k and v ({B}, {nh}, {L}, {hs})")
        q, k, v = (torch.randn(B, nh, n, hs, generator=gen) * 1.5 for n in (T, L, L))
        inputs = [t.clone() for t in (q, k, v)]
        with ck.forbid(name, causal_attention):
            got = _call(name, case, cached_attention, *inputs)
        for label, before, after in zip("qkv", (q, k, v), inputs):
            ck.expect(torch.equal(before, after), name, case, f"{label} left unchanged",
                      f"{label} changed in place", ATT["in_place"])
        ck.expect_tensor(name, case, got, causal_attention(q, k, v),  # what the engine runs
                         shape_words=" (B, n_head, T, head_dim)", mistakes=ATTENTION_MISTAKES,
                         hints=dict(ATT, close=ATT["otherwise"]), inputs=(q, k, v))
    models = [(ck.tiny_model(5), "a tiny random model"),
              (load_course_model("target", "cpu")[0], "the course target")]
    for model, label in models:  # then in the model, with a KVCache
        _against_engine(name, f"{label}, model(idx, cache=KVCache, attention=cached_attention)",
                        model, 13, lambda m=model: KVCache.for_model(m, max_len=64),
                        (causal_attention,), lambda what, rows, want: H["raised"]
                        if what == "raised" else ATT["model"], cached_attention)
    ck.passed(name, len(shapes) + len(models))


# --- exercise 4: add the cache yourself -----------------------------------------------------------
class _Probe:
    """Drives a learner's cache directly with random tensors, keeping every layer's expected keys
    and values, so each classic mistake can be named. Layers, batch, heads and head_dim are apart
    from each other and from the lengths (5, 10, 11, 12, 7, 9): a wrong length tells its mistake."""
    n_layer, shape, name = 3, (2, 8, 0, 16), "MyKVCache"

    def __init__(self, MyKVCache):
        self.passes, self.gen = 0, torch.Generator().manual_seed(4)
        self.cache = _call(self.name, "MyKVCache()", MyKVCache, hint=MY["no_args"])
        ck.expect(isinstance(self.cache, Cache), self.name, "MyKVCache()", "an instance of "
                  "minikv.engine.cache.Cache", ck.kind(self.cache), MY["not_cache"])
        self.keys, self.values = ([torch.empty(self.shape)] * self.n_layer for _ in "kv")

    def get_length(self, case: str, hint=lambda got: "") -> None:
        where, want = case + ": get_seq_length()", self.keys[0].shape[2]
        raw = _call(self.name, where, self.cache.get_seq_length, hint=MY["empty"])
        got = ck.as_int(raw)
        ck.expect(got is not None, self.name, where, want, ck.kind(raw), MY["not_int"])
        ck.expect(got == want, self.name, where, want, got, hint(got) or MY[
            "position_bug" if got == 0 else "n_layer" if got == self.n_layer else
            "per_layer" if got == self.n_layer * want else "passes" if got == self.passes else
            "off_by_one" if abs(got - want) == 1 else "dimension" if got in self.shape else
            "length"])

    def step(self, T: int, case: str, longer: str = "") -> None:
        """One pass: every layer updated with T new positions in turn, then all read back."""
        (B, nh, _, hs), old = self.shape, self.keys[0].shape[2]
        case = f"{case} ({T} new position(s) over {old} cached)"
        for layer in range(self.n_layer):
            k, v = (torch.randn(B, nh, T, hs, generator=self.gen) for _ in "kv")
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
            where = f"{case}: update(key, value, layer_idx={layer})"
            out = _call(self.name, where, self.cache.update, k.clone(), v.clone(), layer,
                        hint=lambda e: MY["wrong_dim"] if "Sizes of tensors must match" in str(e)
                        else MY["first_update"] if old == 0 and isinstance(e, LookupError)
                        else MY["update_raised"])
            self.check_pair(where, out, layer, T, longer)
        self.passes += 1
        self.get_length(f"after {case}")
        self.check_whole(f"after {case}", longer)

    def check_pair(self, where, out, layer, T, longer) -> None:
        want_k, want_v = self.keys[layer], self.values[layer]
        shape, old = tuple(want_k.shape), want_k.shape[2] - T
        ck.expect(isinstance(out, (tuple, list)) and len(out) == 2 and all(
            isinstance(t, torch.Tensor) for t in out), self.name, where,
            f"a pair (keys, values) of tensors {shape}", ck.kind(out), MY["not_pair"])
        for label, got in zip(("keys", "values"), out):
            s = tuple(got.shape)
            ck.expect(s == shape, self.name, where, f"{label} of shape {shape} (B, n_head, L, "
                      f"head_dim)", f"shape {s}", MY["wrong_dim"] if got.dim() != 4
                      or s[:2] + s[3:] != shape[:2] + shape[3:] else MY["only_new"]
                      if s[2] == T != shape[2] else (longer or MY["mixed_layers"])
                      if s[2] > shape[2] else MY["all_positions"])
        ck.expect(not (torch.equal(out[0], want_v) and torch.equal(out[1], want_k)), self.name,
                  where, "(keys, values)", "(values, keys)", MY["pair_swapped"])
        for label, got, want in zip(("keys", "values"), out, (want_k, want_v)):
            ck.expect(torch.equal(got, want), self.name, where, f"the layer's {label}: cached, "
                      f"then new", f"different {label}", MY["new_first"] if torch.equal(
                          got, torch.cat([want[:, :, old:], want[:, :, :old]], dim=2)) else
                      MY["other_layer"] if any(torch.equal(got, other)
                                               for other in self.keys + self.values)
                      else MY["as_given"])

    def check_whole(self, case: str, longer: str = "", value_hint: str = "") -> None:
        """Every layer's keys and values in the learner's self.keys and self.values."""
        keys, values = getattr(self.cache, "keys", None), getattr(self.cache, "values", None)
        length, where = self.keys[0].shape[2], case + ": self.keys and self.values"
        shape = (*self.shape[:2], length, self.shape[3])
        ck.expect(isinstance(keys, list) and isinstance(values, list)
                  and len(keys) == len(values) == self.n_layer
                  and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in keys + values),
                  self.name, where, f"two lists of {self.n_layer} tensors (one per layer)",
                  f"keys: {ck.kind(keys)}, values: {ck.kind(values)}", MY["lists"])
        shapes = [tuple(t.shape) for t in keys + values]
        longer_ = [s[:2] + s[3:] == shape[:2] + shape[3:] and s[2] > shape[2] for s in shapes]
        ck.expect(all(s == shape for s in shapes), self.name, where, f"every layer {shape}",
                  f"shapes {shapes}", (longer or MY["longer"]) if all(longer_) else
                  MY["some_longer"] if all(a or s == shape for a, s in zip(longer_, shapes))
                  else MY["exactly"])
        ck.expect(ck.same_cache_prefix((length, self.keys + self.values), self.cache, length),
                  self.name, where, "every layer's keys and values as given to update",
                  "different tensors", value_hint or MY["stored"])

    def crop(self, n: int) -> None:
        before, old_keys = self.keys[0].shape[2], self.keys
        case = f"crop({n}) of a cache holding {before} positions"
        _call(self.name, case, self.cache.crop, n)
        self.keys, self.values = ([t[:, :, :n] for t in ts] for ts in (self.keys, self.values))
        self.get_length(f"after {case}", lambda got: MY["crop_ignored"] if got == before != n
                        else MY["crop_emptied"] if got == 0 else "")
        if n:  # the lists after crop(0) may hold empty tensors or nothing
            keys = getattr(self.cache, "keys", None)
            last = (isinstance(keys, list) and keys and isinstance(keys[0], torch.Tensor)
                    and torch.equal(keys[0], old_keys[0][:, :, before - n:]))
            self.check_whole(f"after {case}", MY["append_after_crop"],
                             MY["crop_last"] if last else "")


_ENGINE_CACHE = (KVCache.__init__, KVCache.update, KVCache.crop, KVCache.get_seq_length,
                 KVCache.fork)  # the engine's own cache code, which MyKVCache must not call


def _script(model: GPT, n_new: int) -> list[tuple]:
    """The passes a cache is driven through, (ids, crop to first or None, what): a prompt in two
    chunks, a greedy decode step for each new token but the last, then two rollbacks (a third of
    the way back, 3 other tokens and 1 more; by 1, then 1 and 1)."""
    vocab = model.config.vocab_size
    prompt = [(37 * i + 11) % vocab for i in range(9)]
    seq = prompt + generate(model, prompt, n_new).tokens
    steps = [(prompt[:5], None, "a prefill of 5 tokens"),
             (prompt[5:], None, "the other 4 prompt tokens over 5 cached")]
    steps += [([t], None, f"decode step {i}") for i, t in enumerate(seq[len(prompt):-1], 1)]
    length = len(seq) - 1
    for n_other in (3, 1):
        keep = length // 3 if n_other == 3 else length - 1
        new = [(t + 1) % vocab for t in seq[keep:keep + n_other]] + [(seq[0] + 5) % vocab]
        steps += [(new[:-1], keep, f"crop({keep}), then {len(new) - 1} other tokens"),
                  (new[-1:], None, "then one more token")]
        length, seq = keep + len(new), seq[:keep] + new
    return steps


def _run(model: GPT, make, steps: list, attention=causal_attention):
    """The steps through the model into the cache make(): ([(logits (T, vocab), get_seq_length()
    after, its keys + values cloned or None), ...], the exception that stopped it or None)."""
    rows = []
    try:
        cache = make()
        with torch.no_grad():
            for ids, crop_to, _ in steps:
                if crop_to is not None:
                    cache.crop(crop_to)
                logits = model(torch.tensor([ids]), cache=cache, attention=attention)[0]
                kv = [getattr(cache, "keys", None), getattr(cache, "values", None)]
                rows.append((logits, cache.get_seq_length(), [t.clone() if isinstance(
                    t, torch.Tensor) else t for t in kv[0] + kv[1]] if all(
                    isinstance(x, list) for x in kv) else None))
    except (NotImplementedError, ck.CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 - a crash is a wrong answer, reported by the caller
        return rows, e
    return rows, None


def _against_engine(name, label, model, n_new, make, forbidden, why, attention=causal_attention,
                    kv=False) -> None:
    """The cache make() through _script's passes, as the engine's KVCache pass by pass:
    get_seq_length(), the logits and (if `kv`) every layer's keys and values. A difference fails
    with the hint why(what, rows so far, the engine's row or None), what one of "length",
    "logits", "kv" or "raised"."""
    steps = _script(model, n_new)
    want, _ = _run(model, lambda: KVCache.for_model(model, max_len=64), steps)
    with ck.forbid(name, *forbidden):
        got, error = _run(model, make, steps, attention)
    for k, ((logits, length, mine), (ref, ref_length, ours)) in enumerate(zip(got, want)):
        ref_kv = [t[:, :, :ref_length] for t in ours]
        wrong = ("length" if ck.as_int(length) != ref_length else "logits"
                 if not ck.close(logits, ref) else "kv" if kv and not (
                     mine is not None and len(mine) == len(ref_kv) and all(
                         isinstance(a, torch.Tensor) and ck.close(a, b)
                         for a, b in zip(mine, ref_kv))) else "")
        if wrong:
            where, expected, shown = {
                "length": (": get_seq_length() after it", ref_length, length),
                "logits": ("", "the engine's logits (to 1e-5)",
                           f"logits off by up to {(logits - ref).abs().max():.4g}"),
                "kv": (": every layer's keys and values", f"{len(ref_kv) // 2} layers of keys "
                       f"and values, each {tuple(ref_kv[0].shape)}, as the engine's cache holds "
                       f"them", "different")}[wrong]
            ck.fail(name, f"{label}, pass {k + 1} ({steps[k][2]}){where}", expected, shown,
                    why(wrong, got[:k + 1], want[k]))
    if error is not None:
        ck.fail(name, f"{label}, pass {len(got) + 1} ({steps[len(got)][2]})"
                if len(got) < len(steps) else label, "a result",
                f"{type(error).__name__}: {error}", why("raised", got, None))


@ck.guarded
def check_my_kv_cache(MyKVCache, cached_attention) -> None:
    name = "MyKVCache"
    ck.expect(isinstance(MyKVCache, type), name, "MyKVCache", "a class (class MyKVCache(Cache): "
              "...)", ck.kind(MyKVCache), H["not_class"])
    ck.expect(not issubclass(MyKVCache, KVCache), name, "MyKVCache", "a subclass of Cache",
              "a subclass of minikv's KVCache", MY["on_kvcache"])
    with ck.forbid(name, *_ENGINE_CACHE):
        probe = _Probe(MyKVCache)
        probe.get_length("an empty MyKVCache()")
        for T, what in (5, "a prefill"), (5, "a second chunk"), (1, "a decode step"), (
                1, "another decode step"):
            probe.step(T, what)
        probe.crop(7)
        probe.step(2, "a chunk after crop(7)", longer=MY["append_after_crop"])
        probe.crop(probe.keys[0].shape[2])
        probe.crop(0)
        probe.step(3, "a prefill after crop(0)", longer=MY["append_after_crop"])
        other = _call(name, "a second MyKVCache()", MyKVCache)
        got = ck.as_int(_call(name, "a second MyKVCache(): get_seq_length()",
                              other.get_seq_length))
        ck.expect(got == 0, name, "a second MyKVCache() made after the first was filled", 0, got,
                  MY["shared"])
    models = [(ck.tiny_model(7), "a tiny random model"),
              (ck.tiny_model(8, n_layer=3, n_head=2, n_embd=48), "a 3-layer, 2-head random model"),
              (load_course_model("target", "cpu")[0], "the course target")]

    def why(hint):  # more positions kept than get_seq_length() says (after crop): crop's fault
        return lambda what, rows, want: MY["append_after_crop"] if want and _grew(
            rows[-1][2], want[1]) else hint
    for model, label in models:
        _against_engine(name, f"{label}, model(idx, cache=MyKVCache(), attention=...)", model,
                        50, MyKVCache, _ENGINE_CACHE, why(MY["model"]), kv=True)
    try:
        _against_engine(name, f"{models[0][1]} with your cached_attention, model(idx, cache="
                        f"MyKVCache(), attention=...)", models[0][0], 20, MyKVCache,
                        _ENGINE_CACHE, why(MY["attention"]), cached_attention, kv=True)
    except NotImplementedError:
        print(f"{name} works with minikv's attention; now write cached_attention (exercise 3) "
              f"to plug both in")
        raise
    ck.passed(name, 12 + len(models) + 1)


def _grew(tensors: list | None, length: int) -> bool:  # every layer holds more than `length`?
    return bool(tensors) and isinstance(tensors[0], torch.Tensor) and tensors[0].dim() == 4 \
        and tensors[0].shape[2] > length


# --- exercise 5: predict, then measure: attention's work with and without a cache ----------------
def _attention_pairs(model, prompt: list[int], n: int, mode: str) -> int:
    """(query, key) pairs per layer and head scored when `generate` makes n tokens in `mode`: its
    passes replayed with an attention that counts the pairs the causal mask lets through."""
    out, counted = generate(model, prompt, n, mode=mode, trace=True), [0]

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
    """((naive or None, cached or None: any), hint) of the usual wrong predictions."""
    tri = [P + i for i in range(N)]  # the naive passes' lengths
    naive, cached = sum(t * (t + 1) // 2 for t in tri), P * (P + 1) // 2 + sum(range(P + 1, P + N))
    return [((N * (N + 1) * (N + 2) // 6, N * (N + 1) // 2), PAIRS["one_token_prompt"]),
            ((naive * layers, cached * layers), PAIRS["layers"]),
            ((naive * heads, cached * heads), PAIRS["heads"]),
            ((naive * layers * heads, cached * layers * heads), PAIRS["layers_and_heads"]),
            ((N * P + N * (N - 1) // 2, P + N - 1), PAIRS["kv"]),
            ((None, P + N - 1), PAIRS["cached_kv"]),
            ((None, P * (P + 1) // 2 + N - 1), PAIRS["one_key"]),
            ((sum(t * t for t in tri), None), PAIRS["square"]),
            ((None, P * P + sum(range(P + 1, P + N))), PAIRS["prefill_square"]),
            ((naive + (P + N) * (P + N + 1) // 2, None), PAIRS["naive_last_fed"]),
            ((None, cached + P + N), PAIRS["cached_last_fed"]),
            ((None, sum(range(P + 1, P + N))), PAIRS["no_prefill"]),
            ((cached, naive), H["swapped"]), ((naive, naive), PAIRS["one_query"])]


@ck.guarded
def check_predict_attention_pairs(predict_attention_pairs) -> None:
    name = "predict_attention_pairs"
    got = ck.prediction(name, f"{name}()", predict_attention_pairs, GPT.forward, generate)
    pair = ck.int_list(got)
    if pair is None or len(pair) != 2:
        ck.fail(name, f"{name}()", "a pair of ints (naive, cached)", ck.kind(got),
                PAIRS["refused"])
    target, tok = load_course_model("target", "cpu")
    prompt, n = tok.encode("Once upon a"), 5
    want = naive, cached = [_attention_pairs(target, prompt, n, m) for m in ("naive", "cached")]
    if pair == want:
        return print(f"✓ {name}: as counted, {naive} (query, key) pairs without a cache and "
                     f"{cached} with one, per layer and head: the cache makes K/V work linear, "
                     f"not attention's")
    hint = ck.pair_hint(_pairs_mistakes(len(prompt), n, target.config.n_head,
                                        target.config.n_layer), pair, want, PAIRS["otherwise"])
    ck.fail(name, "generate(target, tok.encode('Once upon a'), 5) without and with a cache, "
            "(query, key) pairs per layer and head, counted in every pass", tuple(want),
            tuple(pair), hint)


# --- exercise 6: debug a preallocated cache -----------------------------------------------------
class _Prealloc(Cache):
    """The notebook's PreallocatedCache, its length moving on at `when`: "last" (right: after the
    last layer's update), "every" (as shipped: every layer's), "first" (layer 0's) or "never"."""
    def __init__(self, model, max_len, when="last"):
        shape = (1, model.config.kv_heads, max_len, model.config.head_dim)
        self.keys, self.values = ([torch.zeros(shape) for _ in range(model.config.n_layer)]
                                  for _ in "kv")
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


def _same_run(a, b) -> bool:
    return len(a) == len(b) and all(ck.as_int(x[1]) == y[1] and ck.close(x[0], y[0])
                                    for x, y in zip(a, b))


@ck.guarded
def check_fixed_cache(FixedCache) -> None:
    name = "FixedCache"
    ck.expect(isinstance(FixedCache, type), name, "FixedCache", "a class (class FixedCache("
              "PreallocatedCache): ...)", ck.kind(FixedCache), H["not_class"])
    models = [(load_course_model("draft", "cpu")[0], "the course draft (1 layer)"),
              (ck.tiny_model(7), "a tiny random model (2 layers)"),
              (ck.tiny_model(8, n_layer=3, n_head=2, n_embd=48), "a 3-layer random model"),
              (load_course_model("target", "cpu")[0], "the course target (12 layers)")]
    for model, label in models:
        def why(what, rows, want, model=model) -> str:  # the known bug whose run so far matches
            return next((FIXED[when] for when in ("every", "first", "never") if _same_run(
                rows, _run(model, lambda: _Prealloc(model, 64, when), _script(model, 12))[0][
                    :len(rows)])), FIXED[what])
        _against_engine(name, label, model, 12, lambda m=model: FixedCache(m, 64), _ENGINE_CACHE,
                        why)
    ck.passed(name, len(models))


# --- exercise 7: design: how many K/V heads fit --------------------------------------------------
SERVE_SHAPE = dict(vocab_size=32000, block_size=8192, n_layer=32, n_head=32, n_embd=4096)
SERVE_BATCH, SERVE_LEN, SERVE_BUDGET = 32, 8192, 40 * 2**30  # choose_kv_heads()'s budget


def _kv_bytes(n: int) -> int:
    return kv_cache_bytes(GPTConfig(**SERVE_SHAPE, n_kv_head=n), SERVE_LEN, SERVE_BATCH,
                          torch.float16)


def _most_heads(budget: int) -> int:
    return max(n for n in range(1, 33) if 32 % n == 0 and _kv_bytes(n) <= budget)


@ck.guarded
def check_choose_kv_heads(choose_kv_heads) -> None:
    name = "choose_kv_heads"  # the default budget, then exactly full, a byte short, 1 and 32 heads
    for budget in (None, _kv_bytes(8), _kv_bytes(16) - 1, _kv_bytes(1), _kv_bytes(32)):
        args, b = (() if budget is None else (budget,)), budget or SERVE_BUDGET
        got = _call(name, f"{name}({', '.join(map(str, args))})", choose_kv_heads, *args)
        heads, best = ck.as_int(got), _most_heads(b)
        case = (f"an 8B-like model (32 layers, 32 query heads of 128), fp16 cache, 32 requests of "
                f"8,192 positions each, {b:,} bytes ({b / 2**30:g} GiB) for the cache")
        if heads is None or heads < 1:
            ck.fail(name, case, "a number of K/V heads, a positive int", ck.kind(got),
                    HEADS["refused"])
        try:
            used = _kv_bytes(heads)
        except ValueError as e:
            ck.fail(name, case, "an n_kv_head that GPTConfig accepts", heads,
                    HEADS["divide"].format(error=e))
        shown = f"n_kv_head={heads}: {used / 2**30:g} GiB"
        if heads != best and budget is not None and heads == _most_heads(SERVE_BUDGET):
            ck.fail(name, case, f"n_kv_head={best}", shown, HEADS["budget"])
        if used > b:
            ck.fail(name, case, f"at most {b / 2**30:g} GiB", shown, HEADS[
                "keys_only" if used // 2 <= b else "over"] + (HEADS["mha"] if heads == 32 else ""))
        ck.expect(heads == best, name, case, "the most K/V heads whose cache fits", shown,
                  HEADS["more"])
        if budget is None:
            message = (f"✓ {name}: {heads} K/V heads, {used / 2**30:g} GiB of 40; the next "
                       f"larger choice GPTConfig accepts would not fit")
    print(message)
