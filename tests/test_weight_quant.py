"""Weight-only quantization (engine/quantized.py): every linear layer's weight as int8 codes (a
scale a row) or int4 codes (a scale a group of 32 inputs), made by the KV cache's own
`quantize`; the reference path dequantizes, the fused one runs torch's kernels; the model it
came from is left as it was."""
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.engine.quantized import WeightOnlyLinear, dequantize, quantize, quantize_weights

from conftest import assert_cached_equals_full, varied_model


@pytest.mark.parametrize("bits", [8, 4])
def test_each_weight_is_within_half_a_step_of_its_code(bits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = WeightOnlyLinear(linear, bits)
    err = q.dequantized() - linear.weight.detach()  # (48, 64): per row, or per group of 32
    step = q.scale if bits == 8 else q.scale.repeat_interleave(32, 1)[..., 0]  # (48, 1 | 64)
    assert (err.abs() <= step / 2 * (1 + 1e-5)).all()
    assert q.codes.numel() == (48 * 64 if bits == 8 else 48 * 64 // 2)  # bytes of codes
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantized(), linear.bias))


@pytest.mark.parametrize("bits, n", [(8, 48), (4, 48), (4, 50)])  # 50 rows: padded to 64
def test_the_fused_kernels_compute_the_reference_with_bf16_activations(bits, n):
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, n)
    ref, fused = WeightOnlyLinear(linear, bits), WeightOnlyLinear(linear, bits, fused=True)
    x = torch.randn(2, 5, 64)
    want = F.linear(x.bfloat16().float(), ref.dequantized(), linear.bias)
    got = fused(x)
    assert got.shape == (2, 5, n) and got.dtype == x.dtype
    assert (got - want).abs().max() < 2e-2 * want.abs().max()


def test_a_quantized_copy_leaves_the_model_and_caches_as_the_plain_one():
    model = varied_model("tiny", **minikv.engine.config.LLAMA, n_kv_head=2).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_weights(model, 8)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert torch.equal(q.transformer.wte.weight, model.transformer.wte.weight)  # not quantized
    assert_cached_equals_full(q)  # a cache on a quantized model is still exact


def test_int8_keeps_most_of_the_course_models_greedy_tokens():
    model, tok = minikv.load_course_model("target", device="cpu")
    ids = tok.encode("The color of dog")
    plain = minikv.generate(model, ids, 12).tokens
    for fused in (False, True):
        assert minikv.generate(quantize_weights(model, 8, fused=fused), ids, 12).tokens[:5] == \
            plain[:5]


def test_the_codes_are_the_kv_caches_own():
    w = torch.randn(6, 64)
    codes, scale = quantize(w, 8)
    torch.testing.assert_close(WeightOnlyLinear(torch.nn.Linear(64, 6), 8).scale.shape,
                               scale.shape)
    assert dequantize(codes, scale, 8, 64).shape == w.shape


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), "bits"), (dict(bits=4, group=48), "groups of 48 must divide the 64")])
def test_a_layout_that_cannot_be_made_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightOnlyLinear(torch.nn.Linear(64, 8), **kwargs)


def test_the_bench_counts_the_bytes_a_step_reads():
    """bench-weights' byte count: int8 codes are a quarter of fp32's bytes, int4's an
    eighth, plus their scales; its machinery runs (timings are a benchmark's, not checked)."""
    from minikv.bench.weights import bench, step_bytes, variants
    model, _ = minikv.load_course_model("target", device="cpu")
    b = {name: step_bytes(m) for name, m in variants(model).items()}
    linear = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert b["bf16"] * 2 == b["fp32"]
    assert linear / 4 < b["int8"] - (b["fp32"] - linear) / 1 < linear / 4 * 1.1
    assert b["int4"] < b["int8"] < b["fp32"]
    r = bench(quick=True)
    assert [row["name"] for row in r["models"]["course target"]] == ["fp32", "bf16", "int8",
                                                                       "int4"]
    assert r["quality"][0]["agreement"] == 1.0  # fp32 against itself
