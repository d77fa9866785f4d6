"""Checkers for chapter 01 (seed 002, prefill and decode).

The learner's decode loop is compared with `minikv.generate(..., mode="cached")` on a small random
model and on the course target, with the K/V work counted by `KVCounter` (a loop that recomputes
the prompt fails); the positions and cache-length exercises are compared with the engine's own
trace.
"""
from __future__ import annotations

from ...engine import GPT, KVCounter, generate
from ..checkpoint import load_course_model
from . import call, expect, passed, tiny_model


def _random_model() -> GPT:
    return tiny_model(1)


def check_greedy_decode(greedy_decode) -> None:
    """greedy_decode(model, prompt_ids, max_new_tokens, eos_id) == generate(..., mode="cached")."""
    name = "greedy_decode"
    model = _random_model()
    target, tok = load_course_model("target", "cpu")
    cases = [(model, [1, 2, 3], 12, None), (model, [7], 1, None),
             (model, [5, 9, 11, 2, 4], 20, None)]
    eos = generate(model, [1, 2, 3], 12).tokens[5]  # stops at the first time this token appears
    cases.append((model, [1, 2, 3], 12, eos))
    # EOS comes first
    cases.append((model, [5, 9, 11, 2, 4], 6, generate(model, [5, 9, 11, 2, 4], 1).tokens[0]))
    cases.append((target, tok.encode("The color of dog"), 10, tok.eot_token))
    cases.append((target, tok.encode("Once upon a time"), 8, tok.eot_token))
    for m, prompt, n, eos_id in cases:
        case = (f"prompt {prompt}, max_new_tokens={n}, eos_id={eos_id}"
                + (" (course target)" if m is target else ""))
        expected = generate(m, prompt, n, mode="cached", eos_id=eos_id).tokens
        with KVCounter(m) as counter:
            got = call(name, case, greedy_decode, m, list(prompt), n, eos_id)
        got_list = [int(t) for t in got] if isinstance(got, (list, tuple)) else got
        expect(got_list == expected, name, case, expected, got_list,
               "prefill the whole prompt once, then feed only the newest token; "
               "stop right after eos_id")
        work = len(prompt) + len(expected) - 1
        expect(counter.count == work, name, case, f"{work} K/V vectors computed per layer (cached)",
               f"{counter.count}",
               "feed the prompt once; after that, one token per pass, "
               "and never feed the last token")
    passed(name, len(cases))


def _trace(model: GPT, prompt_len: int, new_tokens: int):
    return generate(model, list(range(1, prompt_len + 1)), new_tokens, mode="cached",
                    trace=True).trace


def check_positions_fed(positions_fed) -> None:
    """positions_fed(prompt_len, new_tokens) == the positions in generate's trace."""
    name = "positions_fed"
    model = _random_model()
    cases = [(4, 4), (1, 1), (3, 5), (7, 2), (2, 10)]
    for prompt_len, new in cases:
        expected = [list(e.positions) for e in _trace(model, prompt_len, new)]
        got = call(name, f"prompt_len={prompt_len}, new_tokens={new}", positions_fed,
                   prompt_len, new)
        got_list = [list(map(int, p)) for p in got] if isinstance(got, (list, tuple)) else got
        expect(got_list == expected, name, f"prompt_len={prompt_len}, new_tokens={new}",
               expected, got_list,
               "the prefill feeds positions 0..prompt_len-1; "
               "each decode pass feeds the next single position; "
               "the last new token is never fed")
    passed(name, len(cases))


def check_cache_lengths(cache_lengths) -> None:
    """cache_lengths(prompt_len, new_tokens) == cache_len_after of every event in generate's
    trace."""
    name = "cache_lengths"
    model = _random_model()
    cases = [(4, 5), (1, 1), (3, 6), (9, 2), (1, 12)]
    for prompt_len, new in cases:
        expected = [e.cache_len_after for e in _trace(model, prompt_len, new)]
        case = f"prompt_len={prompt_len}, new_tokens={new}"
        got = call(name, case, cache_lengths, prompt_len, new)
        got_list = [int(n) for n in got] if isinstance(got, (list, tuple)) else got
        expect(got_list == expected, name, case, expected, got_list,
               "one entry per forward pass: the prefill leaves prompt_len positions cached, "
               "each decode pass adds one; "
               "the pass count is new_tokens (the last token is produced, never fed)")
    passed(name, len(cases))
