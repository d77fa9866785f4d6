"""`python -m minikv bench-disagg`: chapter 13's disaggregated serving, measured on this machine.

1. A long prompt arrives beside running requests (bench-load's case, `long_prompt_arrives`),
   served colocated (one Engine, in this process) and disaggregated (engine/disagg.py: the
   prompt computed by a prefill worker process, its K/V sent here): the running requests'
   p99 inter-token latency, the long prompt's TTFT and the bytes moved, each configuration's
   over the colocated one's, in one run, the configurations alternating.
2. Transfer against recompute: should a decode worker fetch a prompt's K/V or compute it
   again? Shipping L positions costs t_transfer(L) = a + L·B/W (a: the fixed cost of a
   transfer, B: bytes per position, K and V of every layer; W: bytes a second); computing
   them costs t_prefill(L) = p0 + p1·L. Transfer wins when a + L·B/W < p0 + p1·L, that is
   L·(p1 − B/W) > a − p0: when a position costs more to compute than to ship (p1 > B/W),
   for every L above L* = (a − p0) / (p1 − B/W) (every L when L* ≤ 0). The bench fits a, W
   from transfers of several sizes and p0, p1 from prefills of the same lengths, then checks
   the predicted winner against the measured times at each length.

The honest caveats: this is one machine. Both processes share its cores (one thread each);
the colocated baseline runs with one thread (and, as a second row, with two: every core in
one process). The K/V travels over gloo through the loopback interface, a memory copy
through the kernel, where a real deployment has NVLink or RDMA: W and a change by orders of
magnitude, the formula does not. Writes results.json and README.md to --out (default
runs/bench-disagg; nothing with --quick unless --out is given; the committed run:
benchmarks/disagg).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from ..course.arguments import positive
from ..course.files import mark_directory, write_atomically
from ..engine import Request
from ..engine.disagg import DisaggregatedEngine
from ..engine.serving import Engine
from . import device_and_out
from .load import long_prompt_arrives

BLOCKS = 256  # as bench-load's long-prompt case
CONFIGS = ("colocated, 1 thread", "colocated, 2 threads", "disaggregated, 1 + 1 threads")


def one_run(model, config: str, long: dict) -> dict:
    """One run of the long-prompt case on a fresh engine of `config`: bench-load's numbers,
    the bytes moved, and the requests' tokens (to check every configuration agrees)."""
    torch.set_num_threads(2 if "2 threads" in config else 1)
    disaggregated = config.startswith("disaggregated")
    engine = DisaggregatedEngine(model, BLOCKS) if disaggregated else Engine(model, BLOCKS)
    try:
        row = long_prompt_arrives(model, None, engine=engine, **long)
        row["bytes_moved"] = engine.stats().get("bytes_moved", 0)
        moved = getattr(engine, "transfers", {}).get(long["n_running"], {})
        row["long_prefill_there"] = moved.get("prefill_s", 0.0)  # in its TTFT: the worker's
        row["long_transfer"] = moved.get("seconds", 0.0)  # prefill, then its K/V's trip
        row["tokens"] = [o.tokens for o in engine.outputs().values()]
    finally:
        if disaggregated:
            engine.close()
    return row


def long_prompt(model, long: dict, repeats: int) -> list[dict]:
    """Every configuration `repeats` times in turn; medians, and ratios to colocated's."""
    runs = {c: [] for c in CONFIGS}
    for _ in range(repeats):
        for config in CONFIGS:
            runs[config].append(one_run(model, config, long))
    tokens = runs[CONFIGS[0]][0]["tokens"]
    rows = []
    for config, got in runs.items():
        row = {"config": config} | {k: statistics.median(r[k] for r in got)
                                    for k in got[0] if k != "tokens"}
        row["same_tokens"] = all(r["tokens"] == tokens for r in got)
        rows.append(row)
    for row in rows:
        for base, name in ((rows[0], "1t"), (rows[1], "2t")):
            row[f"itl_p99_vs_{name}"] = row["itl_p99"] / base["itl_p99"]
            row[f"long_ttft_vs_{name}"] = row["long_ttft"] / base["long_ttft"]
    return rows


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares: y ≈ a + b·x."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def recompute_seconds(model, prompt: list[int]) -> float:
    """Seconds to compute `prompt`'s K/V on a fresh Engine in this process (one thread):
    what the prefill worker does, here."""
    engine = Engine(model, BLOCKS)
    start = time.perf_counter()
    engine.add(Request(prompt, 1))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def transfer_vs_recompute(model, lengths: list[int], repeats: int) -> dict:
    """For each length L: the transfer of L positions (seconds, bytes) through a
    DisaggregatedEngine, and their recompute here, alternating; the fits and the break-even
    (module doc), and the predicted winner against the measured one at each L."""
    torch.set_num_threads(1)
    rng, vocab = random.Random(1), model.config.vocab_size
    samples = {n: {"transfer": [], "recompute": [], "bytes": 0} for n in lengths}
    with DisaggregatedEngine(model, BLOCKS) as engine:
        for k in range(repeats + 1):  # the first round, untimed: warm-up
            for n in lengths:
                prompt = [rng.randrange(1, vocab) for _ in range(n + 1)]  # n travel
                index = engine.add(Request(prompt, 1))
                while engine.has_work():
                    engine.step()
                moved = engine.transfers[index]
                engine.forget(index)
                local = recompute_seconds(model, prompt[:-1])
                if k:
                    samples[n]["transfer"].append(moved["seconds"])
                    samples[n]["recompute"].append(local)
                    samples[n]["bytes"] = moved["bytes"]
    rows = [{"positions": n, "bytes": s["bytes"],
             "transfer_s": statistics.median(s["transfer"]),
             "recompute_s": statistics.median(s["recompute"])} for n, s in samples.items()]
    a, per_byte = line([r["bytes"] for r in rows], [r["transfer_s"] for r in rows])
    p0, p1 = line([r["positions"] for r in rows], [r["recompute_s"] for r in rows])
    per_position = rows[-1]["bytes"] / rows[-1]["positions"]  # B
    ship = per_position * per_byte  # B / W: seconds to ship one position
    cut = (a - p0) / (p1 - ship) if p1 != ship else float("inf")
    for r in rows:
        n = r["positions"]
        r["predicted_transfer_s"], r["predicted_recompute_s"] = a + ship * n, p0 + p1 * n
        r["predicted"] = "transfer" if a + ship * n < p0 + p1 * n else "recompute"
        r["measured"] = "transfer" if r["transfer_s"] < r["recompute_s"] else "recompute"
    return {"latency_s": a, "seconds_per_byte": per_byte,  # 1 / W (a noisy fit: maybe <= 0)
            "bandwidth_bytes_per_s": 1 / per_byte if per_byte > 0 else None,
            "bytes_per_position": per_position, "prefill_fixed_s": p0,
            "prefill_per_position_s": p1, "ship_per_position_s": ship, "break_even": cut,
            "transfer_wins_above": p1 > ship, "rows": rows,
            "agree": sum(r["predicted"] == r["measured"] for r in rows)}


def bench(model, quick: bool, repeats: int | None = None, others: dict | None = None) -> dict:
    """The long-prompt case on `model`; the break-even on it and on `others` ({name: model}:
    a cheaper model computes a position faster, so its break-even moves up)."""
    repeats = repeats or (1 if quick else 5)
    long = dict(n_running=4, n_new=12, long_len=40, after_steps=3) if quick else dict(
        n_running=8, n_new=64, long_len=224, after_steps=16)  # bench-load's full case
    lengths = [8, 32, 64] if quick else [4, 16, 32, 64, 128, 192, 248]
    models = {"the model above": model} | (others or {})
    return {"long": long, "repeats": repeats,
            "long_prompt": long_prompt(model, long, repeats),
            "break_even": [{"model": name} | transfer_vs_recompute(m, lengths, 3 * repeats)
                           for name, m in models.items()]}  # short and noisy: more runs


def readme(results: dict) -> str:
    m, r = results["machine"], results
    lp = r["long"]
    lines = [f"# Disaggregated serving (`{results['command']}`)", "",
             f"{m['model']}, {m['device']}, {m['cores']} cores, torch {m['torch']}, "
             f"{m['date']}; load average {m['load_average_at_start']:.2f} at the start. Both "
             "processes of the disaggregated engine share this machine's cores, one thread "
             "each; the K/V travels over gloo through the loopback interface.", "",
             f"## A {lp['long_len']}-token prompt arriving beside {lp['n_running']} decoding "
             f"requests ({lp['n_new']} tokens each)", "",
             f"Medians of {r['repeats']} runs, the configurations alternating; ratios to "
             "colocated with 1 thread (1t) and with 2 threads (2t).", "",
             "Other work on the machine (the load average above) takes cores from all three; "
             "two threads in one process lose the most, a step waiting for its slower thread. "
             "In the disaggregated TTFT: the worker's prefill and the K/V's transfer (the "
             "rest: the prompt's trip there, waits for a core and for a step boundary, and "
             "the step that computes its last position).", "",
             "| configuration | running ITL p50 ms | p99 ms | p99 / 1t | p99 / 2t | "
             "long prompt's TTFT ms | TTFT / 1t | TTFT / 2t | of which prefill there ms | "
             "transfer ms | bytes moved | same tokens |", "|" + "---|" * 12]
    for row in r["long_prompt"]:
        lines.append(
            f"| {row['config']} | {row['itl_p50'] * 1e3:.1f} | {row['itl_p99'] * 1e3:.1f} | "
            f"{row['itl_p99_vs_1t']:.2f} | {row['itl_p99_vs_2t']:.2f} | "
            f"{row['long_ttft'] * 1e3:.1f} | {row['long_ttft_vs_1t']:.2f} | "
            f"{row['long_ttft_vs_2t']:.2f} | {row['long_prefill_there'] * 1e3:.1f} | "
            f"{row['long_transfer'] * 1e3:.1f} | {row['bytes_moved']:,.0f} | "
            f"{row['same_tokens']} |")
    lines += ["", "## Transfer against recompute", "",
              "t_transfer(L) = a + L·B/W, t_prefill(L) = p0 + p1·L; transfer wins when "
              "L·(p1 − B/W) > a − p0 (module doc of minikv/bench/disagg.py). Medians of "
              f"{3 * r['repeats']} runs at each length, transfer and recompute alternating. "
              "A transfer that waits for a core (the machine's other work) takes a few ms "
              "more: a short transfer's times are noisy."]
    for be in r["break_even"]:
        lines += ["", *break_even_text(be)]
    return "\n".join(lines) + "\n"


def break_even_text(be: dict) -> list[str]:
    side = "above" if be["transfer_wins_above"] else "below"
    bw = be["bandwidth_bytes_per_s"]
    lines = [f"### {be['model']}", "",
             f"Fitted: a = {be['latency_s'] * 1e6:.0f} µs, B = "
             f"{be['bytes_per_position']:,.0f} bytes a position, W = "
             f"{bw / 1e9 if bw else float('nan'):.2f} GB/s (B/W = "
             f"{be['ship_per_position_s'] * 1e6:.2f} µs a position), p0 = "
             f"{be['prefill_fixed_s'] * 1e6:.0f} µs, p1 = "
             f"{be['prefill_per_position_s'] * 1e6:.1f} µs a position: L* = "
             f"{be['break_even']:.1f}, transfer predicted to win {side} it. Predicted "
             f"winner = measured winner at {be['agree']} of {len(be['rows'])} lengths.", "",
             "| positions L | bytes | transfer ms | predicted | recompute ms | predicted | "
             "faster (measured) | faster (predicted) |", "|" + "---|" * 8]
    for row in be["rows"]:
        lines.append(
            f"| {row['positions']} | {row['bytes']:,} | {row['transfer_s'] * 1e3:.3f} | "
            f"{row['predicted_transfer_s'] * 1e3:.3f} | {row['recompute_s'] * 1e3:.3f} | "
            f"{row['predicted_recompute_s'] * 1e3:.3f} | {row['measured']} | "
            f"{row['predicted']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-disagg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random model; checks only")
    parser.add_argument("--device", default="cpu", choices=["cpu"],
                        help="the K/V travels over gloo: CPU tensors")
    parser.add_argument("--repeats", type=positive, default=None,
                        help="runs of each configuration (default 5; 1 with --quick)")
    parser.add_argument("--out", default=None,
                        help="default: runs/bench-disagg, nothing with --quick (the committed "
                             "run: --out benchmarks/disagg)")
    args = parser.parse_args(argv)
    device, out = device_and_out(parser, args, "bench-disagg")
    if args.quick:
        from . import random_model
        model, name = random_model("tiny", device), "tiny preset, random weights"
        others = {}
    else:
        from ..course.checkpoint import load_course_model
        model, name = load_course_model("target", device)[0], "course target"
        others = {"course draft": load_course_model("draft", device)[0]}
    machine = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "model": name, "device": "cpu", "cores": os.cpu_count(),
               "torch": torch.__version__, "platform": platform.platform(),
               "load_average_at_start": os.getloadavg()[0]}
    results = {"command": "python -m minikv bench-disagg " + " ".join(
                   sys.argv[2:] if argv is None else argv), "machine": machine}
    results |= bench(model, args.quick, args.repeats, others)
    results["break_even"][0]["model"] = name
    text = readme(results)
    print(text)
    if out is not None:
        mark_directory(out, "bench-disagg")
        write_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")
        write_atomically(out / "README.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
