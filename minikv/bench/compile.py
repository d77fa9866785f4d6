"""`python -m minikv bench-compile`: what torch.compile removes from a decode step on this CPU
(issue 56). The course target's batch-1 decode step takes several times its weight-read time
(chapter 01's roofline): the step is a few hundred small operations, each dispatched on its
own. Here, in one run, greedy decoding of the same prompt by:

- `generate`: the engine's decoder (a KVCache handing attention past + 1 keys);
- static, eager: engine/static.py's step of fixed shapes, not compiled (what the shapes cost);
- static, compiled: that step through torch.compile (inductor: generated C++ kernels for the
  small operations, the matrix products left to torch's own), traced once;
- static, compiled, C++ wrapper: the same, with the Python that calls the kernels replaced
  by C++ too (inductor's cpp_wrapper); on a GPU instead: static, compiled, CUDA graphs (mode
  "reduce-overhead": the step's kernel launches captured once and replayed as one).

For each: the decode step's time ((t(new) - t(1)) / (new - 1), medians of `repeats` runs, the
configurations taking turns), its ratio to `generate`'s and to the weight-read time at the
streaming-read bandwidth measured in the same run, the compile's own time, and whether the
tokens are `generate`'s. One torch thread by default. Writes results.json and README.md to
--out (default runs/bench-compile; the committed run: benchmarks/compile)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..course import arguments
from ..course.files import write_atomically
from ..engine import generate
from ..engine.static import forward, static_generate
from . import alternate_all, claimed_out, publish, read_bandwidth, run_record
from .weights import step_bytes


def compiled(mode: str | None = None, **options):
    """`forward` compiled on its own (a wrapper of its own: each gets its own trace)."""
    def step(model, cache, ids, positions):
        return forward(model, cache, ids, positions)
    return torch.compile(step, fullgraph=True, dynamic=False, mode=mode,
                         options=options or None)


def bench(model, prompt: list[int], new: int, repeats: int) -> dict:
    device = model.device
    runs = {"generate": lambda n: generate(model, prompt, n).tokens,
            "static, eager": lambda n: static_generate(model, prompt, n)}
    steps = {"static, compiled": compiled()}
    if device.type == "cuda":
        steps["static, compiled, CUDA graphs"] = compiled("reduce-overhead")
    else:
        steps["static, compiled, C++ wrapper"] = compiled(cpp_wrapper=True)
    compile_s = {}
    for name, step in steps.items():
        start = time.perf_counter()
        static_generate(model, prompt, new, step=step)  # traced and compiled here, once
        compile_s[name] = time.perf_counter() - start
        runs[name] = lambda n, step=step: static_generate(model, prompt, n, step=step)
    want = runs["generate"](new)
    same = {name: run(new) == want for name, run in runs.items()}
    calls = {f"{name} {n}": (lambda run=run, n=n: run(n)) for name, run in runs.items()
             for n in (1, new)}
    bandwidth = read_bandwidth(device, 256, 11)
    times = alternate_all(calls, repeats + 1, device)  # +1: a warm-up
    rows, read_s = [], step_bytes(model) / bandwidth
    for name in runs:
        one, many = (statistics.median(times[f"{name} {n}"][1:]) for n in (1, new))
        rows.append({"name": name, "step_s": (many - one) / (new - 1),
                     "compile_s": compile_s.get(name, 0.0), "same_tokens": same[name]})
    for row in rows:
        row["vs_generate"] = rows[0]["step_s"] / row["step_s"]
        row["vs_weight_read"] = row["step_s"] / read_s
    return {"device": str(device), "prompt": len(prompt), "new": new, "repeats": repeats,
            "bytes": step_bytes(model),
            "bandwidth_GBps": bandwidth / 1e9, "weight_read_s": read_s, "rows": rows}


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["compile"]
    lines = [f"# What torch.compile removes from a decode step ({m['date']})", "",
             f"`{m['command']}`: the course target on {r.get('device', 'cpu')}, {m['cpus']} "
             f"CPUs, {m['threads']} torch "
             f"thread(s), torch {m['torch']}, load average {m['load']:.2f} at the start. A "
             f"{r['prompt']}-token prompt, {r['new']} greedy tokens; a step: the median of "
             f"{r['repeats']} runs, the configurations taking turns. Its weights: "
             f"{r['bytes']:,} bytes a step, {r['weight_read_s'] * 1e3:.3f} ms at "
             f"{r['bandwidth_GBps']:.1f} GB/s (the streaming-read bandwidth measured in the "
             "same run). One machine, one run.", "",
             "| decode step | ms | × generate's speed | × weight-read time | compile s | "
             "same tokens as generate |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['name']} | {row['step_s'] * 1e3:.3f} | {row['vs_generate']:.2f} "
                     f"| {row['vs_weight_read']:.1f} | {row['compile_s']:.1f} | "
                     f"{row['same_tokens']} |")
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the tiny preset, few tokens: the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-compile; the committed run: benchmarks/compile)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    parser.add_argument("--threads", type=arguments.positive, default=1)
    parser.add_argument("--repeats", type=arguments.positive, default=7)
    args = parser.parse_args(argv)
    from ..course.device import resolve_device
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as e:
        parser.error(str(e))
    out = claimed_out(parser, args, "bench-compile")
    from ..course.checkpoint import load_course_model
    from . import random_model
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        machine = run_record("bench-compile", argv, threads=args.threads)
        if args.quick:
            model, prompt, new, repeats = random_model("tiny", device), [1, 2, 3, 4], 4, 1
        else:
            (model, tok), new, repeats = load_course_model("target", device), 48, args.repeats
            prompt = tok.encode("The color of dog")
        results = {"machine": machine, "compile": bench(model, prompt, new, repeats)}
    finally:
        torch.set_num_threads(threads)
    return publish(out, "bench-compile", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
