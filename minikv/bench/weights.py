"""`python -m minikv bench-weights`: chapter 01's lesson paid off. A batch-1 decode step reads
every weight once, so fewer bytes a weight should mean a faster step; measured here for fp32,
bf16, and int8 and int4 weights (engine/quantized.py's quantize_weights, torch's fused
kernels), on the course target and on a random model of GPT-2 small's shape, in one run:

- the bytes a step reads (the weights as stored, every layer's; one row of each embedding
  table; the cache's few positions left out) and the step's time predicted from them at the
  streaming-read bandwidth measured in the same run (chapter 01's roofline);
- the step's measured time (median of `repeats` runs of `new` greedy tokens, the
  configurations taking turns), and measured / predicted;
- on the course target, what the bytes cost in quality: greedy tokens equal to fp32's
  before the first difference, and accuracy on coin flips with names it never saw.
One torch thread throughout (a batch-1 step runs its matrix-vector products on one core).
Writes results.json and README.md to --out (default runs/bench-weights; the committed run:
benchmarks/weights)."""
from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
import torch.nn as nn

from ..course import corpus
from ..course.files import write_atomically
from ..engine import generate
from ..engine.quantized import WeightOnlyLinear, quantize_weights
from . import alternate_all, claimed_out, publish, random_model, read_bandwidth, run_record

PROMPTS = ["The color of dog", "Once upon a time", "A coin's state is heads.",
           "The cat sat on", "In the park, a", "Alice flips the coin", "A red ball",
           "The sun is"]


def step_bytes(model: nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every linear layer's weight as stored (codes and
    scales, or floats) and bias, the norms, and one row of each embedding table."""
    total = 0
    for m in model.modules():
        if isinstance(m, WeightOnlyLinear):
            total += m.codes.nbytes + m.scale.nbytes
        elif isinstance(m, (nn.Linear, nn.LayerNorm, nn.RMSNorm)):
            total += sum(p.nbytes for p in m.parameters(recurse=False) if p is not None)
            continue
        elif isinstance(m, nn.Embedding):
            total += m.weight[0].nbytes
            continue
        else:
            continue
        total += 0 if m.bias is None else m.bias.nbytes
    return total


def variants(model) -> dict:
    return {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16),
            "int8": quantize_weights(model, 8, fused=True),
            "int4": quantize_weights(model, 4, fused=True)}


def timings(models: dict, new: int, repeats: int, bandwidth: float) -> list[dict]:
    runs = {name: lambda m=m: generate(m, [1, 2, 3, 4], new) for name, m in models.items()}
    times = alternate_all(runs, repeats + 1, torch.device("cpu"))
    rows = []
    for name, m in models.items():
        step = statistics.median(times[name][1:]) / new  # the first run: warm-up
        nbytes = step_bytes(m)
        rows.append({"name": name, "bytes": nbytes, "predicted_s": nbytes / bandwidth,
                     "step_s": step, "vs_prediction": step / (nbytes / bandwidth)})
    for row in rows:
        row["speedup_vs_fp32"] = rows[0]["step_s"] / row["step_s"]
    return rows


def quality(models: dict, tok, n_questions: int, new: int) -> list[dict]:
    """Greedy agreement with fp32 (tokens equal before the first difference, of `new`,
    over PROMPTS) and accuracy on coin flips with unseen names (all counts of people)."""
    from ..course.evaluate import coin_flip_accuracy
    questions = corpus.unseen_coin_flips(n_questions)
    plain = [generate(models["fp32"], tok.encode(p), new).tokens for p in PROMPTS]
    rows = []
    for name, m in models.items():
        same = 0
        for p, want in zip(PROMPTS, plain):
            got = generate(m, tok.encode(p), new).tokens
            same += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        acc = coin_flip_accuracy(m, tok, questions=questions)
        rows.append({"name": name, "agreement": same / (len(PROMPTS) * new),
                     "unseen_accuracy": sum(acc.values()) / len(acc)})
    return rows


def bench(quick: bool) -> dict:
    from ..course.checkpoint import load_course_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, tok = load_course_model("target", "cpu")
        bandwidth = read_bandwidth(torch.device("cpu"), 16 if quick else 256, 5 if quick else 21)
        out = {"bandwidth_GBps": bandwidth / 1e9, "new": 4 if quick else 32,
               "repeats": 1 if quick else 7}
        shapes = {"course target": target}
        if not quick:
            shapes["GPT-2 small's shape, random weights"] = random_model("gpt2", "cpu")
        out["models"] = {name: timings(variants(m), out["new"], out["repeats"], bandwidth)
                         for name, m in shapes.items()}
        out["quality"] = quality(variants(target), tok, 8 if quick else 100, 8 if quick else 32)
        out["quality_questions"] = 8 if quick else 100
    finally:
        torch.set_num_threads(threads)
    return out


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["weights"]
    lines = [f"# Fewer bytes a weight: the decode step against its roofline ({m['date']})", "",
             f"{m['cpus']} CPUs, one torch thread, torch {m['torch']}, load average "
             f"{m['load']:.1f} at start. Streaming-read bandwidth measured in the same run: "
             f"{r['bandwidth_GBps']:.1f} GB/s. A step: the median of {r['repeats']} runs of "
             f"{r['new']} greedy tokens, the configurations taking turns; predicted = bytes "
             "read / bandwidth. int8 and int4 run torch's fused kernels, which take the "
             "activations in bfloat16.", ""]
    for name, rows in r["models"].items():
        lines += [f"## {name}", "", "| weights | bytes a step | predicted ms | measured ms | "
                  "measured / predicted | × fp32 speed |", "|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['name']} | {row['bytes']:,} | {row['predicted_s'] * 1e3:.3f} "
                         f"| {row['step_s'] * 1e3:.3f} | {row['vs_prediction']:.1f} | "
                         f"{row['speedup_vs_fp32']:.2f} |")
        lines.append("")
    lines += ["## What the bytes cost (course target)", "",
              f"Greedy agreement: tokens equal to fp32's before the first difference, "
              f"{r['new']} after each of {len(PROMPTS)} prompts. Accuracy: coin flips with "
              f"names the model never saw, {r['quality_questions']} questions per number "
              "of people (1–8), the mean over the counts.", "",
              "| weights | greedy agreement | unseen-name accuracy |", "|---|---|---|"]
    for row in r["quality"]:
        lines.append(f"| {row['name']} | {row['agreement']:.0%} | "
                     f"{row['unseen_accuracy']:.1%} |")
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the target only, few tokens: checks the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-weights; the committed run: benchmarks/weights)")
    args = parser.parse_args(argv)
    out = claimed_out(parser, args, "bench-weights")
    results = {"machine": run_record("bench-weights", argv), "weights": bench(args.quick)}
    return publish(out, "bench-weights", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
