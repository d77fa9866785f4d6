"""`python -m minikv bench-batch`: a decode step against its batch size, and the roofline's
prediction beside it (CS336's inference arithmetic, measured).

One decode step of B rows, each one token after `context` cached positions, reads every
weight once for all rows and each row's own K/V; it does 2 FLOPs per weight per row and
4·n_embd·n_layer per cached position per row (q·k and the weights·v). So
    predicted seconds = max(bytes / bandwidth, FLOPs / peak),
    bytes = weights + B · kv_bytes(context),   FLOPs = B · (2 · weights' numbers + attention),
with `bandwidth` (a streaming read) and `peak` (a large matmul in the model's dtype)
measured in the same run. While the weights dominate the bytes, B rows cost about what one
does; the step turns compute-bound at the batch where the two terms meet. Measured: the
median of `repeats` steps at each (context, B), the cache filled with random K/V (what a
step reads does not depend on its values). Writes results.json, README.md and plots.png to
--out (default runs/bench-batch; the committed CPU run: benchmarks/batch-cpu; the GPU's:
benchmarks/gpu/batch)."""
from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import torch

from ..course.files import write_atomically
from ..engine import KVCache, kv_cache_bytes
from . import device_and_out, publish, random_model, read_bandwidth, run_record, sync

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def peak_flops(device, dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype`: the compute roof."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times[1:])


def step_seconds(model, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one decode pass of `batch` rows after `context` cached positions."""
    cfg, device = model.config, model.device
    cache = KVCache.for_model(model, batch_size=batch, max_len=context + 1)
    heads, kd, vd = cfg.kv_shape
    for layer in range(cfg.kv_layers):  # random K/V: a step reads them whatever they hold
        cache.update(torch.randn(batch, heads, context, kd, device=device, dtype=model.dtype),
                     torch.randn(batch, heads, context, vd, device=device, dtype=model.dtype),
                     layer)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first: warm-up
            sync(device)
            start = time.perf_counter()
            model(ids, cache=cache, last_only=True)
            sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(context)
    return statistics.median(times[1:])


def predicted(model, batch: int, context: int, bandwidth: float, peak: float) -> dict:
    cfg, size = model.config, model.dtype.itemsize
    numbers = sum(p.numel() for p in model.parameters())  # the tied head counted once
    weights = (numbers - sum(e.weight[1:].numel() for e in model.modules()
                             if isinstance(e, torch.nn.Embedding)
                             and e.weight is not model.lm_head.weight)) * size
    kv = kv_cache_bytes(cfg, context, batch, dtype=model.dtype)
    matmul = numbers - (cfg.block_size * cfg.n_embd if cfg.positions == "learned" else 0)
    flops = batch * (2 * matmul + 4 * cfg.n_embd * cfg.n_layer * context)
    return {"bytes": weights + kv, "flops": flops, "memory_s": (weights + kv) / bandwidth,
            "compute_s": flops / peak}


def bench(model, device, contexts, batches, repeats: int) -> dict:
    bandwidth = read_bandwidth(device, 256, 11)
    peak = peak_flops(device, model.dtype, 2048, 5)
    rows = []
    for context in contexts:
        for batch in batches:
            row = predicted(model, batch, context, bandwidth, peak)
            row |= {"context": context, "batch": batch,
                    "measured_s": step_seconds(model, batch, context, repeats)}
            row["predicted_s"] = max(row["memory_s"], row["compute_s"])
            row["bound"] = "compute" if row["compute_s"] > row["memory_s"] else "memory"
            rows.append(row)
    crossover = {c: next((r["batch"] for r in rows if r["context"] == c
                          and r["bound"] == "compute"), None) for c in contexts}
    return {"bandwidth_GBps": bandwidth / 1e9, "peak_GFLOPs": peak / 1e9, "rows": rows,
            "first_compute_bound_batch": crossover, "repeats": repeats}


def plot(r: dict) -> bytes:
    from matplotlib.figure import Figure
    contexts = list(r["first_compute_bound_batch"])
    fig = Figure(figsize=(5 * len(contexts), 3.6))
    for ax, context in zip(fig.subplots(1, len(contexts), squeeze=False)[0], contexts):
        rows = [row for row in r["rows"] if row["context"] == context]
        b = [row["batch"] for row in rows]
        ax.plot(b, [row["measured_s"] * 1e3 for row in rows], "o-", color="black",
                label="measured")
        ax.plot(b, [row["memory_s"] * 1e3 for row in rows], "--", color="grey",
                label="bytes / bandwidth")
        ax.plot(b, [row["compute_s"] * 1e3 for row in rows], ":", color="grey",
                label="FLOPs / peak")
        ax.set(xscale="log", yscale="log", xlabel="batch (rows decoding)", ylabel="ms a step",
               title=f"{context} cached positions a row")
        ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["batch"]
    lines = [f"# A decode step against its batch size ({m['model']}, {m['device']}, "
             f"{m['date']})", "",
             f"{m['dtype']}, torch {m['torch']}, {m['threads']} threads, load average "
             f"{m['load']:.1f} at start. Measured in the same run: read bandwidth "
             f"{r['bandwidth_GBps']:.1f} GB/s, matmul peak {r['peak_GFLOPs']:.0f} GFLOP/s. "
             f"Each step the median of {r['repeats']}.", "",
             "| context | batch | measured ms | bytes / bandwidth ms | FLOPs / peak ms | "
             "predicted ms | measured / predicted | bound |", "|" + "---|" * 8]
    for row in r["rows"]:
        lines.append(f"| {row['context']} | {row['batch']} | {row['measured_s'] * 1e3:.3f} | "
                     f"{row['memory_s'] * 1e3:.3f} | {row['compute_s'] * 1e3:.3f} | "
                     f"{row['predicted_s'] * 1e3:.3f} | "
                     f"{row['measured_s'] / row['predicted_s']:.1f} | {row['bound']} |")
    lines += ["", "First batch the roofline calls compute-bound, by context: "
              + ", ".join(f"{c}: {b}" for c, b in r["first_compute_bound_batch"].items()), ""]
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "plots.png", plot(r))
    write_atomically(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())


def quote_committed(results: Path) -> str:
    """The committed runs (`results`: the benchmarks folder) as chapters 01 and 06 quote them:
    per context, the measured and predicted step at each batch and the roofline's first
    compute-bound batch; the CPU's run, then the GPU's (or how to make one)."""
    lines = []
    for where, how in (("batch-cpu", ""), ("gpu/batch", " --device cuda")):
        path = results / where / "results.json"
        if not path.exists():
            lines.append(f"benchmarks/{where}: not committed yet (python -m minikv "
                         f"bench-batch{how})")
            continue
        run = json.loads(path.read_text())
        m, b = run["machine"], run["batch"]
        lines.append(f"benchmarks/{where}: {m['model']}, {m['device']}, {m['dtype']}, "
                     f"{m['date']}; {b['bandwidth_GBps']:.0f} GB/s, {b['peak_GFLOPs']:.0f} "
                     "GFLOP/s measured")
        for context, first in b["first_compute_bound_batch"].items():
            rows = [r for r in b["rows"] if r["context"] == int(context)]
            for label, cell in ((f"{context} cached, batch", lambda r: f"{r['batch']:>8}"),
                                ("  measured ms", lambda r: f"{r['measured_s'] * 1e3:>8.2f}"),
                                ("  predicted ms", lambda r: f"{r['predicted_s'] * 1e3:>8.2f}")):
                lines.append(f"  {label:<20}" + "".join(map(cell, rows)))
            lines.append(f"    compute-bound from batch {first} (the roofline's call)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..course import arguments
    parser = argparse.ArgumentParser(prog="python -m minikv bench-batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few batches: the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json, README.md and plots.png")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: best)")
    parser.add_argument("--repeats", type=arguments.positive, default=7)
    parser.add_argument("--threads", type=arguments.positive, default=None,
                        help="torch's CPU threads (default: torch's own); on a shared machine "
                             "1 keeps other processes from stalling its threads")
    args = parser.parse_args(argv)
    device, out = device_and_out(parser, args, "bench-batch")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":  # the course target in fp32; contexts within its block_size
        from ..course.checkpoint import load_course_model
        model, name, contexts = load_course_model("target", device)[0], "course target", (64, 192)
    else:  # a GPU: GPT-2 small's shape in bfloat16, short and long contexts
        model = random_model("gpt2", device, torch.bfloat16)
        name, contexts = "GPT-2 small's shape, random weights", (128, 1024)
    batches = (1, 4, 16) if args.quick else BATCHES
    machine = run_record("bench-batch", argv, model=name, device=str(device),
                         dtype=str(model.dtype), threads=torch.get_num_threads())
    results = {"machine": machine,
               "batch": bench(model, device, contexts[:1] if args.quick else contexts, batches,
                              1 if args.quick else args.repeats)}
    return 0 if out is None else publish(out, "bench-batch", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
