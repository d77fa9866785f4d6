"""Chapter 09's kernels in Triton (minikv/bench/triton_attention.py) on a CUDA GPU, against
PyTorch's attention and the engine's paged_attention. Skipped without CUDA (tests/conftest.py) or
without Triton (requirements.txt brings it on Linux x86-64; CI has no GPU). Tolerances: fp32 1e-4
(the kernel multiplies in full IEEE precision), fp16/bf16 2e-2 (one rounding of the probabilities
before P·V, as FlashAttention does)."""
import pytest
import torch
import torch.nn.functional as F

from minikv.engine.attention import paged_attention

pytestmark = pytest.mark.cuda
triton_attention = pytest.importorskip("minikv.bench.triton_attention")
pytest.importorskip("triton")

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, nh, T, L, hs, causal", [
    (1, 2, 128, 128, 64, True), (2, 4, 100, 100, 32, True), (1, 1, 37, 300, 64, True),
    (2, 3, 256, 256, 128, False), (1, 2, 1, 77, 16, True), (3, 2, 64, 64, 64, False)])
def test_flash_attention_is_sdpa(dtype, B, nh, T, L, hs, causal):
    g = torch.Generator(device="cuda").manual_seed(T * L + hs)
    q, k, v = (torch.randn(B, nh, n, hs, device="cuda", generator=g, dtype=dtype)
               for n in (T, L, L))
    mask = torch.ones(T, L, dtype=torch.bool, device="cuda").tril(L - T) if causal else None
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    got = triton_attention.flash_attention(q, k, v, causal)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want).abs().max().item() < TOL[dtype]


def test_flash_attention_never_makes_the_scores():
    """At T = 8192 the scores of one head would be 256 MiB in fp32; the kernel's extra memory
    beyond its output stays under 1 MiB."""
    T, hs = 8192, 64
    q, k, v = (torch.randn(1, 1, T, hs, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = triton_attention.flash_attention(q, k, v, True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
    assert extra < 2**20, f"{extra / 2**20:.1f} MiB beyond the output"


def _pool(seed, lengths, page, H, nh, hs, dtype):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(need) + 5, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    width = max(need)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], device="cuda")
    keys, values = (torch.randn(len(order), H, page, hs, generator=g).to("cuda", dtype)
                    for _ in range(2))
    q = torch.randn(len(lengths), nh, 1, hs, generator=g).to("cuda", dtype)
    return q, keys, values, table, torch.tensor(lengths, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths, page, H, nh, hs", [
    ([5, 130, 1, 64], 16, 2, 8, 64), ([300], 16, 1, 4, 128), ([17, 33, 200, 9, 1000], 8, 4, 4, 32),
    ([1], 32, 2, 2, 16)])
def test_paged_decode_is_the_engines_paged_attention(dtype, lengths, page, H, nh, hs):
    q, keys, values, table, lens = _pool(len(lengths) + page, lengths, page, H, nh, hs, dtype)
    want = paged_attention(q, keys, values, table, lens, n_splits=1)
    got = triton_attention.paged_decode(q, keys, values, table, lens)
    assert got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]


def test_paged_decode_never_reads_past_a_rows_length():
    """The slots of a row's last page past its length hold whatever an earlier request left
    (here NaN): the walk must not load them (0 × NaN is NaN)."""
    lengths, page = [5, 19, 33], 8
    q, keys, values, table, lens = _pool(3, lengths, page, 2, 4, 32, torch.float32)
    want = paged_attention(q, keys, values, table, lens, n_splits=1)
    for r, n in enumerate(lengths):
        block = table[r, (n - 1) // page]
        keys[block, :, n % page:] = float("nan")
        values[block, :, n % page:] = float("nan")
    got = triton_attention.paged_decode(q, keys, values, table, lens)
    assert (got - want).abs().max().item() < 1e-4
