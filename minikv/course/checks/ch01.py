"""Checkers for chapter 01 (seed 002, prefill and decode): greedy_decode and chunked_prefill (the
tokens, logits and every layer's K/V against the engine, every forward pass logged), pass_cost (a
table, against bench.pass_cost), predict_batched_intensity (predict, then measure), FixedDecoder
(debug) and choose_chunk (design: an H100's balance point). The hints are in hints/ch01.toml."""
from __future__ import annotations

import contextlib
import functools

import torch

from ... import bench
from ...engine import GPT, GPTConfig, KVCache, generate
from ..checkpoint import load_course_model
from . import (
    Exercise,
    Refused,
    as_int,
    call,
    call_hinted,
    close,
    diagnose,
    expect,
    expect_tensor,
    fail,
    forbid,
    guarded,
    hints,
    passed,
    prediction,
    tiny_model,
)

H = hints("ch01")


@contextlib.contextmanager
def _pass_log(model: torch.nn.Module):
    """Every forward pass of `model`: (idx's shape, the cache given or None, that cache's length
    before the pass, the explicit positions or None)."""
    def hook(module, args, kwargs):
        idx, cache, positions = (args[i] if len(args) > i else kwargs.get(key)
                                 for i, key in enumerate(("idx", "cache", "positions")))
        if isinstance(positions, torch.Tensor):
            positions = [int(p) for p in positions.reshape(-1, positions.shape[-1])[0]]
        passes.append((tuple(idx.shape) if isinstance(idx, torch.Tensor) else None, cache,
                       cache.get_seq_length() if isinstance(cache, KVCache) else None, positions))
    passes, handle = [], model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield passes
    finally:
        handle.remove()


def _token_list(name: str, case: str, expected, got) -> list[int]:
    """The learner's token ids as a list of ints, or a CheckFailed saying what came back."""
    h = H["greedy_decode"]
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        fail(name, case, expected, got,
             h["array"].format(type=f"{type(got).__module__}.{type(got).__name__}"))
    if not isinstance(got, (list, tuple)):
        fail(name, case, expected, got, h["not_list"].format(type=type(got).__name__))
    for t in got:
        if as_int(t) is None:
            fail(name, case, expected, list(got), h["not_int"].format(bad=t, type=type(t).__name__))
    return [as_int(t) for t in got]


def _shapes(shapes: list, k: int = 8) -> str:
    return f"passes of shapes {shapes[:k]}{' ...' if len(shapes) > k else ''}"


def _one_cache(name: str, case: str, log: list, starts: list[int], h: dict, what: str) -> None:
    """Every pass (`what`: a pass or a chunk) into the first one's cache, holding starts[i]
    positions before pass i, at the positions that continue it (or none given)."""
    for i, ((shape, cache, length, positions), start) in enumerate(zip(log, starts), 1):
        if cache is None:
            fail(name, case, f"every {what} given the cache", f"{what} {i} ran without a cache",
                 h["no_cache"])
        if cache is not log[0][1]:
            fail(name, case, f"every {what} into the first {what}'s cache",
                 f"{what} {i} got a different cache object", h["other_cache"])
        if length != start:
            fail(name, case, f"cache length {start} before {what} {i}", f"cache length {length}",
                 h["length"])
        right = list(range(start, start + shape[1]))
        if positions is not None and positions != right:
            fail(name, case, f"{what} {i} at positions {right}", f"positions {positions}",
                 h["restart"].format(positions=h["positions"]) if i > 1 and positions[:1] == [0]
                 else h["positions"].format(i=i, first=right[0], last=right[-1]))


# --- exercise 1: the prefill + decode loop ------------------------------------------------------

def _first_position(model: GPT, prompt: list[int], n: int, eos_id=None) -> list[int]:
    """The tokens greedy decoding gives when the prefill's token is picked at its FIRST position."""
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt]))[0, 0].argmax())
    return [first] + (generate(model, prompt + [first], n - 1, eos_id=eos_id).tokens
                      if n > 1 and first != eos_id else [])


def _check_decode_passes(name: str, case: str, prompt, log: list) -> None:
    """One (1, P) prefill into an empty cache, then (1, 1) passes, all into that same cache."""
    h, P, shapes = H["greedy_decode"], len(prompt), [shape for shape, *_ in log]
    if not shapes:
        fail(name, case, f"a first pass of shape (1, {P})", "no forward pass of the model",
             h["no_pass"])
    if shapes[0] != (1, P):
        fail(name, case, f"first pass of shape (1, {P}) (the prefill)", _shapes(shapes),
             h["one_at_a_time"] if P > 1 and shapes[:P] == [(1, 1)] * P else
             h["last_apart"] if P > 1 and shapes[0] == (1, P - 1) else
             h["batch_dim"] if shapes[0] is not None and len(shapes[0]) != 2 else
             h["prefill"].format(P=P))
    for i, shape in enumerate(shapes[1:], 1):
        if shape != (1, 1):
            fail(name, case, f"pass {i + 1} of shape (1, 1) (a decode pass)", _shapes(shapes),
                 h["naive"] if shape == (1, P + i) else h["decode"])
    _one_cache(name, case, log, [0] + [P + i for i in range(len(log) - 1)], h, "pass")


def _decode_token_hint(model, prompt, n, eos_id, expected, got) -> str:
    h, eos = H["greedy_decode"], eos_id is not None and expected and expected[-1] == eos_id
    return (h["drop_eos"] if eos and got == expected[:-1] else
            h["past_eos"] if eos and len(got) > len(expected) and got[:len(expected)] == expected
            else h["short"] if got == expected[:-1] else h["long"].format(n=n) if len(got) > n
            else h["first_position"] if got == _first_position(model, prompt, n, eos_id) else
            h["otherwise"])


@guarded
def check_greedy_decode(greedy_decode) -> None:
    """greedy_decode(model, prompt_ids, max_new_tokens, eos_id) == generate(...).tokens, in one
    (1, T) prefill and (1, 1) passes into one cache, without calling minikv.generate."""
    name, model, h = "greedy_decode", tiny_model(1), H["greedy_decode"]
    target, tok = load_course_model("target", "cpu")
    cases = [(model, [1, 2, 3], 12, None), (model, [7], 1, None),
             (model, [5, 9, 11, 2, 4], 20, None),
             (model, [1, 2, 3], 12, generate(model, [1, 2, 3], 12).tokens[5]),  # EOS later,
             (model, [5, 9, 11, 2, 4], 6, generate(model, [5, 9, 11, 2, 4], 1).tokens[0]),  # first
             (target, tok.encode("The color of dog"), 10, tok.eot_token),
             (target, tok.encode("Once upon a time"), 8, tok.eot_token)]
    for m, prompt, n, eos_id in cases:
        case = (f"prompt {prompt}, max_new_tokens={n}, eos_id={eos_id}"
                + (" (course target)" if m is target else ""))
        expected = generate(m, prompt, n, mode="cached", eos_id=eos_id).tokens
        with _pass_log(m) as log, forbid(name, generate):
            got = call(name, case, greedy_decode, m, list(prompt), n, eos_id)
        tokens = _token_list(name, case, expected, got)
        _check_decode_passes(name, case, prompt, log)
        expect(tokens == expected, name, case, expected, tokens,
               _decode_token_hint(m, prompt, n, eos_id, expected, tokens))
        expect(len(log) == len(expected), name, case, f"{len(expected)} forward passes",
               f"{len(log)} forward passes", h["last_fed"] if len(log) == len(expected) + 1
               else h["passes"].format(n=len(expected)))
    passed(name, len(cases))


# --- exercise 2: chunked prefill ----------------------------------------------------------------

def _chunk_sizes(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - i) for i in range(0, length, chunk)]


def _chunk_size_hint(length: int, chunk: int, sizes: list[int]) -> str:
    h, expected = H["chunked_prefill"], _chunk_sizes(length, chunk)
    other = next((o for o in (chunk - 1, chunk + 1) if o >= 1 and sizes == _chunk_sizes(length, o)),
                 None)
    return (h["drop_last"].format(rest=length % chunk) if sizes == expected[:-1] and length % chunk
            else h["off_by_one"].format(other=other, chunk=chunk) if other else
            h["overlap"] if sizes == [min(chunk + 1, length - i) for i in range(0, length, chunk)]
            else h["one_pass"].format(chunk=chunk) if sizes == [length] and chunk < length else
            h["one_token"].format(chunk=chunk) if sizes == [1] * length and chunk > 1 else
            h["sizes"].format(n=len(expected), sizes=expected))


def _chunked_cases():
    g = torch.Generator().manual_seed(1)
    model = tiny_model(1)
    ten = torch.randint(0, 512, (10,), generator=g).tolist()
    for chunk in (4, 1, 3, 10, 16):  # 4 first: 4 + 4 + 2, where the usual mistakes differ
        yield model, ten, chunk, "tiny random model"
    yield tiny_model(4, n_layer=3), torch.randint(0, 512, (23,), generator=g).tolist(), 7, \
        "tiny random model, 3 layers"
    yield model, [7], 2, "tiny random model"
    target, tok = load_course_model("target", "cpu")
    yield target, tok.encode("The color of dog can vary widely. Once upon a time"), 5, \
        "course target"


@guarded
def check_chunked_prefill(chunked_prefill) -> None:
    """chunked_prefill(model, ids, chunk) -> (last logits (vocab,), cache), equal within 1e-5
    (every layer's K and V) to a one-pass prefill's, in ceil(len / chunk) passes into one cache."""
    name, n_cases, h = "chunked_prefill", 0, H["chunked_prefill"]
    for model, ids, chunk, label in _chunked_cases():
        L, V = len(ids), model.config.vocab_size
        case = f"{label}, {L} ids, chunk={chunk}"
        ref_cache = KVCache.for_model(model, max_len=L)
        with torch.inference_mode():
            ref_logits = model(torch.tensor([ids]), cache=ref_cache)[0, -1]
            first_chunk_logits = model(torch.tensor([ids[:chunk]]))[0, -1]
        with _pass_log(model) as log:
            got = call(name, case, chunked_prefill, model, list(ids), chunk)
        if isinstance(got, torch.Tensor):
            fail(name, case, "(logits, cache)", f"a tensor of shape {tuple(got.shape)}",
                 h["tensor"])
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            fail(name, case, "(logits, cache)", got if not isinstance(got, (tuple, list))
                 else f"a {type(got).__name__} of {len(got)} items", h["not_pair"])
        logits, cache = got
        if isinstance(logits, KVCache) and isinstance(cache, torch.Tensor):
            fail(name, case, "(logits, cache)", "(cache, logits)", h["order"])
        if not isinstance(cache, KVCache):
            fail(name, case, "a minikv.KVCache", type(cache).__name__, h["not_cache"])
        if type(logits).__module__ == "numpy" or not isinstance(logits, torch.Tensor):
            fail(name, case, f"a torch.Tensor of shape ({V},)", type(logits).__name__,
                 h["logits_type"])
        shapes, want = [shape for shape, *_ in log], _chunk_sizes(L, chunk)
        if any(s is None or len(s) != 2 or s[0] != 1 for s in shapes):
            fail(name, case, "passes of shape (1, chunk)", f"passes of shapes {shapes}",
                 h["batch_dim"])
        sizes = [s[1] for s in shapes]
        expect(sizes == want, name, case, f"{len(want)} passes of {want} tokens",
               f"{len(sizes)} passes of {sizes} tokens", _chunk_size_hint(L, chunk, sizes))
        _one_cache(name, case, log, [sum(want[:i]) for i in range(len(want))], h, "chunk")
        logits = logits.detach().cpu().to(ref_logits.dtype)
        expect_tensor(name, case, logits, ref_logits, mistakes={
            h["first_chunk"]: lambda: first_chunk_logits} if L > chunk else None, hints={
            "shape": (h["squeeze"] if logits.numel() == V else h["last_only"]).format(
                V=V, shape=tuple(logits.shape)), "nan": h["logits"], "close": h["logits"]})
        expect(cache.get_seq_length() == L, name, case, f"cache length {L}",
               f"cache length {cache.get_seq_length()}", h["cache_length"])
        theirs, n_layer = cache.keys + cache.values, len(cache.keys)
        for which, (a, b) in enumerate(zip(ref_cache.keys + ref_cache.values, theirs)):
            kind, layer = ("keys", "values")[which // n_layer], which % n_layer
            expect(b.shape[:2] == a.shape[:2] and b.shape[-1] == a.shape[-1]
                   and close(b[:, :, :L].cpu(), a[:, :, :L]), name, case,
                   f"layer {layer}'s {kind} equal to a one-pass prefill's (within 1e-5)",
                   f"layer {layer}'s {kind} differ", h["kv"])
        n_cases += 1
    passed(name, n_cases)


# --- exercise 3: what a pass costs (a table) ---------------------------------------------------

def _cost(cfg: GPTConfig, n_new: int, n_cached: int, bpv: int = 4, mistake: str | None = None):
    """(FLOPs, bytes) by minikv.bench.pass_cost's convention, or as a usual mistake gives it."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    pairs = {"rectangle": n_new * (n_cached + n_new),
             "no_diagonal": n_new * n_cached + n_new * (n_new - 1) // 2}.get(
        mistake, n_new * n_cached + n_new * (n_new + 1) // 2)
    head_rows = n_new if mistake == "head_on_every_row" else 1
    attention = {"qk_only": 2 * C * L * pairs, "no_attention": 0}.get(mistake, 4 * C * L * pairs)
    flops = 2 * (n_new * L * 12 * C * C + head_rows * V * C) + attention
    if mistake == "multiply_adds":
        flops //= 2
    embeddings = {"embeddings_whole": V * C + cfg.block_size * C}.get(mistake, 2 * n_new * C)
    head = 0 if mistake == "head_not_read" else V * C
    small = 0 if mistake == "no_biases" else L * 13 * C + 2 * C
    weights = L * 12 * C * C + small + head + embeddings
    positions = {"no_cached_kv": n_new, "no_new_kv": n_cached}.get(mistake, n_cached + n_new)
    kv = (1 if mistake == "k_only" else 2) * L * C * positions
    return flops, (weights + kv) * {"elements": 1, "always_4_bytes": 4}.get(mistake, bpv)


COST_MISTAKES = ("rectangle", "no_diagonal", "head_on_every_row", "qk_only", "no_attention",
                 "multiply_adds", "embeddings_whole", "head_not_read", "no_biases",
                 "no_cached_kv", "no_new_kv", "k_only", "elements", "always_4_bytes")


def _two_ints(got, *case) -> tuple[int, int]:
    """The contract: a pair of ints (FLOPs, bytes)."""
    if type(got).__module__ == "numpy" or not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Refused(H["pass_cost"]["not_pair"])
    for label, raw in zip(("FLOPs", "bytes"), got):
        if as_int(raw) is None:
            raise Refused(H["pass_cost"]["not_int"].format(label=label, type=type(raw).__name__))
    return as_int(got[0]), as_int(got[1])


def _cost_hint(answers: list) -> str:
    """No one mistake explains the answers (two at once?): name the FLOPs' own, else the bytes'."""
    h = H["pass_cost"]
    for i, fallback in ((0, h["flops"]), (1, h["bytes"])):  # one of them is wrong
        wrong = [(case, got[i]) for case, got in answers if got[i] != bench.pass_cost(*case)[i]]
        if wrong:
            return diagnose({h[m]: lambda *case, m=m, i=i: _cost(*case, mistake=m)[i]
                             for m in COST_MISTAKES}, wrong) or fallback


PASS_COST = Exercise(
    "pass_cost",
    # GPT-2, the course models and toy shapes, decode and prefill passes; (4, 12) first, in fp32
    # and in bf16: there every usual mistake gives its own numbers
    cases=[(cfg, n_new, n_cached, *bpv) for cfg in [GPTConfig.preset(p) for p in (
               "gpt2", "target", "draft", "tiny")] + [GPTConfig(
               vocab_size=97, block_size=64, n_layer=3, n_head=2, n_embd=10)]
           for n_new, n_cached in [(4, 12), (1, 0), (1, 16), (1, 999), (16, 0), (256, 0), (7, 3)]
           for bpv in ([(), (2,)] if (n_new, n_cached) == (4, 12) else [()])],
    describe=lambda cfg, n_new, n_cached, bpv=4: (
        f"GPTConfig(vocab_size={cfg.vocab_size}, n_layer={cfg.n_layer}, n_embd={cfg.n_embd}), "
        f"n_new={n_new}, n_cached={n_cached}" + (f", bytes_per_value={bpv}" if bpv != 4 else "")),
    reference=bench.pass_cost, solution=_cost, returns=_two_ints, forbid=(bench.pass_cost,),
    mistakes={H["pass_cost"][m]: functools.partial(_cost, mistake=m) for m in COST_MISTAKES},
    otherwise=_cost_hint)
check_pass_cost = PASS_COST.check
EXERCISES = [PASS_COST]


# --- exercise 4: predict, then measure: a batched decode step's intensity -----------------------

BATCH, CACHED, BF16 = 64, 1000, 2
H100_BALANCE = 989e12 / 3.35e12  # NVIDIA H100 SXM datasheet: dense bf16 FLOP/s over HBM3 bytes/s


def _batched_decode(cfg: GPTConfig, batch: int, cached: int, bpv: int,
                    keys_only: bool = False) -> tuple[int, int]:
    """(FLOPs, bytes) of one decode pass over `batch` sequences of `cached` tokens each: every row
    its own arithmetic, K/V and embedding rows, the weights read once for the whole batch."""
    weights = bench.pass_cost(cfg, 0, 0, bpv)[1]  # no token fed: the weights alone
    flops, moved = bench.pass_cost(cfg, 1, cached, bpv)
    own = moved - weights  # this row's K/V and embedding rows
    if keys_only:
        own -= cfg.n_layer * cfg.n_embd * (cached + 1) * bpv
    return batch * flops, weights + batch * own


@guarded
def check_predict_batched_intensity(predict_batched_intensity) -> None:
    """predict_batched_intensity() -> FLOPs per byte of one bf16 decode pass of GPT-2 small over
    64 sequences with 1,000 cached tokens each, within 30% of the cost model's value."""
    name, h = "predict_batched_intensity", H["predict_batched_intensity"]
    got = prediction(name, f"{name}()", predict_batched_intensity, GPT.forward, generate)
    value = got if isinstance(got, (int, float)) and not isinstance(got, bool) else None
    if isinstance(got, torch.Tensor) and got.numel() == 1 or type(got).__module__ == "numpy":
        value = float(got)
    if value is None or not value > 0:
        fail(name, f"{name}()", "a positive number (FLOPs per byte)", got, h["refused"])
    cfg = GPTConfig.preset("gpt2")
    flops, moved = _batched_decode(cfg, BATCH, CACHED, BF16)
    want = flops / moved
    case = (f"one decode pass of GPT-2 small in bf16 over {BATCH} sequences, each with "
            f"{CACHED:,} tokens cached (cost model: {flops / 1e9:,.1f} GFLOPs, "
            f"{moved / 1e6:,.0f} MB moved)")
    if abs(value - want) <= 0.3 * want:
        print(f"✓ {name}: you predicted {value:.3g}; the cost model gives {want:.2f} FLOPs per "
              f"byte, far below an H100's balance point ({H100_BALANCE:.0f}): the K/V reads "
              f"dominate")
        return
    weights, single = bench.pass_cost(cfg, 0, 0, BF16)[1], bench.pass_cost(cfg, 1, CACHED, BF16)
    no_kv = flops / (weights + BATCH * 2 * cfg.n_embd * BF16)
    fp32, keys = bench.pass_cost(cfg, 1, CACHED, 4), _batched_decode(cfg, BATCH, CACHED, BF16, True)
    numbers = dict(batch=BATCH, cached=CACHED, kv_one=(single[1] - weights) / 1e6,
                   weights=weights / 1e6)
    shared = h["shared"].format(**numbers)
    candidates = [(BATCH * single[0] / single[1], "times_batch"),
                  (BATCH * fp32[0] / fp32[1], "fp32_times_batch"), (no_kv, "no_kv"),
                  (no_kv / 2, "fp32_no_kv"), (single[0] / single[1], "one_sequence"),
                  (fp32[0] / fp32[1], "fp32_one_sequence"), (want / 2, "fp32"),
                  (keys[0] / keys[1], "keys_only")]
    hint = next((h[key] for v, key in candidates if abs(value - v) <= 0.1 * v), h["otherwise"])
    fail(name, case, f"{want:.2f} FLOPs per byte (within 30%: {0.7 * want:.2f} to "
                     f"{1.3 * want:.2f})", f"{value:.4g}", hint.format(shared=shared, **numbers))


# --- exercise 5: debug a decoder ----------------------------------------------------------------

def _decoder_error_hint(e: Exception) -> str:
    text, h = str(e), H["FixedDecoder"]
    return (h["dims"] if "idx must have shape" in text else
            h["flat"] if "outside the vocabulary" in text else
            h["overflow"] if "KV cache overflow" in text or "exceeds block_size" in text else
            h["raised"])


@guarded
def check_decoder(FixedDecoder) -> None:
    """FixedDecoder(model).generate(prompt_ids, max_new_tokens) == generate(..., mode="cached")
    .tokens, with one (1, P) prefill then (1, 1) passes into one cache."""
    name, h = "FixedDecoder", H["FixedDecoder"]
    if not isinstance(FixedDecoder, type):
        fail(name, "FixedDecoder", "a class", type(FixedDecoder).__name__, h["not_class"])
    target, tok = load_course_model("target", "cpu")
    tiny = tiny_model(1)
    cases = [(tiny, [7], 6, "a tiny random model, a 1-token prompt"),
             (tiny, [5, 9, 11], 12, "a tiny random model"),
             (tiny_model(4, n_layer=3), [3, 1, 4, 1, 5, 9, 2, 6, 5], 20,
              "a 3-layer random model"),
             (target, tok.encode("The color of dog"), 8, "the course target")]
    for i, (model, prompt, n, label) in enumerate(cases):
        case = f"{label}: FixedDecoder(model).generate({prompt}, {n})"
        expected = generate(model, prompt, n, mode="cached").tokens
        decoder = call(name, f"{label}: FixedDecoder(model)", FixedDecoder, model)
        with _pass_log(model) as log, forbid(name, generate):
            got = call_hinted(name, case, _decoder_error_hint, decoder.generate, list(prompt), n)
        tokens = _token_list(name, case, expected, got)
        shapes, P = [shape for shape, *_ in log], len(prompt)
        if len(shapes) > 1 and shapes[1] != (1, 1):
            fail(name, case, f"passes of shapes [(1, {P}), (1, 1), ...]", _shapes(shapes, 5),
                 h["every_position" if shapes[1] == (1, P) else "decode"].format(
                     P=P, hides=h["hides"] if i > 0 else ""))
        _check_decode_passes(name, case, prompt, log)
        if tokens != expected:
            fail(name, case, expected, tokens, h["other_position"] if len(tokens) > 1
                 and tokens[1] == _first_position(model, prompt, 2)[1] != expected[1]
                 else h["otherwise"])
        expect(len(shapes) == len(expected), name, case, f"{len(expected)} forward passes",
               f"{len(shapes)}", h["passes"])
    passed(name, len(cases))


# --- exercise 6: design: a chunk size for chunked prefill ---------------------------------------

CHUNK_PROMPT = 1000


def _chunk_intensities(cfg: GPTConfig, chunk: int) -> list[tuple[int, int, float]]:
    """(tokens, cached before, FLOPs per byte in bf16) of every pass of a chunked prefill."""
    rows, done = [], 0
    while done < CHUNK_PROMPT:
        n = min(chunk, CHUNK_PROMPT - done)
        flops, moved = bench.pass_cost(cfg, n, done, BF16)
        rows.append((n, done, flops / moved))
        done += n
    return rows


@guarded
def check_choose_chunk(choose_chunk) -> None:
    """choose_chunk() -> the smallest chunk size for which every pass of a chunked prefill of a
    1,000-token prompt on GPT-2 small (bf16) reaches an H100's balance point, by
    bench.pass_cost."""
    name, h = "choose_chunk", H["choose_chunk"]
    got = call(name, "choose_chunk()", choose_chunk)
    chunk = as_int(got)
    case = (f"chunked prefill of a {CHUNK_PROMPT:,}-token prompt, GPT-2 small, bf16, on an H100 "
            f"(balance point {H100_BALANCE:.0f} FLOPs per byte)")
    if chunk is None or chunk < 1:
        fail(name, case, "a chunk size, a positive int", got, h["refused"])
    cfg = GPTConfig.preset("gpt2")
    best = next(c for c in range(1, CHUNK_PROMPT + 1)
                if min(i for _, _, i in _chunk_intensities(cfg, c)) >= H100_BALANCE)
    rows = _chunk_intensities(cfg, min(chunk, CHUNK_PROMPT))
    slow = [(k, n, done, i) for k, (n, done, i) in enumerate(rows) if i < H100_BALANCE]
    if slow:
        k, n, done, intensity = slow[0]
        shown = ", ".join(f"{n} tokens after {done}: {i:.0f}" for n, done, i in rows[:4])
        hint = h["slow"].format(k=k + 1, n=n, done=done, intensity=intensity)
        if k > 0 and k == len(rows) - 1:
            hint += h["remainder"].format(prompt=CHUNK_PROMPT, done=done, n=n)
            if _chunk_intensities(cfg, chunk)[0][2] >= H100_BALANCE \
                    > _chunk_intensities(cfg, chunk - 1)[0][2]:  # ONE prefill's crossover
                hint += h["one_prefill"].format(chunk=chunk, prompt=CHUNK_PROMPT)
        elif k == 0:
            hint += h["full_chunk"] + (h["cpu"] if chunk in (11, 12, 18) else "")
        fail(name, case, f"every pass at {H100_BALANCE:.0f} FLOPs per byte or more",
             f"chunk={chunk}: {shown}{' ...' if len(rows) > 4 else ''}", hint)
    if chunk >= CHUNK_PROMPT:
        fail(name, case, "a chunk that splits the prompt", f"chunk={chunk}: one pass",
             h["no_chunking"])
    if chunk != best:
        fail(name, case, "the smallest chunk that keeps every pass compute-bound",
             f"chunk={chunk}: " + ", ".join(f"{n} tokens after {done}: {i:.0f}"
                                            for n, done, i in rows), h["smaller"])
    print(f"✓ {name}: chunks of {chunk}: " + ", ".join(
        f"{n} tokens after {done} cached do {i:.0f} FLOPs per byte" for n, done, i in rows)
        + f"; none smaller keeps every pass at {H100_BALANCE:.0f} or more")
