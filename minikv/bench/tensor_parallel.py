"""`python -m minikv bench-tp`: the course target split over two ranks (engine/parallel.py)
against one process, in one run.

Measured, each the median of `repeats` runs, the configurations taking turns:
- decode: tokens a second of `generate` after a short prompt (batch 1: every step reads
  every weight once, then two all-reduces a layer);
- prefill: prompt tokens a second of one pass over a long prompt;
- for one process with 1 thread and with 2 threads, and for 2 ranks of 1 thread each (the
  machine's 2 cores either way), timed inside rank 0 once the ranks are started;
- what an all-reduce of one token's activations costs alone (the step's 2 × n_layer of
  them are its price: they carry n_embd numbers each and wait for the slower rank);
- each rank's cache bytes, from its shard's config, and the all-reduces per token.
Writes results.json and README.md to --out (default runs/bench-tp; the committed run:
benchmarks/tp)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..course.files import write_atomically
from ..engine import generate, kv_cache_bytes
from ..engine.parallel import all_reduces, launch, shard
from . import claimed_out, publish, run_record


def timed(model, prompt: list[int], new: int, repeats: int) -> dict:
    """Median seconds of a prefill pass over `prompt` and of `new` greedy tokens after
    it, and the tokens (a warm-up run first, untimed)."""
    times = {"prefill": [], "decode": []}
    ids = torch.tensor([prompt])
    for k in range(repeats + 1):
        with torch.inference_mode():
            start = time.perf_counter()
            model(ids, last_only=True)
            prefill = time.perf_counter() - start
        start = time.perf_counter()
        tokens = generate(model, prompt[:8], new).tokens
        decode = time.perf_counter() - start
        if k:
            times["prefill"].append(prefill)
            times["decode"].append(decode)
    return {k: statistics.median(v) for k, v in times.items()} | {"tokens": tokens}


def rank_run(rank: int, world: int, model, prompt, new: int, repeats: int) -> dict:
    """One rank's timings on its shard, its all-reduces per generated token, and the
    median seconds of one all-reduce of a token's activations."""
    part, waited, reduce = shard(model, rank, world), [0.0], dist.all_reduce

    def timed_reduce(x):  # the seconds a step spends in its all-reduces, waits included
        start = time.perf_counter()
        reduce(x)
        waited[0] += time.perf_counter() - start
    dist.all_reduce = timed_reduce  # what RowParallel calls, in this process only
    try:
        row = timed(part, prompt, new, repeats)
    finally:
        dist.all_reduce = reduce
    passes = (repeats + 1) * (1 + new)  # each run: the prefill pass and generate's passes
    row["all_reduces_per_token"] = all_reduces(part) / passes
    row["in_all_reduce_per_pass_s"] = waited[0] / passes
    x, times = torch.zeros(1, 1, model.config.n_embd), []
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    row["all_reduce_s"] = statistics.median(times)
    row["config"] = part.config
    return row


def bench(model, quick: bool) -> dict:
    cfg = model.config
    prompt = [(7 * i) % cfg.vocab_size for i in range(16 if quick else cfg.block_size - 64)]
    new, repeats = (8, 1) if quick else (48, 5)
    runs = {"1 process, 1 thread": [], "1 process, 2 threads": [], "2 ranks, 1 thread each": []}
    threads, rounds = torch.get_num_threads(), 1 if quick else 3
    try:
        for _ in range(rounds):  # the configurations take turns
            for n in (1, 2):
                torch.set_num_threads(n)
                runs[f"1 process, {n} thread{'s' * (n > 1)}"].append(
                    timed(model, prompt, new, repeats))
            ranks = launch(rank_run, 2, model, prompt, new, repeats)
            runs["2 ranks, 1 thread each"].append(ranks[0])
    finally:
        torch.set_num_threads(threads)
    rows = []
    for name, results in runs.items():
        row = {k: statistics.median(r[k] for r in results) for k in ("prefill", "decode")}
        row |= {"name": name, "tokens": results[0]["tokens"],
                "decode_tokens_per_s": new / row["decode"],
                "prefill_tokens_per_s": len(prompt) / row["prefill"]}
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode_vs_1_thread"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["prefill_vs_1_thread"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
    tp = runs["2 ranks, 1 thread each"][-1]
    return {"rows": rows, "prompt_tokens": len(prompt), "new_tokens": new,
            "repeats": repeats, "rounds": rounds,
            "same_tokens": len({tuple(r["tokens"]) for r in rows}) == 1,
            "all_reduces_per_token": tp["all_reduces_per_token"],
            "in_all_reduce_per_pass_s": statistics.median(
                r["in_all_reduce_per_pass_s"] for r in runs["2 ranks, 1 thread each"]),
            "all_reduce_s": statistics.median(r["all_reduce_s"]
                                              for r in runs["2 ranks, 1 thread each"]),
            "cache_bytes_per_rank": kv_cache_bytes(tp["config"], cfg.block_size,
                                                   dtype=model.dtype),
            "cache_bytes_one_process": kv_cache_bytes(cfg, cfg.block_size, dtype=model.dtype),
            "n_layer": cfg.n_layer, "n_embd": cfg.n_embd}


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["tp"]
    lines = [f"# Tensor parallelism: 2 ranks against one process ({m['model']}, {m['date']})",
             "", f"{m['cpus']} CPUs, torch {m['torch']}, load average {m['load']:.1f} at "
             f"start. Decode: {r['new_tokens']} greedy tokens after an 8-token prompt; "
             f"prefill: one pass over {r['prompt_tokens']} tokens. Each time the median of "
             f"{r['repeats']} runs in each of {r['rounds']} rounds, the configurations "
             f"taking turns; the ranks timed inside rank 0 after they started. Same "
             f"tokens in every configuration: {r['same_tokens']}.", "",
             "| configuration | decode tokens/s | × 1 thread | prefill tokens/s | × 1 thread |",
             "|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['name']} | {row['decode_tokens_per_s']:.0f} | "
                     f"{row['decode_vs_1_thread']:.2f} | {row['prefill_tokens_per_s']:.0f} | "
                     f"{row['prefill_vs_1_thread']:.2f} |")
    per_token = r["all_reduces_per_token"] * r["all_reduce_s"]
    lines += ["", f"All-reduces per generated token: {r['all_reduces_per_token']:.0f} "
              f"(2 × {r['n_layer']} layers), each of {r['n_embd']} float32 numbers; one alone "
              f"takes {r['all_reduce_s'] * 1e6:.0f} µs (median of 200), so "
              f"{per_token * 1e3:.2f} ms of every token would be spent in them; inside a run, "
              f"rank 0 spent {r['in_all_reduce_per_pass_s'] * 1e3:.2f} ms a pass in them "
              f"(waiting for the other rank included), of "
              f"{r['rows'][-1]['decode'] / r['new_tokens'] * 1e3:.2f} ms a decoded token.",
              f"Cache at {results['machine']['block_size']} positions: "
              f"{r['cache_bytes_one_process']:,} bytes in one process, "
              f"{r['cache_bytes_per_rank']:,} on each rank."]
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "results.json",
                     (json.dumps(results, indent=1, default=str) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a random tiny model, one round: checks the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-tp; the committed run: benchmarks/tp)")
    args = parser.parse_args(argv)
    out = claimed_out(parser, args, "bench-tp")
    if args.quick:
        from . import random_model
        model, name = random_model("tiny", "cpu"), "tiny preset, random weights"
    else:
        from ..course.checkpoint import load_course_model
        model, name = load_course_model("target", "cpu")[0], "course target"
    machine = run_record("bench-tp", argv, model=name, block_size=model.config.block_size)
    results = {"machine": machine, "tp": bench(model, args.quick)}
    return publish(out, "bench-tp", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
