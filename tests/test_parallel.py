"""column_parallel: the column-split copy computes what nn.Linear does and leaves the original as it
was."""
import pytest
import torch

import minikv
from minikv.bench.parallel import ColumnParallelLinear, column_parallel


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_split_linear_equals_nn_linear(parts, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 10, bias=bias)  # 10 columns: uneven slices for 3 and 7 parts
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(ColumnParallelLinear(linear, parts)(x), linear(x), atol=1e-6, rtol=0)


def test_column_parallel_copy_decodes_the_same_tokens_and_logits(tiny):
    fast = column_parallel(tiny, parts=2)
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
    plain = minikv.generate(tiny, [1, 2, 3], 60, return_logits=True)
    split = minikv.generate(fast, [1, 2, 3], 60, return_logits=True)
    assert split.tokens == plain.tokens
    torch.testing.assert_close(split.logits, plain.logits, atol=1e-5, rtol=0)
    # the K/V counter still sees every projection
    assert split.stats.kv_computed == plain.stats.kv_computed


def test_naive_and_speculative_decoding_run_on_the_copy(tiny):
    fast = column_parallel(tiny, parts=2)
    expected = minikv.generate(tiny, [4, 5], 20).tokens
    assert minikv.generate(fast, [4, 5], 20, mode="naive").tokens == expected
    assert minikv.speculative_generate(fast, fast, [4, 5], 20, gamma=3).tokens == expected


def test_original_model_is_untouched(tiny):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    column_parallel(tiny)
    assert type(tiny.lm_head) is torch.nn.Linear
    assert tiny.lm_head.weight is tiny.transformer.wte.weight  # still tied, still trainable
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict().items())


@pytest.mark.parametrize("parts", [0, -2, 1.5, True, "2"])
def test_bad_parts_is_a_clear_error(tiny, parts):
    with pytest.raises(ValueError, match="parts must be a positive int"):
        column_parallel(tiny, parts)
