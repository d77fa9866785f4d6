"""Chapter 01's checkers: greedy_decode and chunked_prefill (tokens, logits and K/V against the
engine, every pass logged), pass_cost (a table), predict_batched_intensity (predict, then measure),
FixedDecoder (debug) and choose_chunk (design). Hints: hints/ch01.toml."""
from __future__ import annotations

import contextlib
import functools

import torch

from ... import bench
from ...engine import GPT, GPTConfig, KVCache, generate
from .. import checks as ck
from ..checkpoint import load_course_model

H = ck.hints("ch01")
DEC, CHUNK, COST, INT, FIX, CH = (H[k] for k in (
    "greedy_decode", "chunked_prefill", "pass_cost", "predict_batched_intensity", "FixedDecoder",
    "choose_chunk"))


@contextlib.contextmanager
def _pass_log(model: torch.nn.Module):
    """Every pass: (idx's shape, the cache or None, its length before, positions or None)."""
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
    try:
        return ck.token_ids(got, DEC)
    except ck.Refused as r:
        ck.fail(name, case, expected, got, r.hint)


def _shapes(shapes: list, k: int = 8) -> str:
    return f"passes of shapes {shapes[:k]}{' ...' if len(shapes) > k else ''}"


def _one_cache(name: str, case: str, log: list, starts: list[int], h: dict, what: str) -> None:
    """Every pass into the first one's cache, holding starts[i] positions before pass i, at the
    positions that continue it (or none given)."""
    for i, ((shape, cache, length, positions), start) in enumerate(zip(log, starts), 1):
        right = list(range(start, start + shape[1]))
        for ok, expected, got, hint in [
                (cache is not None, f"every {what} given the cache",
                 f"{what} {i} ran without a cache", h["no_cache"]),
                (cache is log[0][1], f"every {what} into the first {what}'s cache",
                 f"{what} {i} got a different cache object", h["other_cache"]),
                (length == start, f"cache length {start} before {what} {i}",
                 f"cache length {length}", h["length"]),
                (positions in (None, right), f"{what} {i} at positions {right}",
                 f"positions {positions}", h["restart"].format(positions=h["positions"])
                 if i > 1 and (positions or [None])[0] == 0 else
                 h["positions"].format(i=i, first=right[0], last=right[-1]))]:
            ck.expect(ok, name, case, expected, got, hint)


# --- exercise 1: the prefill + decode loop ------------------------------------------------------
def _first_position(model: GPT, prompt: list[int], n: int, eos_id=None) -> list[int]:
    """The tokens greedy decoding gives when the prefill's token is picked at its FIRST position."""
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt]))[0, 0].argmax())
    return [first] + (generate(model, prompt + [first], n - 1, eos_id=eos_id).tokens
                      if n > 1 and first != eos_id else [])


def _check_decode_passes(name: str, case: str, prompt, log: list) -> None:
    """One (1, P) prefill into an empty cache, then (1, 1) passes, all into that same cache."""
    P, shapes = len(prompt), [shape for shape, *_ in log]
    ck.expect(shapes, name, case, f"a first pass of shape (1, {P})",
              "no forward pass of the model", DEC["no_pass"])
    ck.expect(shapes[0] == (1, P), name, case, f"first pass of shape (1, {P}) (the prefill)",
              _shapes(shapes), DEC["one_at_a_time"] if P > 1 and shapes[:P] == [(1, 1)] * P else
              DEC["last_apart"] if P > 1 and shapes[0] == (1, P - 1) else
              DEC["batch_dim"] if shapes[0] is not None and len(shapes[0]) != 2 else
              DEC["prefill"].format(P=P))
    for i, shape in enumerate(shapes[1:], 1):
        ck.expect(shape == (1, 1), name, case, f"pass {i + 1} of shape (1, 1) (a decode pass)",
                  _shapes(shapes), DEC["naive"] if shape == (1, P + i) else DEC["decode"])
    _one_cache(name, case, log, [0] + [P + i for i in range(len(log) - 1)], DEC, "pass")


@ck.guarded
def check_greedy_decode(greedy_decode) -> None:
    name, model = "greedy_decode", ck.tiny_model(1)
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
        want = generate(m, prompt, n, mode="cached", eos_id=eos_id).tokens
        with _pass_log(m) as log, ck.forbid(name, generate):
            got = ck.call(name, case, greedy_decode, m, list(prompt), n, eos_id)
        got = _token_list(name, case, want, got)
        _check_decode_passes(name, case, prompt, log)
        eos = eos_id is not None and want and want[-1] == eos_id
        ck.expect(got == want, name, case, want, got, DEC[
            "drop_eos" if eos and got == want[:-1] else
            "past_eos" if eos and len(got) > len(want) and got[:len(want)] == want else
            "short" if got == want[:-1] else "long" if len(got) > n else
            "first_position" if got == _first_position(m, prompt, n, eos_id) else
            "otherwise"].format(n=n))
        ck.expect(len(log) == len(want), name, case, f"{len(want)} forward passes",
                  f"{len(log)} forward passes", DEC["last_fed"] if len(log) == len(want) + 1
                  else DEC["passes"].format(n=len(want)))
    ck.passed(name, len(cases))


# --- exercise 2: chunked prefill ----------------------------------------------------------------
def _chunk_sizes(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - i) for i in range(0, length, chunk)]


def _chunk_size_hint(length: int, chunk: int, sizes: list[int]) -> str:
    want = _chunk_sizes(length, chunk)
    other = next((o for o in (chunk - 1, chunk + 1) if o >= 1 and sizes == _chunk_sizes(length, o)),
                 None)
    return CHUNK[
        "drop_last" if sizes == want[:-1] and length % chunk else "off_by_one" if other else
        "overlap" if sizes == [min(chunk + 1, length - i) for i in range(0, length, chunk)] else
        "one_pass" if sizes == [length] and chunk < length else
        "one_token" if sizes == [1] * length and chunk > 1 else "sizes"].format(
        rest=length % chunk, other=other, chunk=chunk, n=len(want), sizes=want)


@ck.guarded
def check_chunked_prefill(chunked_prefill) -> None:
    name, g, model = "chunked_prefill", torch.Generator().manual_seed(1), ck.tiny_model(1)
    ten, (target, tok) = torch.randint(0, 512, (10,), generator=g).tolist(), load_course_model(
        "target", "cpu")
    cases = [(model, ten, chunk, "tiny random model") for chunk in (4, 1, 3, 10, 16)] + [
        (ck.tiny_model(4, n_layer=3), torch.randint(0, 512, (23,), generator=g).tolist(), 7,
         "tiny random model, 3 layers"), (model, [7], 2, "tiny random model"),
        (target, tok.encode("The color of dog can vary widely. Once upon a time"), 5,
         "course target")]  # chunk 4 first: 4 + 4 + 2, where the usual mistakes differ
    for model, ids, chunk, label in cases:
        L, V, case = len(ids), model.config.vocab_size, f"{label}, {len(ids)} ids, chunk={chunk}"
        ref_cache = KVCache.for_model(model, max_len=L)
        with torch.inference_mode():
            ref_logits = model(torch.tensor([ids]), cache=ref_cache)[0, -1]
            first_chunk_logits = model(torch.tensor([ids[:chunk]]))[0, -1]
        with _pass_log(model) as log:
            got = ck.call(name, case, chunked_prefill, model, list(ids), chunk)
        if isinstance(got, torch.Tensor):
            ck.fail(name, case, "(logits, cache)", f"a tensor of shape {tuple(got.shape)}",
                    CHUNK["tensor"])
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            ck.fail(name, case, "(logits, cache)", got if not isinstance(got, (tuple, list))
                    else f"a {type(got).__name__} of {len(got)} items", CHUNK["not_pair"])
        logits, cache = got
        ck.expect(not (isinstance(logits, KVCache) and isinstance(cache, torch.Tensor)), name,
                  case, "(logits, cache)", "(cache, logits)", CHUNK["order"])
        ck.expect(isinstance(cache, KVCache), name, case, "a minikv.KVCache",
                  type(cache).__name__, CHUNK["not_cache"])
        ck.expect(isinstance(logits, torch.Tensor), name, case, f"a torch.Tensor of shape ({V},)",
                  type(logits).__name__, CHUNK["logits_type"])
        shapes, want = [shape for shape, *_ in log], _chunk_sizes(L, chunk)
        ck.expect(all(s is not None and len(s) == 2 and s[0] == 1 for s in shapes), name, case,
                  "passes of shape (1, chunk)", f"passes of shapes {shapes}", CHUNK["batch_dim"])
        sizes = [s[1] for s in shapes]
        ck.expect(sizes == want, name, case, f"{len(want)} passes of {want} tokens",
                  f"{len(sizes)} passes of {sizes} tokens", _chunk_size_hint(L, chunk, sizes))
        _one_cache(name, case, log, [sum(want[:i]) for i in range(len(want))], CHUNK, "chunk")
        logits = logits.detach().cpu().to(ref_logits.dtype)
        ck.expect_tensor(name, case, logits, ref_logits, mistakes={
            CHUNK["first_chunk"]: lambda: first_chunk_logits} if L > chunk else None, hints={
            "shape": CHUNK["squeeze" if logits.numel() == V else "last_only"].format(
                V=V, shape=tuple(logits.shape)), "nan": CHUNK["logits"],
            "close": CHUNK["logits"]})
        ck.expect(cache.get_seq_length() == L, name, case, f"cache length {L}",
                  f"cache length {cache.get_seq_length()}", CHUNK["cache_length"])
        n_layer = len(cache.keys)
        for which, (a, b) in enumerate(zip(ref_cache.keys + ref_cache.values,
                                           cache.keys + cache.values)):
            what, layer = ("keys", "values")[which // n_layer], which % n_layer
            ck.expect(b.shape[:2] == a.shape[:2] and b.shape[-1] == a.shape[-1]
                      and ck.close(b[:, :, :L].cpu(), a[:, :, :L]), name, case,
                      f"layer {layer}'s {what} equal to a one-pass prefill's (within 1e-5)",
                      f"layer {layer}'s {what} differ", CHUNK["kv"])
    ck.passed(name, len(cases))


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
    if type(got).__module__ == "numpy" or not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ck.Refused(COST["not_pair"])
    for label, raw in zip(("FLOPs", "bytes"), got):
        if ck.as_int(raw) is None:
            raise ck.Refused(COST["not_int"].format(label=label, type=type(raw).__name__))
    return ck.as_int(got[0]), ck.as_int(got[1])


def _cost_hint(answers: list) -> str:
    """No one mistake explains the answers (two at once?): name the FLOPs' own, else the bytes'."""
    for i, fallback in ((0, COST["flops"]), (1, COST["bytes"])):  # one of them is wrong
        wrong = [(case, got[i]) for case, got in answers if got[i] != bench.pass_cost(*case)[i]]
        if wrong:
            return ck.diagnose({COST[m]: lambda *case, m=m, i=i: _cost(*case, mistake=m)[i]
                                for m in COST_MISTAKES}, wrong) or fallback


PASS_COST = ck.Exercise(  # (4, 12) first, in fp32 and bf16: every usual mistake differs there
    "pass_cost",
    cases=[(cfg, n_new, n_cached, *bpv) for cfg in [GPTConfig.preset(p) for p in (
               "gpt2", "target", "draft", "tiny")] + [GPTConfig(
               vocab_size=97, block_size=64, n_layer=3, n_head=2, n_embd=10)]
           for n_new, n_cached in [(4, 12), (1, 0), (1, 16), (1, 999), (16, 0), (256, 0), (7, 3)]
           for bpv in ([(), (2,)] if (n_new, n_cached) == (4, 12) else [()])],
    describe=lambda cfg, n_new, n_cached, bpv=4: (
        f"GPTConfig(vocab_size={cfg.vocab_size}, n_layer={cfg.n_layer}, n_embd={cfg.n_embd}), "
        f"n_new={n_new}, n_cached={n_cached}" + (f", bytes_per_value={bpv}" if bpv != 4 else "")),
    reference=bench.pass_cost, solution=_cost, returns=_two_ints, forbid=(bench.pass_cost,),
    mistakes={COST[m]: functools.partial(_cost, mistake=m) for m in COST_MISTAKES},
    otherwise=_cost_hint)
check_pass_cost = PASS_COST.check
EXERCISES = [PASS_COST]


# --- exercise 4: predict, then measure: a batched decode step's intensity -----------------------
BATCH, CACHED, BF16 = 64, 1000, 2  # predict_batched_intensity()'s batch, then others
H100_BALANCE = 989e12 / 3.35e12  # NVIDIA H100 SXM datasheet: dense bf16 FLOP/s over HBM3 bytes/s


def _batched_decode(cfg, batch: int, bpv: int = BF16, keys_only: bool = False) -> float:
    """FLOPs per byte of one decode pass over `batch` sequences of CACHED tokens each: every row
    its own arithmetic, K/V and embedding rows, the weights read once for the whole batch."""
    weights = bench.pass_cost(cfg, 0, 0, bpv)[1]  # no token fed: the weights alone
    flops, moved = bench.pass_cost(cfg, 1, CACHED, bpv)
    own = moved - weights - keys_only * cfg.n_layer * cfg.n_embd * (CACHED + 1) * bpv
    return batch * flops / (weights + batch * own)


@ck.guarded
def check_predict_batched_intensity(predict_batched_intensity) -> None:
    name, cfg = "predict_batched_intensity", GPTConfig.preset("gpt2")
    for batch in (None, 1, 8, 512):
        args, b = (() if batch is None else (batch,)), batch or BATCH
        call = f"{name}({', '.join(map(str, args))})"
        got = ck.prediction(name, call, lambda: predict_batched_intensity(*args), GPT.forward,
                            generate)
        value = got if isinstance(got, (int, float)) and not isinstance(got, bool) else None
        if isinstance(got, torch.Tensor) and got.numel() == 1 or type(got).__module__ == "numpy":
            value = float(got)
        if value is None or not value > 0:
            ck.fail(name, call, "a positive number (FLOPs per byte)", got, INT["refused"])
        want, weights = _batched_decode(cfg, b), bench.pass_cost(cfg, 0, 0, BF16)[1]
        if abs(value - want) <= 0.3 * want:
            if batch is None:
                message = (f"✓ {name}: you predicted {value:.3g}; the cost model gives "
                           f"{want:.2f} FLOPs per byte, far below an H100's balance point "
                           f"({H100_BALANCE:.0f}): the K/V reads dominate")
            continue
        single = bench.pass_cost(cfg, 1, CACHED, BF16)
        numbers = dict(batch=b, cached=CACHED, kv_one=(single[1] - weights) / 1e6,
                       weights=weights / 1e6)
        no_kv = b * single[0] / (weights + b * 2 * cfg.n_embd * BF16)
        hint = next((INT[key] for v, key in [
            *([(_batched_decode(cfg, BATCH), "batch")] if batch else []),
            (b * single[0] / single[1], "times_batch"),
            (b * _batched_decode(cfg, 1, 4), "fp32_times_batch"), (no_kv, "no_kv"),
            (no_kv / 2, "fp32_no_kv"), (single[0] / single[1], "one_sequence"),
            (_batched_decode(cfg, 1, 4), "fp32_one_sequence"), (want / 2, "fp32"),
            (_batched_decode(cfg, b, keys_only=True), "keys_only")]
            if abs(value - v) <= 0.1 * v), INT["otherwise"])
        ck.fail(name, f"one decode pass of GPT-2 small in bf16 over {b} sequences, each with "
                f"{CACHED:,} tokens cached ({call})", f"{want:.2f} FLOPs per byte (within 30%: "
                f"{0.7 * want:.2f} to {1.3 * want:.2f})", f"{value:.4g}",
                hint.format(shared=INT["shared"].format(**numbers), **numbers))
    print(message)


# --- exercise 5: debug a decoder ----------------------------------------------------------------
def _decoder_error_hint(e: Exception) -> str:
    return FIX["dims" if "idx must have shape" in str(e) else
               "flat" if "outside the vocabulary" in str(e) else "overflow"
               if "KV cache overflow" in str(e) or "exceeds block_size" in str(e) else "raised"]


@ck.guarded
def check_decoder(FixedDecoder) -> None:
    name, tiny = "FixedDecoder", ck.tiny_model(1)
    ck.expect(isinstance(FixedDecoder, type), name, "FixedDecoder", "a class",
              type(FixedDecoder).__name__, FIX["not_class"])
    target, tok = load_course_model("target", "cpu")
    cases = [(tiny, [7], 6, "a tiny random model, a 1-token prompt"),
             (tiny, [5, 9, 11], 12, "a tiny random model"),
             (ck.tiny_model(4, n_layer=3), [3, 1, 4, 1, 5, 9, 2, 6, 5], 20,
              "a 3-layer random model"), (target, tok.encode("The color of dog"), 8,
                                          "the course target")]
    for i, (model, prompt, n, label) in enumerate(cases):
        case, P = f"{label}: FixedDecoder(model).generate({prompt}, {n})", len(prompt)
        want = generate(model, prompt, n, mode="cached").tokens
        decoder = ck.call(name, f"{label}: FixedDecoder(model)", FixedDecoder, model)
        with _pass_log(model) as log, ck.forbid(name, generate):
            got = ck.call_hinted(name, case, _decoder_error_hint, decoder.generate, list(prompt),
                                 n)
        tokens, shapes = _token_list(name, case, want, got), [shape for shape, *_ in log]
        ck.expect(len(shapes) < 2 or shapes[1] == (1, 1), name, case,
                  f"passes of shapes [(1, {P}), (1, 1), ...]", _shapes(shapes, 5), FIX[
                      "every_position" if shapes[1:2] == [(1, P)] else "decode"].format(
                      P=P, hides=FIX["hides"] if i > 0 else ""))
        _check_decode_passes(name, case, prompt, log)
        ck.expect(tokens == want, name, case, want, tokens, FIX["other_position"] if len(
            tokens) > 1 and tokens[1] == _first_position(model, prompt, 2)[1] != want[1]
            else FIX["otherwise"])
        ck.expect(len(shapes) == len(want), name, case, f"{len(want)} forward passes",
                  f"{len(shapes)}", FIX["passes"])
    ck.passed(name, len(cases))


# --- exercise 6: design: a chunk size for chunked prefill ---------------------------------------
CHUNK_PROMPT = 1000  # choose_chunk()'s prompt, then others where a wrong rule shows


def _chunk_intensities(cfg: GPTConfig, chunk: int, prompt: int = CHUNK_PROMPT) -> list:
    """(tokens, cached before, FLOPs per byte in bf16) of every pass of a chunked prefill."""
    return [(min(chunk, prompt - done), done, (lambda f, m: f / m)(*bench.pass_cost(
        cfg, min(chunk, prompt - done), done, BF16))) for done in range(0, prompt, chunk)]


@ck.guarded
def check_choose_chunk(choose_chunk) -> None:
    name, cfg, default = "choose_chunk", GPTConfig.preset("gpt2"), None
    for prompt in (None, 866, 1294):
        args, P = (() if prompt is None else (prompt,)), prompt or CHUNK_PROMPT
        got = ck.call(name, f"choose_chunk({', '.join(map(str, args))})", choose_chunk, *args)
        chunk = ck.as_int(got)
        case = (f"chunked prefill of a {P:,}-token prompt, GPT-2 small, bf16, on an H100 "
                f"(balance point {H100_BALANCE:.0f} FLOPs per byte)")
        if chunk is None or chunk < 1:
            ck.fail(name, case, "a chunk size, a positive int", got, CH["refused"])
        best = next(c for c in range(1, P + 1)
                    if min(i for _, _, i in _chunk_intensities(cfg, c, P)) >= H100_BALANCE)
        rows = _chunk_intensities(cfg, min(chunk, P), P)
        shown = ", ".join(f"{n} tokens after {done}: {i:.0f}" for n, done, i in rows[:4])
        if chunk != best and prompt and chunk == default:
            ck.fail(name, case, f"chunk={best}", f"chunk={chunk}: {shown}",
                    CH["prompt"].format(prompt=P))
        slow = [(k, n, done, i) for k, (n, done, i) in enumerate(rows) if i < H100_BALANCE]
        if slow:
            k, n, done, intensity = slow[0]
            hint = CH["slow"].format(k=k + 1, n=n, done=done, intensity=intensity)
            if k > 0 and k == len(rows) - 1:
                hint += CH["remainder"].format(prompt=P, done=done, n=n)
                if _chunk_intensities(cfg, chunk)[0][2] >= H100_BALANCE \
                        > _chunk_intensities(cfg, chunk - 1)[0][2]:  # ONE prefill's crossover
                    hint += CH["one_prefill"].format(chunk=chunk, prompt=P)
            elif k == 0:
                hint += CH["full_chunk"] + (CH["cpu"] if chunk in (11, 12, 18) else "")
            ck.fail(name, case, f"every pass at {H100_BALANCE:.0f} FLOPs per byte or more",
                    f"chunk={chunk}: {shown}{' ...' if len(rows) > 4 else ''}", hint)
        ck.expect(chunk < P, name, case, "a chunk that splits the prompt",
                  f"chunk={chunk}: one pass", CH["no_chunking"])
        ck.expect(chunk == best, name, case, "the smallest chunk that keeps every pass "
                  "compute-bound", f"chunk={chunk}: " + ", ".join(
                      f"{n} tokens after {done}: {i:.0f}" for n, done, i in rows), CH["smaller"])
        if prompt is None:
            default, message = chunk, (
                f"✓ {name}: chunks of {chunk}: " + ", ".join(
                    f"{n} tokens after {done} cached do {i:.0f} FLOPs per byte"
                    for n, done, i in rows)
                + f"; none smaller keeps every pass at {H100_BALANCE:.0f} or more")
    print(message)
