"""Prompt-lookup decoding: proposals from the sequence itself, verified by the same core, output
exactly the target's greedy output."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine.lookup import propose_by_lookup
from minikv.viz.replay import replay

from conftest import varied_model

MODEL = varied_model()


@pytest.mark.parametrize("seq, gamma, ngram, expected", [
    ([1, 2, 3, 4, 1, 2], 3, 2, [3, 4, 1]),      # "1 2" seen before: propose what followed
    ([1, 2, 3, 4, 1, 2], 1, 2, [3]),
    ([1, 2, 3, 1, 2, 5, 1, 2], 2, 2, [5, 1]),   # the most recent earlier occurrence wins
    ([5, 6, 7, 8], 3, 2, []),                   # nothing repeats
    ([9, 1, 9], 3, 3, [1, 9]),                  # falls back to shorter n-grams
    ([4], 3, 2, []),
])
def test_proposals(seq, gamma, ngram, expected):
    assert propose_by_lookup(seq, gamma, ngram) == expected


@settings(max_examples=25, deadline=None)
@given(prompt=st.lists(st.integers(0, 20), min_size=1, max_size=12), gamma=st.integers(1, 6),
       ngram=st.integers(1, 4))
def test_output_is_the_targets_greedy_output(prompt, gamma, ngram):
    expected = minikv.generate(MODEL, prompt, 25)
    out = minikv.lookup_generate(MODEL, prompt, 25, gamma=gamma, ngram=ngram)
    assert out.tokens == expected.tokens
    assert out.stats.target_passes <= expected.stats.forward_passes
    assert out.stats.new_tokens == 25


def test_every_accepted_proposal_is_a_pass_saved():
    """passes = 1 (prefill) + rounds, and each round commits its accepted proposals plus one
    token: so greedy decoding's passes minus lookup's is exactly the proposals accepted."""
    prompt = [3, 7, 11, 5] * 4
    out = minikv.lookup_generate(MODEL, prompt, 40, gamma=4)
    plain = minikv.generate(MODEL, prompt, 40)
    assert out.stats.target_passes == 1 + out.stats.rounds
    assert plain.stats.forward_passes - out.stats.target_passes == out.stats.accepted


def test_trace_replays_and_draws():
    out = minikv.lookup_generate(MODEL, [1, 2, 3, 1, 2], 12, gamma=3, trace=True)
    snaps = replay(out.trace)
    assert snaps[-1].tokens == [1, 2, 3, 1, 2] + out.tokens
    assert all(s.cache_len <= len(s.tokens) for s in snaps)


def test_stops_at_eos():
    plain = minikv.generate(MODEL, [1, 2, 3], 30)
    eos = plain.tokens[5]
    out = minikv.lookup_generate(MODEL, [1, 2, 3], 30, eos_id=eos)
    assert out.tokens == plain.tokens[: plain.tokens.index(eos) + 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0), "gamma must be a positive int"),
    (dict(ngram=0), "ngram must be a positive int"),
    (dict(max_new_tokens=300), "lower max_new_tokens or gamma"),
    (dict(eos_id=-1), "eos_id must be"),
])
def test_bad_input(kwargs, message):
    args = dict(max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message):
        minikv.lookup_generate(MODEL, [1, 2], **args)
