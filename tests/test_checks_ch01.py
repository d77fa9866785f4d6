"""Chapter 01: the checkers accept the solutions, let the exercise stub's NotImplementedError
through, and reject every plausible wrong answer below with a hint that names the mistake."""
import numpy as np
import pytest
import torch

import minikv
import minikv.bench
from minikv.course import checks
from minikv.course.checks import CheckFailed, ch01
from minikv.engine.generate import generate as engine_generate

from conftest import stub

# --- the solutions ------------------------------------------------------------------------------


def greedy_decode(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, idx = [], torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]], device=model.device)
    return tokens


def chunked_prefill(model, ids, chunk):
    cache = minikv.KVCache.for_model(model, max_len=len(ids))
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            logits = model(torch.tensor([ids[start:start + chunk]]), cache=cache)
    return logits[0, -1], cache


def chunked_prefill_explicit_positions(model, ids, chunk):
    """Also right: positions given explicitly, continuing where the cache ends."""
    cache = minikv.KVCache.for_model(model, max_len=len(ids))
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            logits = model(torch.tensor([piece]), cache=cache,
                           positions=torch.arange(start, start + len(piece)))
    return logits[0, -1], cache


def pass_cost(cfg, n_new, n_cached, bytes_per_value=4):
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    pairs = n_new * n_cached + n_new * (n_new + 1) // 2
    flops = 2 * (n_new * L * 12 * C * C + V * C) + 2 * 2 * C * L * pairs
    weights = L * (12 * C * C + 13 * C) + 2 * C + V * C + 2 * n_new * C
    kv = 2 * L * C * (n_cached + n_new)
    return flops, (weights + kv) * bytes_per_value


def test_solutions_pass(capsys):
    state = torch.get_rng_state()
    ch01.check_greedy_decode(greedy_decode)
    ch01.check_chunked_prefill(chunked_prefill)
    ch01.check_chunked_prefill(chunked_prefill_explicit_positions)
    ch01.check_pass_cost(pass_cost)
    ch01.check_pass_cost(lambda *a, **k: tuple(np.int64(v) for v in pass_cost(*a, **k)))
    assert capsys.readouterr().out.count("✓") == 5
    assert torch.equal(torch.get_rng_state(), state), "a checker moved the caller's random state"


@pytest.mark.parametrize("check", [ch01.check_greedy_decode, ch01.check_chunked_prefill,
                                   ch01.check_pass_cost])
def test_stub_raises_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


def test_a_patched_checker_does_not_silence_the_check_cell(monkeypatch):
    """What an exercise cell could do: replace the checker. The check cell's fresh copy runs."""
    monkeypatch.setattr(ch01, "check_greedy_decode", lambda fn: print("✓ (patched)"))
    with pytest.raises(AssertionError, match="called minikv's own"):
        checks.fresh("ch01").check_greedy_decode(returns_generate)


def test_a_replaced_generate_stops_the_check_cell(monkeypatch):
    """Replacing the engine's generate (which the checker compares with) could make anything
    look right: the check cell refuses to run."""
    monkeypatch.setattr(minikv, "generate", lambda *a, **k: None)
    with pytest.raises(AssertionError, match="is not the packaged one"):
        checks.fresh("ch01")


def fails_with(check, wrong, *fragments):
    with pytest.raises(CheckFailed) as info:
        check(wrong)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


# --- exercise 1: the prefill + decode loop ------------------------------------------------------

def prefill_token_by_token(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens = []
    with torch.inference_mode():
        for t in prompt_ids:
            logits = model(torch.tensor([[t]]), cache=cache)
        while True:
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token == eos_id or len(tokens) == max_new_tokens:
                return tokens
            logits = model(torch.tensor([[token]]), cache=cache)


def recompute_everything(model, prompt_ids, max_new_tokens, eos_id=None):
    """Naive decoding: no cache, the whole sequence every step."""
    seq, tokens = list(prompt_ids), []
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            token = int(model(torch.tensor([seq]))[0, -1].argmax())
            tokens.append(token)
            seq.append(token)
            if token == eos_id:
                break
    return tokens


def returns_generate(model, prompt_ids, max_new_tokens, eos_id=None):
    return minikv.generate(model, prompt_ids, max_new_tokens, eos_id=eos_id).tokens


def returns_generate_through_an_alias(model, prompt_ids, max_new_tokens, eos_id=None):
    return engine_generate(model, prompt_ids, max_new_tokens, eos_id=eos_id).tokens


def returns_naive_generate(model, prompt_ids, max_new_tokens, eos_id=None):
    return minikv.generate(model, prompt_ids, max_new_tokens, mode="naive", eos_id=eos_id).tokens


def feeds_the_last_token(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens + 1)
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        logits = model(idx, cache=cache)
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            logits = model(torch.tensor([[token]]), cache=cache)  # one pass too many at the end
            if token == eos_id:
                break
    return tokens


def ignores_eos(model, prompt_ids, max_new_tokens, eos_id=None):
    return greedy_decode(model, prompt_ids, max_new_tokens)


def drops_eos(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            token = int(model(idx, cache=cache)[0, -1].argmax())
            if token == eos_id:
                break
            tokens.append(token)
            idx = torch.tensor([[token]])
    return tokens


def one_token_short(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        while len(tokens) < max_new_tokens - 1:
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


def new_cache_every_step(model, prompt_ids, max_new_tokens, eos_id=None):
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


def cache_only_for_the_prefill(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, logits = [], model(torch.tensor([prompt_ids]), cache=cache)
    with torch.inference_mode():
        while True:
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token == eos_id or len(tokens) == max_new_tokens:
                return tokens
            logits = model(torch.tensor([[token]]))


def returns_a_tensor(model, prompt_ids, max_new_tokens, eos_id=None):
    return torch.tensor(greedy_decode(model, prompt_ids, max_new_tokens, eos_id))


def returns_numpy(model, prompt_ids, max_new_tokens, eos_id=None):
    return np.array(greedy_decode(model, prompt_ids, max_new_tokens, eos_id))


def returns_float_ids(model, prompt_ids, max_new_tokens, eos_id=None):
    return [float(t) for t in greedy_decode(model, prompt_ids, max_new_tokens, eos_id)]


def first_position_logits(model, prompt_ids, max_new_tokens, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            token = int(model(idx, cache=cache)[0, 0].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


def prefill_all_but_last(model, prompt_ids, max_new_tokens, eos_id=None):
    """Hugging Face style: prefill the prompt but its last token, which opens the loop."""
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens = []
    with torch.inference_mode():
        if len(prompt_ids) > 1:
            model(torch.tensor([prompt_ids[:-1]]), cache=cache)
        idx = torch.tensor([prompt_ids[-1:]])
        while len(tokens) < max_new_tokens:
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


def positions_restart_every_step(model, prompt_ids, max_new_tokens, eos_id=None):
    """Seed 003's bug: every pass is given positions from 0."""
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens)
    tokens, idx = [], torch.tensor([prompt_ids])
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            logits = model(idx, cache=cache, positions=torch.arange(idx.shape[1]))
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


@pytest.mark.parametrize("wrong, fragments", [
    (positions_restart_every_step, ["seed 003's bug", "restart at 0 every step"]),
    (prefill_token_by_token, ["prefill the prompt one token at a time"]),
    (recompute_everything, ["recompute the whole sequence every step"]),
    (returns_generate, ["called minikv's own", "generate"]),
    (returns_generate_through_an_alias, ["called minikv's own", "generate"]),
    (returns_naive_generate, ["called minikv's own", "generate"]),
    (feeds_the_last_token, ["feed the last token too"]),
    (ignores_eos, ["do not stop at EOS"]),
    (drops_eos, ["drop the EOS"]),
    (one_token_short, ["one token short"]),
    (new_cache_every_step, ["make a new cache every step"]),
    (cache_only_for_the_prefill, ["ran without a cache"]),
    (returns_a_tensor, ["not a torch.Tensor"]),
    (returns_numpy, ["not a numpy.ndarray"]),
    (returns_float_ids, ["must be an int", "float"]),
    (first_position_logits, ["prefill's FIRST position"]),
    (prefill_all_but_last, ["leaves out the prompt's last token"]),
])
def test_greedy_decode_wrong_answers(wrong, fragments):
    fails_with(ch01.check_greedy_decode, wrong, "greedy_decode: ", *fragments)


# --- exercise 2: chunked prefill ----------------------------------------------------------------

def chunked(model, ids, chunk, *, step=None, width=None, positions_from_zero=False,
            fresh_cache=False, keep_first=False, drop_last=False):
    """chunked_prefill with one of the usual mistakes switched on."""
    step, width = step or chunk, width or chunk
    cache = minikv.KVCache.for_model(model, max_len=2 * len(ids) + 2)
    starts = range(0, len(ids) - (len(ids) % step if drop_last else 0), step)
    first = None
    with torch.inference_mode():
        for start in starts:
            piece = ids[start:start + width]
            if fresh_cache:
                cache = minikv.KVCache.for_model(model, max_len=len(ids))
            positions = torch.arange(len(piece)) if positions_from_zero else None
            logits = model(torch.tensor([piece]), cache=cache, positions=positions)
            first = logits if first is None else first
    return (first if keep_first else logits)[0, -1], cache


def positions_restart_at_zero(model, ids, chunk):
    return chunked(model, ids, chunk, positions_from_zero=True)


def fresh_cache_per_chunk(model, ids, chunk):
    return chunked(model, ids, chunk, fresh_cache=True)


def first_chunks_logits(model, ids, chunk):
    return chunked(model, ids, chunk, keep_first=True)


def chunks_one_too_long(model, ids, chunk):
    return chunked(model, ids, chunk, step=chunk + 1, width=chunk + 1)


def chunks_one_too_short(model, ids, chunk):
    return chunked(model, ids, chunk, step=max(chunk - 1, 1), width=max(chunk - 1, 1))


def chunks_overlap(model, ids, chunk):
    return chunked(model, ids, chunk, width=chunk + 1)


def last_chunk_dropped(model, ids, chunk):
    return chunked(model, ids, chunk, drop_last=True)


def whole_prompt_at_once(model, ids, chunk):
    return chunked(model, ids, len(ids))


def logits_only(model, ids, chunk):
    return chunked_prefill(model, ids, chunk)[0]


def swapped(model, ids, chunk):
    logits, cache = chunked_prefill(model, ids, chunk)
    return cache, logits


def logits_not_squeezed(model, ids, chunk):
    logits, cache = chunked_prefill(model, ids, chunk)
    return logits[None], cache


def every_position_of_the_last_chunk(model, ids, chunk):
    cache = minikv.KVCache.for_model(model, max_len=len(ids))
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            logits = model(torch.tensor([ids[start:start + chunk]]), cache=cache)
    return logits, cache


def logits_as_numpy(model, ids, chunk):
    logits, cache = chunked_prefill(model, ids, chunk)
    return logits.numpy(), cache


def zeroes_the_last_layer(model, ids, chunk):
    """Tidies up the last layer's values "to save memory": only layer 0 looks untouched."""
    logits, cache = chunked_prefill(model, ids, chunk)
    cache.values[-1].zero_()
    return logits, cache


def crops_one_position(model, ids, chunk):
    logits, cache = chunked_prefill(model, ids, chunk)
    cache.crop(len(ids) - 1)
    return logits, cache


@pytest.mark.parametrize("wrong, fragments", [
    (positions_restart_at_zero, ["seed 003's bug", "restart at 0"]),
    (fresh_cache_per_chunk, ["fresh cache per chunk"]),
    (first_chunks_logits, ["return the FIRST chunk's logits"]),
    (chunks_one_too_long, ["off by one", "chunks of 5 tokens instead of 4"]),
    (chunks_one_too_short, ["off by one", "chunks of 3 tokens instead of 4"]),
    (chunks_overlap, ["chunks overlap by one token"]),
    (last_chunk_dropped, ["the last, shorter chunk is dropped"]),
    (whole_prompt_at_once, ["one pass over the whole prompt"]),
    (logits_only, ["return a pair"]),
    (swapped, ["(logits, cache)", "in that order"]),
    (logits_not_squeezed, ["squeeze them to shape (512,)"]),
    (every_position_of_the_last_chunk, ["the last position's logits only"]),
    (logits_as_numpy, ["no .numpy()"]),
    (zeroes_the_last_layer, ["layer 1's values differ", "nothing changed after the last chunk"]),
    (crops_one_position, ["cache length 10"]),
])
def test_chunked_prefill_wrong_answers(wrong, fragments):
    fails_with(ch01.check_chunked_prefill, wrong, "chunked_prefill: ", *fragments)


# --- exercise 3: what a pass costs --------------------------------------------------------------

def cost(cfg, n_new, n_cached, bytes_per_value=4, *, pairs=None, head_rows=1, attention=4,
         flops_per_mac=2, embeddings=None, head=True, small=True, kv=None, k_and_v=2,
         bytes_per=None):
    """pass_cost with one of the usual mistakes switched on."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    pairs = n_new * n_cached + n_new * (n_new + 1) // 2 if pairs is None else pairs
    flops = flops_per_mac * (n_new * L * 12 * C * C + head_rows * V * C) + attention * C * L * pairs
    embeddings = 2 * n_new * C if embeddings is None else embeddings
    weights = (L * 12 * C * C + (L * 13 * C + 2 * C if small else 0) + (V * C if head else 0)
               + embeddings)
    kv = n_cached + n_new if kv is None else kv
    return flops, (weights + k_and_v * L * C * kv) * (bytes_per_value if bytes_per is None
                                                      else bytes_per)


def calls_bench(cfg, n_new, n_cached, bytes_per_value=4):
    return minikv.bench.pass_cost(cfg, n_new, n_cached, bytes_per_value)


def full_rectangle(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, pairs=n_new * (n_cached + n_new))


def query_misses_itself(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value,
                pairs=n_new * n_cached + n_new * (n_new - 1) // 2)


def head_on_every_row(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, head_rows=n_new)


def attention_q_k_only(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, attention=2)


def no_attention_flops(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, attention=0)


def multiply_adds(cfg, n_new, n_cached, bytes_per_value=4):
    flops, moved = cost(cfg, n_new, n_cached, bytes_per_value)
    return flops // 2, moved


def embeddings_whole(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value,
                embeddings=cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd)


def head_not_read(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, head=False)


def no_biases_in_bytes(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, small=False)


def cached_kv_not_read(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, kv=n_new)


def new_kv_not_written(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, kv=n_cached)


def keys_only(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, k_and_v=1)


def elements_not_bytes(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value, bytes_per=1)


def bytes_hardcoded_fp32(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, 4)


def float_flops(cfg, n_new, n_cached, bytes_per_value=4):
    flops, moved = cost(cfg, n_new, n_cached, bytes_per_value)
    return flops / 1, moved


def float_pairs(cfg, n_new, n_cached, bytes_per_value=4):
    """n_new * (n_new + 1) / 2: a true division."""
    return cost(cfg, n_new, n_cached, bytes_per_value,
                pairs=n_new * n_cached + n_new * (n_new + 1) / 2)


def numpy_floats(cfg, n_new, n_cached, bytes_per_value=4):
    return tuple(np.float64(v) for v in cost(cfg, n_new, n_cached, bytes_per_value))


def a_dict(cfg, n_new, n_cached, bytes_per_value=4):
    flops, moved = cost(cfg, n_new, n_cached, bytes_per_value)
    return {"flops": flops, "bytes": moved}


def flops_only(cfg, n_new, n_cached, bytes_per_value=4):
    return cost(cfg, n_new, n_cached, bytes_per_value)[0]


@pytest.mark.parametrize("wrong, fragments", [
    (calls_bench, ["called minikv's own", "pass_cost"]),
    (full_rectangle, ["the FLOPs", "full rectangle"]),
    (query_misses_itself, ["the FLOPs", "does not see its own key"]),
    (head_on_every_row, ["the FLOPs", "LM head on every row"]),
    (attention_q_k_only, ["the FLOPs", "counts only q·k"]),
    (no_attention_flops, ["the FLOPs", "attention's own arithmetic is left out"]),
    (multiply_adds, ["the FLOPs", "a multiply-add is 2 FLOPs"]),
    (embeddings_whole, ["the bytes", "embeddings are counted whole"]),
    (head_not_read, ["the bytes", "forget the LM head's read"]),
    (no_biases_in_bytes, ["the bytes", "without the biases and LayerNorms"]),
    (cached_kv_not_read, ["the bytes", "forget reading the cached K/V"]),
    (new_kv_not_written, ["the bytes", "forget writing the new K/V"]),
    (keys_only, ["the bytes", "count only the keys"]),
    (elements_not_bytes, ["the bytes", "count values, not bytes"]),
    (bytes_hardcoded_fp32, ["bytes_per_value=2", "the bytes", "4 bytes per value whatever"]),
    (float_flops, ["FLOPs must be an int, not a float"]),
    (float_pairs, ["FLOPs must be an int, not a float"]),
    (numpy_floats, ["FLOPs must be an int, not a float64"]),
    (a_dict, ["return a pair of ints"]),
    (flops_only, ["return a pair of ints"]),
])
def test_pass_cost_wrong_answers(wrong, fragments):
    fails_with(ch01.check_pass_cost, wrong, "pass_cost: ", *fragments)


# --- exercise 4: predict, then measure ------------------------------------------------------------
def predict_batched_intensity():
    return 64 * 284e6 / (495e6 / 2 + 64 * 73.7e6 / 2)


def predict_from_the_cost_model():
    """Also right: composed from pass_cost (one row's arithmetic, the weights once)."""
    cfg = minikv.GPTConfig.preset("gpt2")
    weights = pass_cost(cfg, 0, 0, 2)[1]
    flops, moved = pass_cost(cfg, 1, 1000, 2)
    return 64 * flops / (weights + 64 * (moved - weights))


def predict_rough():
    """Also right: attention's arithmetic and the embedding rows left out (13% low)."""
    return 64 * 247e6 / (248e6 + 64 * 37e6)


@pytest.mark.parametrize("wrong, fragments", [
    (lambda: 64.0, ["you multiplied one sequence's decode intensity by 64",
                    "every sequence reads its own K/V"]),
    (lambda: 60, ["you multiplied one sequence's decode intensity by 64"]),
    (lambda: 32.0, ["one sequence's fp32 decode intensity by 64"]),
    (lambda: 73.5, ["no cache read"]),
    (lambda: 1.0, ["that is ONE sequence's decode intensity"]),
    (lambda: 0.5, ["one sequence's decode intensity in fp32"]),
    (lambda: 3.5, ["the intensity in fp32"]),
    (lambda: 12.7, ["you counted only the keys"]),
    (lambda: 20.0, ["the weights once, plus each sequence's cached K/V"]),
    (lambda: None, ["a positive number"]),
    (lambda: "7", ["a positive number"]),
    (lambda: engine_generate(minikv.GPT(minikv.GPTConfig.preset("tiny")), [1], 2).tokens[0],
     ["called minikv's own"]),
])
def test_predict_batched_intensity_wrong_answers(wrong, fragments):
    fails_with(ch01.check_predict_batched_intensity, wrong, "predict_batched_intensity: ",
               *fragments)


# --- exercise 5: debug the decoder ----------------------------------------------------------------
class CachedDecoder:  # the notebook's, as shipped
    def __init__(self, model):
        self.model = model

    def generate(self, prompt_ids, max_new_tokens):
        cache = minikv.KVCache.for_model(self.model)
        idx = torch.tensor([prompt_ids], device=self.model.device)
        tokens = []
        with torch.inference_mode():
            logits = self.model(idx, cache=cache)
            while True:
                tokens.append(int(logits[0, -1].argmax()))
                if len(tokens) == max_new_tokens:
                    return tokens
                logits = self.decode_step(logits, cache)

    def decode_step(self, logits, cache):
        return self.model(logits.argmax(dim=-1), cache=cache)


class FixedDecoder(CachedDecoder):
    def decode_step(self, logits, cache):
        return self.model(logits[:, -1:].argmax(dim=-1), cache=cache)


class FixedDecoderToken(CachedDecoder):  # also right: the picked token as an int, re-wrapped
    def decode_step(self, logits, cache):
        return self.model(torch.tensor([[int(logits[0, -1].argmax())]]), cache=cache)


class DecoderDropsDims(CachedDecoder):
    def decode_step(self, logits, cache):
        return self.model(logits[0, -1].argmax(dim=-1), cache=cache)


class DecoderDropsPositionDim(CachedDecoder):
    def decode_step(self, logits, cache):
        return self.model(logits[:, -1].argmax(dim=-1), cache=cache)


class DecoderFirstPosition(CachedDecoder):
    def decode_step(self, logits, cache):
        return self.model(logits[:, :1].argmax(dim=-1), cache=cache)


class DecoderNoCache(CachedDecoder):
    def decode_step(self, logits, cache):
        return self.model(logits[:, -1:].argmax(dim=-1))


class DecoderCallsGenerate(CachedDecoder):
    def generate(self, prompt_ids, max_new_tokens):
        return minikv.generate(self.model, prompt_ids, max_new_tokens).tokens


@pytest.mark.parametrize("wrong, fragments", [
    (CachedDecoder, ["as many as the prompt", "EVERY position", "the bug hides"]),
    (DecoderDropsDims, ["idx of shape (1, 1)", "keep both dimensions"]),
    (DecoderDropsPositionDim, ["idx of shape (1, 1)", "keep both dimensions"]),
    (DecoderFirstPosition, ["another position than the last"]),
    (DecoderNoCache, ["without the cache"]),
    (DecoderCallsGenerate, ["called minikv's own"]),
    (FixedDecoder(None), ["pass the class itself"]),
])
def test_decoder_wrong_answers(wrong, fragments):
    fails_with(ch01.check_decoder, wrong, "FixedDecoder: ", *fragments)


# --- exercise 6: design: the chunk size ---------------------------------------------------------
@pytest.mark.parametrize("wrong, fragments", [
    (lambda: 439, ["the remainder (1000 - 878 = 122)", "crossover of ONE prefill"]),
    (lambda: 450, ["the remainder (1000 - 900 = 100)"]),
    (lambda: 600, ["the remainder (1000 - 600 = 400)"]),
    (lambda: 256, ["A full chunk is already memory-bound"]),
    (lambda: 12, ["a CPU's crossover"]),
    (lambda: 1000, ["no chunking at all"]),
    (lambda: 4096, ["no chunking at all"]),
    (lambda: 520, ["a smaller chunk also keeps them all so"]),
    (lambda: 0, ["a positive int"]),
    (lambda: 500.0, ["a positive int"]),
])
def test_choose_chunk_wrong_answers(wrong, fragments):
    fails_with(ch01.check_choose_chunk, wrong, "choose_chunk: ", *fragments)


def test_new_exercises_pass_and_leave_the_random_state_alone(capsys):
    state = torch.get_rng_state()
    for right in (predict_batched_intensity, predict_from_the_cost_model, predict_rough):
        ch01.check_predict_batched_intensity(right)
    ch01.check_decoder(FixedDecoder)
    ch01.check_decoder(FixedDecoderToken)
    ch01.check_choose_chunk(lambda: 500)
    assert capsys.readouterr().out.count("✓") == 6
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("check", [ch01.check_predict_batched_intensity, ch01.check_choose_chunk])
def test_new_stubs_raise_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


def test_the_decoder_stub_raises_not_implemented():
    class Stub(CachedDecoder):
        def decode_step(self, logits, cache):
            stub()
    with pytest.raises(NotImplementedError):
        ch01.check_decoder(Stub)


def test_check_cells_follow_their_exercises():
    from conftest import solution_check_cells
    cells = solution_check_cells("01_prefill_decode.ipynb", "ch01")
    for before, cell, _, passed in cells:
        assert f" {passed[0]}(" in before and "✓" in str(cell.outputs)
    assert [called for _, _, called, _ in cells] == [
        "greedy_decode", "chunked_prefill", "pass_cost", "predict_batched_intensity", "decoder",
        "choose_chunk"]
