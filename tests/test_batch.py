"""Static batching of ragged prompts: left padding, explicit positions and a padding mask make
every row's output equal to generating it alone; without the positions it is not."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minikv
from minikv.course.bugs import PaddingCounted
from minikv.engine.attention import padded_attention

from conftest import varied_model

MODEL = varied_model()


@settings(max_examples=20, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 500), min_size=1, max_size=15), min_size=1,
                        max_size=5),
       n=st.integers(1, 20))
def test_each_row_equals_generating_it_alone(prompts, n):
    outs = minikv.generate_batch(MODEL, prompts, n)
    assert [o.tokens for o in outs] == [minikv.generate(MODEL, p, n).tokens for p in prompts]
    assert [o.prompt for o in outs] == prompts


def test_sampling_is_seeded_per_batch():
    prompts = [[1, 2, 3], [4, 5]]
    a = minikv.generate_batch(MODEL, prompts, 15, temperature=1.0, seed=3)
    b = minikv.generate_batch(MODEL, prompts, 15, temperature=1.0, seed=3)
    assert [o.tokens for o in a] == [o.tokens for o in b]


def test_logits_of_a_padded_row_match_alone():
    """The last-position logits of a padded row, with the mask and positions, equal the row run
    alone (within float32 rounding of a different-shaped matmul)."""
    short, long = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]
    pad = torch.tensor([5, 0])
    idx = torch.tensor([[0] * 5 + short, long])
    positions = (torch.arange(8) - pad.view(-1, 1)).clamp(min=0)
    with torch.no_grad():
        batched = MODEL(idx, positions=positions,
                        attention=lambda q, k, v: padded_attention(q, k, v, pad))[0, -1]
        alone = MODEL(torch.tensor([short]))[0, -1]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_the_padded_batch_position_bug_changes_the_output():
    prompts = [[7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    right = minikv.generate_batch(MODEL, prompts, 20)
    wrong = minikv.generate_batch(PaddingCounted(MODEL), prompts, 20)
    assert wrong[1].tokens == right[1].tokens  # the longest row has no padding: unaffected
    assert wrong[0].tokens != right[0].tokens  # the padded row's positions are shifted


def test_finished_rows_stop_at_eos():
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    alone = [minikv.generate(MODEL, p, 20) for p in prompts]
    eos = alone[0].tokens[3]
    outs = minikv.generate_batch(MODEL, prompts, 20, eos_id=eos)
    for out, a in zip(outs, alone):
        want = a.tokens[: a.tokens.index(eos) + 1] if eos in a.tokens else a.tokens
        assert out.tokens == want


@pytest.mark.parametrize("prompts, kwargs, error, message", [
    ([], {}, ValueError, "no prompts"),
    ("hello", {}, TypeError, "list of prompts"),
    ([[1, 2], []], {}, ValueError, "prompt is empty"),
    ([[1, 2]], {"pad_id": 512}, ValueError, r"pad_id must be an int in \[0, 512\) \(a token id\)"),
    ([[1] * 250], {"max_new_tokens": 20}, ValueError, "lower max_new_tokens"),
    ([[1, 2]], {"max_new_tokens": -1}, ValueError, "max_new_tokens"),
])
def test_bad_input(prompts, kwargs, error, message):
    args = dict(max_new_tokens=3) | kwargs
    with pytest.raises(error, match=message):
        minikv.generate_batch(MODEL, prompts, **args)
