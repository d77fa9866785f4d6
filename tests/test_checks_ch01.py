"""Chapter 01's checkers written as code (pass_cost is a table: test_checks_table.py): solutions
pass, leaving the random state alone, stubs go through, each wrong answer below gets its hint."""
from functools import partial

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch01
from minikv.engine.generate import generate as engine_generate

from conftest import stub

cost = ch01.PASS_COST.solution


def greedy(model, prompt_ids, max_new_tokens, eos_id=None, *, pieces=lambda p: [p],
           feed=lambda m, idx, cache, i, seq: m(idx, cache=cache), row=-1, short=0,
           drop_eos=False, extra=False):
    """The solution, or with a usual mistake switched on: how the prefill is cut (`pieces`), how a
    pass is run (`feed`), the position picked, stopping early, dropping the EOS, one extra pass."""
    cache = minikv.KVCache.for_model(model, max_len=len(prompt_ids) + max_new_tokens + 1)
    tokens, seq = [], list(prompt_ids)
    with torch.inference_mode():
        for i, piece in enumerate(pieces(seq)):
            logits = feed(model, torch.tensor([piece]), cache, i, seq)
        while True:
            token = int(logits[0, row].argmax())
            if drop_eos and token == eos_id:
                return tokens
            tokens.append(token)
            seq.append(token)
            done = token == eos_id or len(tokens) >= max_new_tokens - short
            if not done or extra:
                logits = feed(model, torch.tensor([[token]]), cache, len(tokens), seq)
            if done:
                return tokens


def chunked(model, ids, chunk, *, step=0, width=0, at=lambda start, n: None, fresh=False,
            keep_first=False, drop_last=False, last=lambda x: x[0, -1]):
    """The solution, or with a usual mistake switched on: chunks chunk + step apart of chunk +
    width tokens, positions at(start, n), a fresh cache per chunk, the first chunk's logits, no
    last chunk, the logits returned as last(logits)."""
    step, width = max(chunk + step, 1), max(chunk + width, 1)
    cache, logits = minikv.KVCache.for_model(model, max_len=2 * len(ids) + 2), []
    with torch.inference_mode():
        for start in range(0, len(ids) - (len(ids) % step if drop_last else 0), step):
            piece = ids[start:start + width]
            if fresh:
                cache = minikv.KVCache.for_model(model, max_len=len(ids))
            logits.append(model(torch.tensor([piece]), cache=cache,
                                positions=at(start, len(piece))))
    return last(logits[0 if keep_first else -1]), cache


def cache_changed(change):
    """chunked, then change(cache) done to the cache it returns."""
    def wrong(model, ids, chunk):
        logits, cache = chunked(model, ids, chunk)
        change(cache)
        return logits, cache
    return wrong


class CachedDecoder:  # the notebook's, as shipped
    def __init__(self, model):
        self.model = model

    def generate(self, prompt_ids, max_new_tokens):
        cache, tokens = minikv.KVCache.for_model(self.model), []
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt_ids]), cache=cache)
            while True:
                tokens.append(int(logits[0, -1].argmax()))
                if len(tokens) == max_new_tokens:
                    return tokens
                logits = self.decode_step(logits, cache)

    def decode_step(self, logits, cache):
        return self.model(logits.argmax(dim=-1), cache=cache)


def decoder(pick, cached=True):
    """CachedDecoder whose decode pass feeds pick(logits), into the cache (or without one)."""
    return type("Decoder", (CachedDecoder,), {"decode_step": lambda self, logits, cache: (
        self.model(pick(logits), cache=cache if cached else None))})


def test_solutions_pass_and_leave_the_random_state_alone(capsys):
    state = torch.get_rng_state()
    ch01.check_greedy_decode(greedy)
    ch01.check_chunked_prefill(chunked)
    ch01.check_chunked_prefill(partial(chunked, at=lambda start, n: torch.arange(
        start, start + n)))  # also right: positions given, continuing where the cache ends
    ch01.check_pass_cost(lambda *a: tuple(np.int64(v) for v in cost(*a)))
    gpt2 = minikv.GPTConfig.preset("gpt2")  # also right: from pass_cost, or 13% low (no attention)
    for right in (lambda b=64: b * 284e6 / (495e6 / 2 + b * 73.7e6 / 2),
                  lambda b=64, w=cost(gpt2, 0, 0, 2)[1], f=cost(gpt2, 1, 1000, 2): b * f[0] / (
                      w + b * (f[1] - w)), lambda b=64: b * 247e6 / (248e6 + b * 37e6)):
        ch01.check_predict_batched_intensity(right)
    ch01.check_decoder(decoder(lambda logits: logits[:, -1:].argmax(dim=-1)))
    ch01.check_decoder(decoder(lambda logits: torch.tensor([[int(logits[0, -1].argmax())]])))
    ch01.check_choose_chunk(lambda prompt=1000: {1000: 500, 866: 439, 1294: 647}[prompt])
    assert capsys.readouterr().out.count("✓") == 10
    assert torch.equal(torch.get_rng_state(), state), "a checker moved the caller's random state"


@pytest.mark.parametrize("check, wrong", [
    (ch01.check_greedy_decode, stub), (ch01.check_chunked_prefill, stub),
    (ch01.check_predict_batched_intensity, stub), (ch01.check_choose_chunk, stub),
    (ch01.check_decoder, decoder(stub))])
def test_stubs_raise_not_implemented(check, wrong):
    with pytest.raises(NotImplementedError):
        check(wrong)


def feeding(pass_):
    """greedy whose passes run as pass_(model, idx, cache, i, seq)."""
    return partial(greedy, feed=pass_)


CALLED = "called minikv's own"
WRONG = [(ch01.check_greedy_decode, *w) for w in [
    (feeding(lambda m, x, c, i, s: m(x, cache=c, positions=torch.arange(x.shape[1]))),
     "seed 003's bug", "restart at 0 every step"),
    (partial(greedy, pieces=lambda p: [[t] for t in p]), "prefill the prompt one token at a time"),
    (feeding(lambda m, x, c, i, s: m(torch.tensor([s]))), "recompute the whole sequence every"),
    (lambda m, p, n, e=None: minikv.generate(m, p, n, eos_id=e).tokens, CALLED, "generate"),
    (lambda m, p, n, e=None: engine_generate(m, p, n, eos_id=e).tokens, CALLED, "generate"),
    (lambda m, p, n, e=None: minikv.generate(m, p, n, mode="naive", eos_id=e).tokens, CALLED),
    (partial(greedy, extra=True), "feed the last token too"),
    (lambda m, p, n, e=None: greedy(m, p, n), "do not stop at EOS"),
    (partial(greedy, drop_eos=True), "drop the EOS"), (partial(greedy, short=1), "one token short"),
    (feeding(lambda m, x, c, i, s: m(x, cache=minikv.KVCache.for_model(m))), "a new cache every"),
    (feeding(lambda m, x, c, i, s: m(x, cache=c if i == 0 else None)), "ran without a cache"),
    (lambda *a: torch.tensor(greedy(*a)), "not a torch.Tensor"),
    (lambda *a: np.array(greedy(*a)), "not a numpy.ndarray"),
    (lambda *a: [float(t) for t in greedy(*a)], "must be an int", "float"),
    (partial(greedy, row=0), "prefill's FIRST position"),
    (partial(greedy, pieces=lambda p: [p[:-1], p[-1:]] if len(p) > 1 else [p]),
     "leaves out the prompt's last token")]] + [(ch01.check_chunked_prefill, *w) for w in [
    (partial(chunked, at=lambda start, n: torch.arange(n)), "seed 003's bug", "restart at 0"),
    (partial(chunked, fresh=True), "fresh cache per chunk"),
    (partial(chunked, keep_first=True), "return the FIRST chunk's logits"),
    (partial(chunked, step=1, width=1), "off by one", "chunks of 5 tokens instead of 4"),
    (partial(chunked, step=-1, width=-1), "off by one", "chunks of 3 tokens instead of 4"),
    (partial(chunked, width=1), "chunks overlap by one token"),
    (partial(chunked, drop_last=True), "the last, shorter chunk is dropped"),
    (lambda m, ids, c: chunked(m, ids, len(ids)), "one pass over the whole prompt"),
    (lambda *a: chunked(*a)[0], "return a pair"),
    (lambda *a: chunked(*a)[::-1], "(logits, cache)", "in that order"),
    (partial(chunked, last=lambda x: x[:, -1]), "squeeze them to shape (512,)"),
    (partial(chunked, last=lambda x: x), "the last position's logits only"),
    (partial(chunked, last=lambda x: x[0, -1].numpy()), "no .numpy()"),
    (cache_changed(lambda cache: cache.values[-1].zero_()), "layer 1's values differ",
     "nothing changed after the last chunk"),
    (cache_changed(lambda c: c.crop(c.get_seq_length() - 1)), "cache length 10")]] + [
    (ch01.check_pass_cost, *w) for w in [
        (minikv.bench.pass_cost, CALLED, "pass_cost"),
        (lambda *a: (cost(*a)[0] / 1, cost(*a)[1]), "FLOPs must be an int, not a float"),
        (lambda *a: tuple(np.float64(v) for v in cost(*a)), "FLOPs must be an int, not a float64"),
        (lambda *a: dict(zip(("flops", "bytes"), cost(*a))), "return a pair of ints"),
        (lambda *a: cost(*a)[0], "return a pair of ints")]] + [
    (ch01.check_predict_batched_intensity, lambda v=v: v, *fragments) for v, *fragments in [
        (64.0, "you multiplied one sequence's decode intensity by 64",
         "every sequence reads its own K/V"),
        (60, "you multiplied one sequence's decode intensity by 64"),
        (32.0, "one sequence's fp32 decode intensity by 64"), (73.5, "no cache read"),
        (1.0, "that is ONE sequence's decode intensity"),
        (0.5, "one sequence's decode intensity in fp32"), (3.5, "the intensity in fp32"),
        (12.7, "you counted only the keys"),
        (20.0, "the weights once, plus each sequence's cached K/V"),
        (None, "a positive number"), ("7", "a positive number")]] + [
    (ch01.check_predict_batched_intensity, lambda *batch: 6.97, "predict for the `batch` given")
] + [
    (ch01.check_predict_batched_intensity, lambda: engine_generate(
        minikv.GPT(minikv.GPTConfig.preset("tiny")), [1], 2).tokens[0], CALLED)] + [
    (ch01.check_decoder, *w) for w in [
        (CachedDecoder, "as many as the prompt", "EVERY position", "the bug hides"),
        (decoder(lambda x: x[0, -1].argmax(dim=-1)), "idx of shape (1, 1)", "keep both dim"),
        (decoder(lambda x: x[:, -1].argmax(dim=-1)), "idx of shape (1, 1)", "keep both dim"),
        (decoder(lambda x: x[:, :1].argmax(dim=-1)), "another position than the last"),
        (decoder(lambda x: x[:, -1:].argmax(dim=-1), cached=False), "without the cache"),
        (type("Decoder", (CachedDecoder,), {"generate": lambda self, p, n: minikv.generate(
            self.model, p, n).tokens}), CALLED),
        (CachedDecoder(None), "pass the class itself")]] + [
    (ch01.check_choose_chunk, lambda v=v: v, *fragments) for v, *fragments in [
        (439, "the remainder (1000 - 878 = 122)", "crossover of ONE prefill"),
        (450, "the remainder (1000 - 900 = 100)"), (600, "the remainder (1000 - 600 = 400)"),
        (256, "A full chunk is already memory-bound"), (12, "a CPU's crossover"),
        (1000, "no chunking at all"), (4096, "no chunking at all"),
        (520, "a smaller chunk also keeps them all so"), (0, "a positive int"),
        (500.0, "a positive int")]] + [
    (ch01.check_choose_chunk, lambda *prompt: 500, "choose for the `prompt` given")]


@pytest.mark.parametrize("case", WRONG)
def test_wrong_answers_get_their_hint(case):
    check, wrong, *fragments = case
    with pytest.raises(CheckFailed) as info:
        check(wrong)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in:\n{info.value}"
