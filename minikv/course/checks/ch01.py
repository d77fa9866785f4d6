"""Checkers for chapter 01 (seed 002, prefill and decode): greedy_decode and chunked_prefill (the
tokens, logits and every layer's K/V against the engine, every forward pass logged), pass_cost (a
table, against bench.pass_cost), predict_batched_intensity (predict, then measure), FixedDecoder
(debug) and choose_chunk (design: an H100's balance point). Each usual mistake is named."""
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
    diagnose,
    expect,
    fail,
    forbid,
    guarded,
    passed,
    prediction,
    tiny_model,
)


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
    if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
        fail(name, case, expected, got, f"return a Python list of ints, not a "
             f"{type(got).__module__}.{type(got).__name__} (collect int(token) in a list, or "
             f"call .tolist())")
    if not isinstance(got, (list, tuple)):
        fail(name, case, expected, got, f"return a list of token ids, not a {type(got).__name__}")
    for t in got:
        if as_int(t) is None:
            fail(name, case, expected, list(got), f"every token id must be an int, got {t!r} "
                 f"({type(t).__name__}): int(logits[0, -1].argmax())")
    return [as_int(t) for t in got]


def _shapes(shapes: list, k: int = 8) -> str:
    return f"passes of shapes {shapes[:k]}{' ...' if len(shapes) > k else ''}"


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
    if not shapes:
        fail(name, case, f"a first pass of shape (1, {P})", "no forward pass of the model",
             "call model(idx, cache=cache): the prefill on the whole prompt, then one pass per "
             "new token")
    if shapes[0] != (1, P):
        hint = f"the prefill feeds the whole prompt in ONE pass, idx of shape (1, {P})"
        if P > 1 and shapes[:P] == [(1, 1)] * P:
            hint = ("this is what you get when you prefill the prompt one token at a time: feed "
                    "the whole prompt in one pass, that is what a prefill is")
        elif P > 1 and shapes[0] == (1, P - 1):
            hint = ("this is what you get when the prefill leaves out the prompt's last token "
                    "and feeds it in a second pass: the prefill's last position already gives "
                    "the first new token")
        elif shapes[0] is not None and len(shapes[0]) != 2:
            hint = "idx must have shape (1, T): a batch of one sequence, torch.tensor([ids])"
        fail(name, case, f"first pass of shape (1, {P}) (the prefill)", _shapes(shapes), hint)
    for i, shape in enumerate(shapes[1:], 1):
        if shape != (1, 1):
            hint = "each decode pass feeds only the newest token, idx of shape (1, 1)"
            if shape == (1, P + i):
                hint = ("this is what you get when you recompute the whole sequence every step "
                        "(naive decoding): with a KV cache, feed only the newest token")
            fail(name, case, f"pass {i + 1} of shape (1, 1) (a decode pass)", _shapes(shapes),
                 hint)
    for i, (_, cache, length, positions) in enumerate(log):
        if cache is None:
            fail(name, case, "every pass given the cache", f"pass {i + 1} ran without a cache",
                 "call model(idx, cache=cache) every time: without the cache, a decode pass sees "
                 "only its own token")
        if cache is not log[0][1]:
            fail(name, case, "every pass into the cache the prefill filled",
                 f"pass {i + 1} got a different cache object",
                 "this is what you get when you make a new cache every step: make one cache "
                 "before the loop and give it to every pass (it holds the earlier positions)")
        if length != (0 if i == 0 else P + i - 1):
            fail(name, case, f"cache length {0 if i == 0 else P + i - 1} before pass {i + 1}",
                 f"cache length {length}",
                 "start from an empty cache and never crop or reset it: it must hold every "
                 "position fed so far")
        right = list(range(P)) if i == 0 else [P + i - 1]
        if positions is not None and positions != right:
            hint = ("leave positions out: the model starts them where the cache ends, "
                    "cache.get_seq_length()")
            if i > 0 and positions == [0]:
                hint = ("this is seed 003's bug (chapter 02): positions restart at 0 every "
                        "step; a decode pass sits at the next position, " + hint)
            fail(name, case, f"pass {i + 1} at positions {right}", f"positions {positions}",
                 hint)


def _decode_token_hint(model, prompt, n, eos_id, expected, got) -> str:
    if eos_id is not None and expected and expected[-1] == eos_id:
        if got == expected[:-1]:
            return ("this is what you get when you drop the EOS: the token that stops generation "
                    "is part of the result (append it, then stop)")
        if len(got) > len(expected) and got[:len(expected)] == expected:
            return ("this is what you get when you do not stop at EOS: stop right after "
                    "emitting eos_id")
    if got == expected[:-1]:
        return "one token short: return max_new_tokens tokens (or up to and including the EOS)"
    if len(got) > n:
        return f"more than max_new_tokens={n} tokens"
    if got == _first_position(model, prompt, n, eos_id):
        return ("this is what you get when the first token comes from the prefill's FIRST "
                "position: use the last position's logits, logits[0, -1]")
    return "pick argmax of the last position's logits each pass; stop right after eos_id"


@guarded
def check_greedy_decode(greedy_decode) -> None:
    """greedy_decode(model, prompt_ids, max_new_tokens, eos_id) == generate(...).tokens, in one
    (1, T) prefill and (1, 1) passes into one cache, without calling minikv.generate."""
    name, model = "greedy_decode", tiny_model(1)
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
        n_passes = len(log)
        hint = f"one pass per new token: {len(expected)} passes for {len(expected)} tokens"
        if n_passes == len(expected) + 1:
            hint = ("this is what you get when you feed the last token too: it is returned, "
                    "never fed (there is no next token to compute from it)")
        expect(n_passes == len(expected), name, case, f"{len(expected)} forward passes",
               f"{n_passes} forward passes", hint)
    passed(name, len(cases))


# --- exercise 2: chunked prefill ----------------------------------------------------------------

def _chunk_sizes(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - i) for i in range(0, length, chunk)]


def _chunk_size_hint(length: int, chunk: int, sizes: list[int]) -> str:
    expected = _chunk_sizes(length, chunk)
    if sizes == expected[:-1] and length % chunk:
        return ("this is what you get when the last, shorter chunk is dropped: it holds the "
                f"last {length % chunk} token(s) (range(0, len(ids), chunk) keeps it)")
    for other in (chunk - 1, chunk + 1):
        if other >= 1 and sizes == _chunk_sizes(length, other):
            return (f"chunk sizes off by one: this is what you get with chunks of {other} tokens "
                    f"instead of {chunk}")
    if sizes == [min(chunk + 1, length - i) for i in range(0, length, chunk)]:
        return ("chunks overlap by one token (ids[i:i + chunk + 1]): off by one; each token is "
                "fed exactly once, ids[i:i + chunk]")
    if sizes == [length] and chunk < length:
        return f"this is one pass over the whole prompt: feed it in chunks of {chunk} tokens"
    if sizes == [1] * length and chunk > 1:
        return f"this feeds one token per pass: a chunk holds {chunk} tokens"
    return (f"{len(expected)} passes of {expected} tokens: chunks of `chunk` tokens, the last "
            f"may be shorter")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)


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
    name, n_cases = "chunked_prefill", 0
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
                 "return a pair: the last position's logits AND the cache")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            fail(name, case, "(logits, cache)", got if not isinstance(got, (tuple, list))
                 else f"a {type(got).__name__} of {len(got)} items",
                 "return a pair (logits, cache)")
        logits, cache = got
        if isinstance(logits, KVCache) and isinstance(cache, torch.Tensor):
            fail(name, case, "(logits, cache)", "(cache, logits)", "return them in that order: "
                 "(logits, cache)")
        if not isinstance(cache, KVCache):
            fail(name, case, "a minikv.KVCache", type(cache).__name__,
                 "return the KVCache you filled as the second item")
        if type(logits).__module__ == "numpy" or not isinstance(logits, torch.Tensor):
            fail(name, case, f"a torch.Tensor of shape ({V},)", type(logits).__name__,
                 "return the logits as a torch.Tensor (no .numpy(), no .tolist())")
        logits = logits.detach().cpu()
        shapes, want = [shape for shape, *_ in log], _chunk_sizes(L, chunk)
        if any(s is None or len(s) != 2 or s[0] != 1 for s in shapes):
            fail(name, case, "passes of shape (1, chunk)", f"passes of shapes {shapes}",
                 "feed idx of shape (1, chunk): a batch of one sequence")
        sizes = [s[1] for s in shapes]
        expect(sizes == want, name, case, f"{len(want)} passes of {want} tokens",
               f"{len(sizes)} passes of {sizes} tokens", _chunk_size_hint(L, chunk, sizes))
        for i, (_, c, length, positions) in enumerate(log):
            start = sum(want[:i])
            if c is None:
                fail(name, case, "every chunk fed into the cache", f"chunk {i + 1} had no cache",
                     "call model(chunk_ids, cache=cache) for every chunk")
            if c is not log[0][1]:
                fail(name, case, "one cache for every chunk",
                     f"chunk {i + 1} went into a different cache",
                     "this is what you get with a fresh cache per chunk: each chunk must attend "
                     "to the keys and values of the chunks before it, so make ONE cache first")
            if length != start:
                fail(name, case, f"cache length {start} before chunk {i + 1}",
                     f"cache length {length}", "start from an empty cache, never crop it")
            right = list(range(start, start + want[i]))
            if positions is not None and positions != right:
                hint = (f"chunk {i + 1} must sit at positions {right[0]}..{right[-1]}: leave "
                        f"positions out and the model continues from cache.get_seq_length()")
                if i > 0 and positions and positions[0] == 0:
                    hint = ("this is seed 003's bug (chapter 02): positions restart at 0 in "
                            "every chunk; they must continue where the cache ends (leave "
                            "positions out, the model starts at cache.get_seq_length())")
                fail(name, case, f"positions {right}", f"positions {positions}", hint)
        if tuple(logits.shape) != (V,):
            hint = f"the last position's logits only, shape ({V},): logits[0, -1]"
            if logits.numel() == V:
                hint = f"squeeze them to shape ({V},): logits[0, -1], not {tuple(logits.shape)}"
            fail(name, case, f"logits of shape ({V},)", f"shape {tuple(logits.shape)}", hint)
        if not _close(logits, ref_logits):
            hint = "the logits of the prompt's last position, from the last chunk's pass"
            if L > chunk and _close(logits, first_chunk_logits):
                hint = ("this is what you get when you return the FIRST chunk's logits: the "
                        "last chunk's last position predicts the next token")
            error = float((logits.double() - ref_logits.double()).abs().max())
            fail(name, case, "a one-pass prefill's last logits, within 1e-5",
                 f"logits off by up to {error:.3g}", hint)
        expect(cache.get_seq_length() == L, name, case, f"cache length {L}",
               f"cache length {cache.get_seq_length()}",
               "the cache holds every prompt position once")
        theirs, n_layer = cache.keys + cache.values, len(cache.keys)
        for which, (a, b) in enumerate(zip(ref_cache.keys + ref_cache.values, theirs)):
            kind, layer = ("keys", "values")[which // n_layer], which % n_layer
            if b.shape[:2] != a.shape[:2] or b.shape[-1] != a.shape[-1] or \
                    not _close(b[:, :, :L].cpu(), a[:, :, :L]):
                fail(name, case, f"layer {layer}'s {kind} equal to a one-pass prefill's "
                     f"(within 1e-5)", f"layer {layer}'s {kind} differ",
                     "the cache you return holds what the passes wrote, in every layer, keys "
                     "and values: each chunk into the same cache at the positions that continue "
                     "it, and nothing changed after the last chunk")
        n_cases += 1
    passed(name, n_cases)


# --- exercise 3: what a pass costs (a table) ---------------------------------------------------

def _cost(cfg: GPTConfig, n_new: int, n_cached: int, bpv: int = 4, mistake: str | None = None):
    """(FLOPs, bytes) by minikv.bench.pass_cost's convention, or as a usual mistake gives it."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    pairs = n_new * n_cached + n_new * (n_new + 1) // 2
    if mistake == "rectangle":
        pairs = n_new * (n_cached + n_new)
    elif mistake == "no diagonal":
        pairs = n_new * n_cached + n_new * (n_new - 1) // 2
    head_rows = n_new if mistake == "head on every row" else 1
    attention = {"q·k only": 2 * C * L * pairs, "no attention": 0}.get(mistake, 4 * C * L * pairs)
    flops = 2 * (n_new * L * 12 * C * C + head_rows * V * C) + attention
    if mistake == "multiply-adds":
        flops //= 2
    embeddings = {"embeddings whole": V * C + cfg.block_size * C}.get(mistake, 2 * n_new * C)
    head = 0 if mistake == "head not read" else V * C
    small = 0 if mistake == "no biases" else L * 13 * C + 2 * C
    weights = L * 12 * C * C + small + head + embeddings
    positions = {"no cached K/V": n_new, "no new K/V": n_cached}.get(mistake, n_cached + n_new)
    kv = (1 if mistake == "K only" else 2) * L * C * positions
    return flops, (weights + kv) * {"elements": 1, "always 4 bytes": 4}.get(mistake, bpv)


COST_MISTAKES = {
    "rectangle": "this is what you get when you count the full rectangle n_new × (n_cached + "
                 "n_new) of (query, key) pairs: under the causal mask new query i sees only "
                 "n_cached + i keys (a triangle on the new part)",
    "no diagonal": "this is what you get when a query does not see its own key: new query i "
                   "sees n_cached + i keys, itself included",
    "head on every row": "this is what you get with the LM head on every row: generate computes "
                         "logits for the last position only (V·C multiply-adds once)",
    "q·k only": "this is what you get when attention counts only q·k: the weights·v product "
                "costs as much again (2·C multiply-adds per pair and layer in all)",
    "no attention": "this is what you get when attention's own arithmetic is left out: q·k and "
                    "weights·v, 2·C multiply-adds per (query, key) pair and layer",
    "multiply-adds": "this is what you get when you count multiply-adds: a multiply-add is 2 "
                     "FLOPs",
    "embeddings whole": "this is what you get when the embeddings are counted whole: a pass "
                        "reads only the n_new rows of wte and of wpe it looks up (all of wte is "
                        "read once more, as the LM head)",
    "head not read": "this is what you get when you forget the LM head's read: tied to wte, "
                     "it still reads all V·C values of it",
    "no biases": "this is what you get without the biases and LayerNorms in the bytes: "
                 "13·C per layer and 2·C for ln_f",
    "no cached K/V": "this is what you get when you forget reading the cached K/V: attention "
                     "reads all n_cached positions' keys and values in every layer",
    "no new K/V": "this is what you get when you forget writing the new K/V: n_new positions' "
                  "keys and values go into the cache in every layer",
    "K only": "this is what you get when you count only the keys: the cache holds a key AND a "
              "value per position and layer (2·C values)",
    "elements": "this is what you get when you count values, not bytes: multiply by "
                "bytes_per_value",
    "always 4 bytes": "this is what you get with 4 bytes per value whatever bytes_per_value "
                      "says: use the argument (2 for fp16 or bf16)",
}
FLOPS_HINT = ("2 FLOPs per multiply-add, of every matrix product: each block's weight matrices on "
              "every new token, the LM head on one row, attention's two products for every "
              "(query, key) pair the mask lets through, in every layer")
BYTES_HINT = ("weights of the blocks and ln_f, n_new rows of wte and wpe, all of wte as the head, "
              "the cached K/V read and the new K/V written, times bytes_per_value")


def _two_ints(got, *case) -> tuple[int, int]:
    """The contract: a pair of ints (FLOPs, bytes)."""
    if type(got).__module__ == "numpy" or not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Refused("return a pair of ints: (flops, bytes)")
    for label, raw in zip(("FLOPs", "bytes"), got):
        if as_int(raw) is None:
            raise Refused(f"{label} must be an int, not a {type(raw).__name__}: count with "
                          f"integers (// not /, no float())")
    return as_int(got[0]), as_int(got[1])


def _cost_hint(answers: list) -> str:
    """No one mistake explains the answers (two at once?): name the FLOPs' own, else the bytes'."""
    for i, fallback in ((0, FLOPS_HINT), (1, BYTES_HINT)):  # one of them is wrong
        wrong = [(case, got[i]) for case, got in answers if got[i] != bench.pass_cost(*case)[i]]
        if wrong:
            return diagnose({hint: lambda *case, m=m, i=i: _cost(*case, mistake=m)[i]
                             for m, hint in COST_MISTAKES.items()}, wrong) or fallback


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
    mistakes={hint: functools.partial(_cost, mistake=m) for m, hint in COST_MISTAKES.items()},
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
    name = "predict_batched_intensity"
    got = prediction(name, f"{name}()", predict_batched_intensity, GPT.forward, generate)
    value = got if isinstance(got, (int, float)) and not isinstance(got, bool) else None
    if isinstance(got, torch.Tensor) and got.numel() == 1 or type(got).__module__ == "numpy":
        value = float(got)
    if value is None or not value > 0:
        fail(name, f"{name}()", "a positive number (FLOPs per byte)", got,
             "return the intensity you predict, a number such as 12.5")
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
    kv_one, no_kv = single[1] - weights, flops / (weights + BATCH * 2 * cfg.n_embd * BF16)
    fp32, keys = bench.pass_cost(cfg, 1, CACHED, 4), _batched_decode(cfg, BATCH, CACHED, BF16, True)
    shared = (f"right for the weights (one read of each serves all {BATCH} rows), wrong for the "
              f"cache: every sequence reads its own K/V, {kv_one / 1e6:.1f} MB each at "
              f"{CACHED:,} tokens; {BATCH} of them outweigh the {weights / 1e6:.0f} MB of "
              f"weights many times over")
    candidates = [
        (BATCH * single[0] / single[1], f"you multiplied one sequence's decode intensity by "
                                        f"{BATCH}: {shared}"),
        (BATCH * fp32[0] / fp32[1], f"you multiplied one sequence's fp32 decode intensity by "
                                    f"{BATCH} (this pass is bf16, 2 bytes a value): {shared}"),
        (no_kv, f"that is the intensity with the weights read once for all {BATCH} rows AND no "
                f"cache read: every sequence reads its own K/V, {kv_one / 1e6:.1f} MB each at "
                f"{CACHED:,} tokens, {BATCH} x that is far more than the {weights / 1e6:.0f} MB "
                f"of weights"),
        (no_kv / 2, "that is the fp32 intensity with no cache read: bf16 is 2 bytes a value, and "
                    "every sequence reads its own K/V"),
        (single[0] / single[1], f"that is ONE sequence's decode intensity: batching does help "
                                f"(one read of each weight serves all {BATCH} rows), only the "
                                f"cache reads are not shared"),
        (fp32[0] / fp32[1],
         "that is one sequence's decode intensity in fp32: this pass is bf16 (2 bytes a value) "
         "and batched"),
        (want / 2, "that is the intensity in fp32 (4 bytes a value): this pass is bf16, 2 bytes"),
        (keys[0] / keys[1],
         "you counted only the keys: every cached position holds a key AND a value, per layer"),
    ]
    hint = next((h for v, h in candidates if abs(value - v) <= 0.1 * v),
                f"count the FLOPs of {BATCH} rows (each its own matrix products and attention) "
                f"against the bytes: the weights once, plus each sequence's cached K/V")
    fail(name, case, f"{want:.2f} FLOPs per byte (within 30%: {0.7 * want:.2f} to "
                     f"{1.3 * want:.2f})", f"{value:.4g}", hint)


# --- exercise 5: debug a decoder ----------------------------------------------------------------

def _decoder_error_hint(e: Exception) -> str:
    text = str(e)
    if "idx must have shape" in text:
        return ("a decode pass takes idx of shape (1, 1), a batch of one sequence of one token: "
                "keep both dimensions (logits[:, -1:] keeps them, logits[0, -1] drops them)")
    if "outside the vocabulary" in text:
        return ("that token id is past the vocabulary: argmax over the whole (1, T, vocab) tensor "
                "returns a flat index; take the argmax over the vocabulary (dim=-1)")
    if "KV cache overflow" in text or "exceeds block_size" in text:
        return ("the cache filled up: each decode pass appended more than one position. A decode "
                "pass feeds only the newest token")
    return "your decoder raised on this input"


@guarded
def check_decoder(FixedDecoder) -> None:
    """FixedDecoder(model).generate(prompt_ids, max_new_tokens) == generate(..., mode="cached")
    .tokens, with one (1, P) prefill then (1, 1) passes into one cache."""
    name = "FixedDecoder"
    if not isinstance(FixedDecoder, type):
        fail(name, "FixedDecoder", "a class", type(FixedDecoder).__name__,
             "pass the class itself: class FixedDecoder(CachedDecoder): ...")
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
        passed_short = (" (it passed the 1-token prompt: with one prompt token, the argmax of "
                        "every position is the argmax of the last, so the bug hides)"
                        if i > 0 else "")
        if len(shapes) > 1 and shapes[1] != (1, 1):
            hint = f"a decode pass feeds only the newest token, idx of shape (1, 1){passed_short}"
            if shapes[1] == (1, P):
                hint = (f"the first decode pass fed {P} tokens, as many as the prompt: the "
                        f"argmax of EVERY position of the previous pass (logits.argmax(-1) has "
                        f"shape (1, T)). The first new token comes out right, the rest do not, "
                        f"and the cache grows by {P} a step. A decode pass feeds only the newest "
                        f"token, shape (1, 1){passed_short}")
            fail(name, case, f"passes of shapes [(1, {P}), (1, 1), ...]", _shapes(shapes, 5),
                 hint)
        _check_decode_passes(name, case, prompt, log)
        if tokens != expected:
            hint = "feed the last position's pick, logits[:, -1:].argmax(-1), shape (1, 1)"
            if len(tokens) > 1 and tokens[1] == _first_position(model, prompt, 2)[1] \
                    and tokens[1] != expected[1]:
                hint = ("the decode pass fed the pick of another position than the last (the "
                        "prefill's first, or an argmax over every position at once): the next "
                        "token is the argmax at the LAST position, logits[:, -1:]")
            fail(name, case, expected, tokens, hint)
        expect(len(shapes) == len(expected), name, case, f"{len(expected)} forward passes",
               f"{len(shapes)}", "one pass per new token, the last one returned, never fed")
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
    name = "choose_chunk"
    got = call(name, "choose_chunk()", choose_chunk)
    chunk = as_int(got)
    case = (f"chunked prefill of a {CHUNK_PROMPT:,}-token prompt, GPT-2 small, bf16, on an H100 "
            f"(balance point {H100_BALANCE:.0f} FLOPs per byte)")
    if chunk is None or chunk < 1:
        fail(name, case, "a chunk size, a positive int", got, "return the chunk size you choose")
    cfg = GPTConfig.preset("gpt2")
    best = next(c for c in range(1, CHUNK_PROMPT + 1)
                if min(i for _, _, i in _chunk_intensities(cfg, c)) >= H100_BALANCE)
    rows = _chunk_intensities(cfg, min(chunk, CHUNK_PROMPT))
    slow = [(k, n, done, i) for k, (n, done, i) in enumerate(rows) if i < H100_BALANCE]
    if slow:
        k, n, done, intensity = slow[0]
        shown = ", ".join(f"{n} tokens after {done}: {i:.0f}" for n, done, i in rows[:4])
        hint = (f"chunk {k + 1} ({n} tokens after {done} cached) does {intensity:.0f} FLOPs per "
                f"byte, under the balance point: that pass waits on memory")
        if k > 0 and k == len(rows) - 1:
            hint += (f". It is the last chunk, the remainder ({CHUNK_PROMPT} - {done} = {n}): "
                     f"every chunk counts, the shortest one too")
            if _chunk_intensities(cfg, chunk)[0][2] >= H100_BALANCE \
                    > _chunk_intensities(cfg, chunk - 1)[0][2]:  # ONE prefill's crossover
                hint += (f". {chunk} is the crossover of ONE prefill from an empty cache "
                         f"(chapter section 5); cut {CHUNK_PROMPT} tokens into chunks of it and "
                         f"the remainder is far shorter")
        elif k == 0:
            hint += (". A full chunk is already memory-bound: in bf16 a pass of T tokens does "
                     "well under T FLOPs per byte (the LM head runs on one row)")
            if chunk in (11, 12, 18):
                hint += "; that is a CPU's crossover (chapter section 5), not an H100's"
        fail(name, case, f"every pass at {H100_BALANCE:.0f} FLOPs per byte or more",
             f"chunk={chunk}: {shown}{' ...' if len(rows) > 4 else ''}", hint)
    if chunk >= CHUNK_PROMPT:
        fail(name, case, "a chunk that splits the prompt", f"chunk={chunk}: one pass",
             "one pass over the whole prompt is compute-bound, but it is no chunking at all: it "
             "holds up every other request's decode step for the whole prefill. A smaller chunk "
             "keeps every pass compute-bound too")
    if chunk != best:
        fail(name, case, "the smallest chunk that keeps every pass compute-bound",
             f"chunk={chunk}: " + ", ".join(f"{n} tokens after {done}: {i:.0f}"
                                            for n, done, i in rows),
             "every pass is compute-bound, but a smaller chunk also keeps them all so, and "
             "holds up the other requests for less: what limits the chunk is the shortest pass")
    print(f"✓ {name}: chunks of {chunk}: " + ", ".join(
        f"{n} tokens after {done} cached do {i:.0f} FLOPs per byte" for n, done, i in rows)
        + f"; none smaller keeps every pass at {H100_BALANCE:.0f} or more")
