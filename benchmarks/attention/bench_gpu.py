"""Chapter 09's kernels on a CUDA GPU: Triton's FlashAttention and PagedAttention decode
(minikv/bench/triton_attention.py) against PyTorch, in one run. Writes gpu_results.json and
results.md into --out (a new folder: the committed run in this folder is never overwritten by
default). Needs a CUDA GPU and Triton; not part of CI.

    python benchmarks/attention/bench_gpu.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's minikv

import triton  # noqa: E402
from triton.testing import do_bench as _do_bench  # noqa: E402

from minikv.bench.triton_attention import flash_attention, paged_decode  # noqa: E402
from minikv.course.files import write_atomically  # noqa: E402
from minikv.engine.attention import num_kv_splits, paged_attention  # noqa: E402
from minikv.engine.flash import tiled_attention  # noqa: E402


def do_bench(fn, warmup: int, rep: int) -> float:
    """Milliseconds per call, the median of triton's timed repeats (its default is the mean)."""
    return _do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def naive(q, k, v):
    """softmax(q kᵀ/√hs) v with the T x T scores made, masked, softmaxed, as written."""
    T = q.size(-2)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def peak_extra(fn) -> int:
    """Bytes allocated at the peak of one call, beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    del out
    return extra


def prefill_rows(lengths, B, nh, hs, dtype):
    rows = []
    for T in lengths:
        q, k, v = (torch.randn(B, nh, T, hs, device="cuda", dtype=dtype) for _ in range(3))
        want = sdpa(q.float(), k.float(), v.float())
        row = {"T": T, "max_err_triton_vs_sdpa_fp32":
               (flash_attention(q, k, v).float() - want).abs().max().item()}
        for name, fn in (("naive", naive), ("sdpa", sdpa), ("triton", flash_attention)):
            row[f"{name}_ms"] = do_bench(lambda fn=fn: fn(q, k, v), warmup=10, rep=50)
            row[f"{name}_peak_mib"] = peak_extra(lambda fn=fn: fn(q, k, v)) / 2**20
        if T <= 2048:  # the chapter's PyTorch loop on the GPU: the same algorithm, tile by tile
            row["pytorch_loop_ms"] = do_bench(
                lambda: tiled_attention(q, k, v, True, 64, 64), warmup=1, rep=20)
        print(f"T={T:5}  naive {row['naive_ms']:8.3f} ms {row['naive_peak_mib']:8.1f} MiB  "
              f"sdpa {row['sdpa_ms']:7.3f} ms {row['sdpa_peak_mib']:7.1f} MiB  "
              f"triton {row['triton_ms']:7.3f} ms {row['triton_peak_mib']:7.1f} MiB  "
              f"err {row['max_err_triton_vs_sdpa_fp32']:.1e}"
              + (f"  pytorch loop {row['pytorch_loop_ms']:.1f} ms" if "pytorch_loop_ms" in row
                 else ""), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def decode_rows(batches, context, page, nh, H, hs, dtype):
    rows = []
    for B in batches:
        n_pages = context // page
        order = torch.randperm(B * n_pages, device="cuda")
        tables = order.view(B, n_pages)
        keys, values = (torch.randn(B * n_pages, H, page, hs, device="cuda", dtype=dtype)
                        for _ in range(2))
        lengths = torch.randint(context // 2, context + 1, (B,), device="cuda")
        q = torch.randn(B, nh, 1, hs, device="cuda", dtype=dtype)
        splits = num_kv_splits(B, nh, context)
        want = paged_attention(q, keys, values, tables, lengths, 1).float()
        row = {"batch": B, "context": context, "engine_splits": splits,
               "max_err_triton_vs_engine": (paged_decode(q, keys, values, tables, lengths)
                                            .float() - want).abs().max().item(),
               "engine_ms": do_bench(lambda: paged_attention(q, keys, values, tables, lengths,
                                                             splits), warmup=10, rep=50),
               "triton_ms": do_bench(lambda: paged_decode(q, keys, values, tables, lengths),
                                     warmup=10, rep=50)}
        print(f"batch {B:3}: engine paged_attention ({splits} splits) {row['engine_ms']:.3f} ms, "
              f"triton paged_decode {row['triton_ms']:.3f} ms, "
              f"err {row['max_err_triton_vs_engine']:.1e}", flush=True)
        rows.append(row)
    return rows


def report(result) -> str:
    lines = [f"# Chapter 09's kernels on {result['device']}",
             "",
             f"torch {result['torch']}, triton {result['triton']}; `python "
             f"benchmarks/attention/bench_gpu.py` (times: medians of do_bench's repeats; "
             f"peak: bytes allocated at the call's peak beyond what was allocated before it).",
             "",
             f"## Causal prefill attention, B={result['prefill']['B']}, "
             f"{result['prefill']['nh']} heads of {result['prefill']['hs']}, "
             f"{result['prefill']['dtype']}",
             "",
             "| T | naive ms | SDPA ms | Triton ms | Triton / SDPA | naive MiB | SDPA MiB | "
             "Triton MiB | max err vs fp32 | PyTorch loop ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["prefill"]["rows"]:
        lines.append(f"| {r['T']} | {r['naive_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                     f"{r['triton_ms']:.3f} | {r['triton_ms'] / r['sdpa_ms']:.2f} | "
                     f"{r['naive_peak_mib']:.1f} | {r['sdpa_peak_mib']:.1f} | "
                     f"{r['triton_peak_mib']:.1f} | {r['max_err_triton_vs_sdpa_fp32']:.1e} | "
                     + (f"{r['pytorch_loop_ms']:.1f} |" if "pytorch_loop_ms" in r else "— |"))
    d = result["decode"]
    lines += ["", f"## Paged decode, context {d['context']}, page {d['page']}, {d['nh']} query "
              f"heads on {d['H']} K/V heads of {d['hs']}, {d['dtype']}", "",
              "| batch | engine `paged_attention` ms (splits) | Triton `paged_decode` ms | "
              "engine / Triton | max err |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['batch']} | {r['engine_ms']:.3f} ({r['engine_splits']}) | "
                     f"{r['triton_ms']:.3f} | {r['engine_ms'] / r['triton_ms']:.1f} | "
                     f"{r['max_err_triton_vs_engine']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the results")
    parser.add_argument("--quick", action="store_true", help="two lengths, two batches")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU")
    torch.manual_seed(0)
    lengths = [512, 2048] if args.quick else [256, 512, 1024, 2048, 4096, 8192]
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    B, nh, hs, dtype = 4, 16, 64, torch.bfloat16
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "prefill": {"B": B, "nh": nh, "hs": hs, "dtype": str(dtype).removeprefix("torch."),
                          "rows": prefill_rows(lengths, B, nh, hs, dtype)},
              "decode": {"context": 2048, "page": 16, "nh": 32, "H": 8, "hs": 128,
                         "dtype": "bfloat16",
                         "rows": decode_rows(batches, 2048, 16, 32, 8, 128, torch.bfloat16)}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomically(args.out / "gpu_results.json", json.dumps(result, indent=1) + "\n")
    write_atomically(args.out / "results.md", report(result))
    print(report(result))


if __name__ == "__main__":
    main()
