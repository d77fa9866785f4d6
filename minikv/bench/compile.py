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
tokens are `generate`'s. One torch thread by default.

Then the server's decode step (an `Engine` serving B requests of a `context`-token prompt, B
= 1, 8, 64), its step timed three ways in turns: eager (split-KV read through the blocks in
use), the fixed-shape pass of engine/static.py's GraphDecode run eagerly (every row's whole
table read, masked), and, on a GPU, that pass replayed as one CUDA graph a batch size: the
graph against the same pass eagerly is the launch overhead the graph removes; the tokens are
the eager engine's. Writes results.json and README.md to
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
from ..engine import Engine, Request, generate
from ..engine.static import GraphDecode, forward, static_generate
from . import alternate_all, checked_device, claimed_out, publish, read_bandwidth, run_record
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


def engines(model, batch: int, prompt: list[int], new: int) -> dict:
    """Engines serving `batch` requests of `prompt`, prefilled: eager, and the fixed-shape
    pass run eagerly and (on a GPU) replayed."""
    need = batch * (-(-(len(prompt) + new) // 16) + 1)  # every request's blocks, and a spare
    kinds = {"eager, split-KV": None, "static, eager": False}
    if model.device.type == "cuda":
        kinds["static, CUDA graphs"] = True
    made = {}
    for name, capture in kinds.items():
        engine = made[name] = Engine(model, need, prefix_caching=False)
        if capture is not None:  # captured on the fresh pool, before any request
            engine.runner.graphs = GraphDecode(model, engine.pool, (batch,), capture=capture)
        for i in range(batch):  # each its own text: the prompt turned by i tokens
            engine.add(Request(prompt[i % len(prompt):] + prompt[:i % len(prompt)], new))
        engine.step()  # the prompts' prefill: the steps after it are decode steps
    return made


def graph_rows(model, prompt: list[int], sizes: tuple, steps: int) -> tuple[list[dict], int]:
    """The server's decode step at each batch size in `sizes`, three ways (module doc), and
    the positions of a row's whole table, which the fixed-shape pass reads."""
    rows = []
    for batch in sizes:
        made = engines(model, batch, prompt, steps + 2)
        graphs = made["static, eager"].runner.graphs
        times = alternate_all({name: e.step for name, e in made.items()}, steps, model.device)
        for e in made.values():
            while e.has_work():
                e.step()
        want = made["eager, split-KV"].outputs()
        for name, e in made.items():
            rows.append({"batch": batch, "name": name, "step_s": statistics.median(times[name]),
                         "same_tokens": [o.tokens for o in e.outputs().values()]
                         == [o.tokens for o in want.values()]})
    for row in rows:
        eager = next(r for r in rows if r["batch"] == row["batch"])
        row["vs_eager"] = eager["step_s"] / row["step_s"]
    return rows, graphs.width * graphs.pool.page_size


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
    g = results.get("graphs")
    if g:
        lines += ["", f"The server's decode step: an `Engine` serving B requests of a "
                  f"{g['context']}-token prompt, prefilled; a step: the median of {g['steps']} "
                  "decode steps, the engines taking turns; the tokens compared with the "
                  "eager engine's once every request finished. The fixed-shape pass reads every "
                  f"row's whole table ({g['table']} positions), the eager one only the "
                  "positions in use; a CUDA graph (a GPU only) replays the fixed-shape pass.", "",
                  "| B | decode step | ms | × eager's speed | same tokens |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['name']} | {r['step_s'] * 1e3:.3f} | {r['vs_eager']:.2f} "
                  f"| {r['same_tokens']} |" for r in g["rows"]]
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
    device, out = checked_device(parser, args), claimed_out(parser, args, "bench-compile")
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
        sizes, steps = ((1, 4), 3) if args.quick else ((1, 8, 64), 3 * args.repeats)
        context = prompt * (1 if args.quick else 32)  # 128 positions for the course target's
        rows, table = graph_rows(model, context, sizes, steps)
        results["graphs"] = {"context": len(context), "steps": steps, "table": table,
                             "rows": rows}
    finally:
        torch.set_num_threads(threads)
    return publish(out, "bench-compile", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
