"""`python -m minikv bench-load`: the server under load, in wall-clock time.

Requests arrive as a Poisson process (seconds, not engine steps), their prompt and output
lengths long-tailed (uniform in their logarithm: many short, a few long); the engine
(engine/serving.py's Engine, the loop the HTTP server runs) adds each when its time comes and
steps while anything runs. Every token is stamped when the step that made it ends, so:

- TTFT (time to first token): first token − arrival (queueing and the prompt's prefill);
- ITL (inter-token latency): the gap between a request's consecutive tokens;
- E2E: last token − arrival; throughput: output tokens / seconds;
- goodput: the requests a second that met the SLO (TTFT and mean ITL both within bounds),
  DistServe's measure: throughput that is no use to a user who gave up does not count.

Machines differ, so every time is also given in units of one measured step: `step_1`, the
median time of a decode step with one request running, measured first in the same run. The
SLO is set in those units (TTFT ≤ 30 steps, mean ITL ≤ 3 steps), and the arrival rates are
fractions of the capacity measured in the same run (every request arriving at once).

Three experiments: latency at several arrival rates and policies; a long prompt arriving
beside running decodes (its ITL spike, without and with chunked prefill); and a step's cost
against the tokens it computes (the straight line chapter 06's students predict, then measure).
Writes results.json and README.md to --out (default runs/bench-load; `make bench` writes
benchmarks/load/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..course.files import claim_directory, mark_directory, write_atomically
from ..engine import KVCounter, Request
from ..engine.scheduler import FirstComeFirstServed
from ..engine.serving import Engine


@dataclass
class Timed:
    """One request of a load run: when it arrived and when each of its tokens came out."""
    arrival: float
    prompt_len: int
    tokens: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.tokens, self.tokens[1:])]

    @property
    def e2e(self) -> float:
        return self.tokens[-1] - self.arrival


def long_tailed(n: int, rate: float | None, seed: int, vocab: int, prompt=(8, 160),
                output=(4, 64)) -> list[tuple[float, Request]]:
    """n greedy requests of random tokens, (arrival seconds, Request): lengths uniform in their
    logarithm within `prompt` and `output`; Poisson arrivals at `rate` a second (None: all at
    0, the offline case that measures capacity). No EOS: each makes exactly its budget."""
    rng = random.Random(seed)
    t, out = 0.0, []

    def draw(lo, hi):
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    for _ in range(n):
        t += rng.expovariate(rate) if rate else 0.0
        prompt_ids = [rng.randrange(1, vocab) for _ in range(draw(*prompt))]
        out.append((t, Request(prompt_ids, draw(*output))))
    return out


def run(model, workload: list[tuple[float, Request]], policy=None, *, num_blocks: int = 256,
        page_size: int = 16, max_running: int = 16) -> tuple[list[Timed], list[tuple[int, float]]]:
    """Serve `workload` in real time: each request added when its arrival time has passed,
    the engine stepped while anything runs. The requests' token times, and each step's
    (tokens computed, seconds)."""
    engine = Engine(model, num_blocks, page_size=page_size, max_running=max_running,
                    policy=policy)
    timed = [Timed(t, len(r.prompt)) for t, r in workload]
    steps, pending, start = [], 0, time.perf_counter()
    with KVCounter(model) as counter:
        while pending < len(workload) or engine.has_work():
            now = time.perf_counter() - start
            while pending < len(workload) and workload[pending][0] <= now:
                engine.add(workload[pending][1], index=pending)
                pending += 1
            if not engine.has_work():  # idle until the next arrival
                time.sleep(max(0.0, workload[pending][0] - now))
                continue
            before, t0 = counter.count, time.perf_counter()
            moved = engine.step()
            t1 = time.perf_counter()
            steps.append((counter.count - before, t1 - t0))
            for i, (tokens, _) in moved.items():
                timed[i].tokens += [t1 - start] * len(tokens)
    return timed, steps


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (linear between ranks, as numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def report(timed: list[Timed], step_1: float, slo_ttft: float, slo_itl: float) -> dict:
    """Percentiles of TTFT, ITL and E2E (in seconds and in units of step_1), throughput, and
    goodput under the SLO (bounds in step_1 units)."""
    ttft = [r.ttft for r in timed]
    itl = [x for r in timed for x in r.itls]
    e2e = [r.e2e for r in timed]
    span = max(r.tokens[-1] for r in timed) - min(r.arrival for r in timed)
    good = [r for r in timed if r.ttft <= slo_ttft * step_1
            and (not r.itls or statistics.mean(r.itls) <= slo_itl * step_1)]
    row = {"requests": len(timed), "seconds": span,
           "tokens_per_s": sum(len(r.tokens) for r in timed) / span,
           "requests_per_s": len(timed) / span,
           "goodput_per_s": len(good) / span, "slo_met": len(good) / len(timed)}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = pct(values, q)
            row[f"{name}_p{q}_steps"] = pct(values, q) / step_1
    return row


def one_step(model, repeats: int = 30) -> float:
    """step_1: the median seconds of a decode step with one request running."""
    engine = Engine(model, 64)
    engine.add(Request([1, 2, 3, 4], repeats + 5))
    engine.step()  # its prefill
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def policies(budgets) -> dict:
    out = {"first come, first served": None,
           "token budget 64 (no chunks)": FirstComeFirstServed(64)}
    return out | {f"chunked prefill, budget {b}": FirstComeFirstServed(b, chunked_prefill=True)
                  for b in budgets}


def long_prompt_arrives(model, policy, n_running: int, n_new: int, long_len: int,
                        after_steps: int, engine=None) -> dict:
    """n_running short requests decoding, a long_len-token prompt arriving after_steps steps
    in: the ITL of the running requests (p50, p99, max) while it is computed, and the long
    request's TTFT; seconds. `engine`: an Engine-like one to drive (bench-disagg's), fresh;
    default a new Engine."""
    engine = engine or Engine(model, 256, policy=policy)
    rng = random.Random(0)
    for i in range(n_running):
        engine.add(Request([rng.randrange(1, 500) for _ in range(8)], n_new), index=i)
    times = {i: [] for i in range(n_running + 1)}
    start = time.perf_counter()
    step = 0
    while engine.has_work():
        if step == after_steps:
            arrived = time.perf_counter() - start
            engine.add(Request([rng.randrange(1, 500) for _ in range(long_len)], 4),
                       index=n_running)
        moved = engine.step()
        t = time.perf_counter() - start
        step += 1
        for i, (tokens, _) in moved.items():
            times[i] += [t] * len(tokens)
    itl = [b - a for i in range(n_running) for a, b in zip(times[i], times[i][1:])]
    return {"itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_max": max(itl),
            "long_ttft": times[n_running][0] - arrived}


def step_cost(model, token_counts, running: int, repeats: int) -> list[dict]:
    """Seconds of one engine step under chunked prefill by the tokens it computes: `running`
    requests decoding (a token each) beside one prompt chunk of n − running tokens."""
    rows = []
    for n in token_counts:
        times = []
        for k in range(repeats + 1):  # the first, untimed: warm-up
            engine = Engine(model, 128, policy=FirstComeFirstServed(n, chunked_prefill=True))
            for i in range(running):
                engine.add(Request([7, 8, 9, 10 + i], 8), index=i)
            engine.step()  # their prefill
            engine.add(Request(list(range(1, 200)), 2), index=running)
            t0 = time.perf_counter()
            engine.step()  # `running` decode rows and a chunk of n - running
            if k:
                times.append(time.perf_counter() - t0)
        rows.append({"tokens": n, "seconds": statistics.median(times)})
    return rows


def fit_line(rows: list[dict]) -> tuple[float, float]:
    """Least squares: seconds ≈ a + b · tokens."""
    xs, ys = [r["tokens"] for r in rows], [r["seconds"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


OFFLINE_BLOCKS, OFFLINE_PAGE = 256, 16  # the offline pool, minikv's and transformers' alike


def offline(model, prompts: list[list[int]], n_new: int, policy=None) -> list[list[int]]:
    """Every prompt at once through the Engine, n_new greedy tokens each: their tokens."""
    engine = Engine(model, OFFLINE_BLOCKS, page_size=OFFLINE_PAGE, policy=policy)
    for i, p in enumerate(prompts):
        engine.add(Request(p, n_new), index=i)
    out = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for i, (tokens, _) in engine.step().items():
            out[i] += tokens
    return [out[i] for i in range(len(prompts))]


def vs_transformers(model, n: int, n_new: int, repeats: int) -> dict | None:
    """The peer row: the same offline workload (n long-tailed prompts, n_new greedy tokens
    each, all at once) through minikv's Engine and through transformers' own continuous
    batching (`generate_batch`: its paged cache and scheduler, SDPA attention, its manager
    kept alive between calls) on the model exported as a Hugging Face checkpoint; seconds
    (medians, alternating after one untimed warm-up each, which also starts transformers'
    manager) and whether every request got the same tokens. Both get the same pool: 256 blocks
    of 16 positions (transformers would otherwise take 90% of the free memory for its cache,
    14.7 GB of a 24 GB machine). None when transformers is missing or has no generate_batch."""
    import logging
    import tempfile

    try:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    from ..course.export import export_hf
    from . import alternate
    prompts = [r.prompt for _, r in long_tailed(n, None, 4, model.config.vocab_size)]
    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_pretrained(export_hf(model, Path(tmp) / "hf"),
                                                  attn_implementation="sdpa").eval()
    if not hasattr(hf, "generate_batch"):
        return None
    for name in ("ContinuousBatchingLogger", "transformers"):  # its advice, once per call
        logging.getLogger(name).setLevel(logging.ERROR)
    config = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    pool = ContinuousBatchingConfig(page_size=OFFLINE_PAGE, num_blocks=OFFLINE_BLOCKS)

    def theirs():  # its manager kept between calls, as a running server keeps it
        results = hf.generate_batch(prompts, generation_config=config, persistent_manager=True,
                                    continuous_batching_config=pool)
        return [r.generated_tokens for r in results.values()]
    runs = {"minikv": lambda: offline(model, prompts, n_new),
            "minikv, chunked prefill 256": lambda: offline(
                model, prompts, n_new, FirstComeFirstServed(256, chunked_prefill=True)),
            "transformers generate_batch": theirs}
    same = {name: fn() == theirs() for name, fn in runs.items()}  # the warm-up, compared
    seconds = alternate(runs, repeats, torch.device("cpu"))
    base = seconds["transformers generate_batch"]
    return {"requests": n, "new_tokens": n_new, "rows": [
        {"engine": name, "seconds": t, "tokens_per_s": n * n_new / t, "speedup": base / t,
         "same_tokens": same[name]} for name, t in seconds.items()]}


def medians(configs: dict, measure, repeats: int) -> dict[str, dict]:
    """Each config's measure(config) `repeats` times, the configs in turn (A, B, A, B, ...: drift
    hits all alike), and the median of every number across its repeats."""
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            runs[name].append(measure(config))
    return {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for name, rows in runs.items()}


def bench(model, quick: bool) -> dict:
    """Every experiment of the module docstring; each row a median of `repeats` runs."""
    vocab, repeats = model.config.vocab_size, 1 if quick else 3
    n = 12 if quick else 48
    shape = dict(prompt=(4, 24), output=(2, 8)) if quick else {}
    slo = {"ttft_steps": 30, "itl_steps": 3}
    step_1 = one_step(model, 5 if quick else 30)
    t0 = time.perf_counter()
    offline_run, _ = run(model, long_tailed(n, None, 1, vocab, **shape))
    capacity = len(offline_run) / (time.perf_counter() - t0)
    out = {"step_1": step_1, "slo": slo, "capacity_requests_per_s": capacity,
           "repeats": repeats, "rates": [], "policies": [], "long_prompt": []}

    def latency(rate, seed):
        def measure(policy):
            timed, _ = run(model, long_tailed(n, rate, seed, vocab, **shape), policy)
            return report(timed, step_1, slo["ttft_steps"], slo["itl_steps"])
        return measure
    for fraction in ((0.5, 1.0) if quick else (0.25, 0.5, 0.75, 1.0)):
        rows = medians({"first come, first served": None,
                        "chunked prefill, budget 64":
                            FirstComeFirstServed(64, chunked_prefill=True)},
                       latency(fraction * capacity, 2), repeats)
        out["rates"] += [{"load": fraction, "rate": fraction * capacity, "policy": name} | row
                         for name, row in rows.items()]
    rows = medians(policies((16, 32) if quick else (16, 32, 64, 128)),
                   latency(0.75 * capacity, 3), repeats)
    out["policies"] = [{"policy": name} | row for name, row in rows.items()]
    long = dict(n_running=4, n_new=12, long_len=40, after_steps=3) if quick else dict(
        n_running=8, n_new=64, long_len=224, after_steps=16)
    rows = medians({"first come, first served": None,
                    "chunked prefill, budget 32": FirstComeFirstServed(32, chunked_prefill=True),
                    "chunked prefill, budget 64": FirstComeFirstServed(64, chunked_prefill=True)},
                   lambda policy: long_prompt_arrives(model, policy, **long), 1 if quick else 5)
    out["long_prompt"] = [{"policy": name} | long | row for name, row in rows.items()]
    running = 4 if quick else 8
    counts = [running + k for k in ((1, 8, 16) if quick else (1, 16, 32, 64, 96, 128, 192))]
    out["step_cost"] = step_cost(model, counts, running, 2 if quick else 7)
    a, b = fit_line(out["step_cost"])
    out["step_cost_fit"] = {"fixed_s": a, "per_token_s": b}
    for r in out["step_cost"]:
        r["predicted"] = a + b * r["tokens"]
    out["vs_transformers"] = vs_transformers(model, 4 if quick else 32, 4 if quick else 32,
                                             1 if quick else 3)
    return out


def plots(r: dict) -> bytes:
    """Two panels: p99 TTFT and ITL (in step_1 units) against the load, per policy; and against
    the chunk budget at 0.75 of capacity. A PNG."""
    import io

    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 3.6))
    by_load, by_budget = fig.subplots(1, 2)
    for policy, color in zip(dict.fromkeys(row["policy"] for row in r["rates"]),
                             ("#264653", "#e76f51")):  # one colour a policy
        rows = [row for row in r["rates"] if row["policy"] == policy]
        for key, style in (("ttft_p99_steps", "o-"), ("itl_p99_steps", "s--")):
            by_load.plot([row["load"] for row in rows], [row[key] for row in rows], style,
                         color=color, label=f"{policy}: {key.split('_')[0].upper()} p99")
    by_load.set(xlabel="arrival rate / capacity", ylabel="step_1 units", yscale="log",
                title="p99 latency by load")
    by_load.legend(fontsize=7)
    chunked = [row for row in r["policies"] if row["policy"].startswith("chunked")]
    budgets = [int(row["policy"].rsplit(" ", 1)[1]) for row in chunked]
    for key, style in (("ttft_p99_steps", "o-"), ("itl_p99_steps", "s--")):
        by_budget.plot(budgets, [row[key] for row in chunked], style,
                       label=f"{key.split('_')[0].upper()} p99")
    by_budget.set(xlabel="chunk budget (tokens a step)", ylabel="step_1 units", xscale="log",
                  yscale="log", title="chunked prefill at 0.75 of capacity")
    by_budget.set_xticks(budgets, [str(b) for b in budgets])
    by_budget.minorticks_off()
    by_budget.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["load"]
    s1 = r["step_1"]
    lines = [f"# The server under load ({m['model']}, {m['device']}, {m['date']})", "",
             f"step_1 (one decode step, one request running) = {s1 * 1e3:.2f} ms; capacity "
             f"(all {r['rates'][0]['requests']} requests at once) = "
             f"{r['capacity_requests_per_s']:.2f} requests/s. SLO: TTFT ≤ "
             f"{r['slo']['ttft_steps']} step_1, mean ITL ≤ {r['slo']['itl_steps']} step_1. "
             f"Times in ms (in step_1 units in brackets); each row the median of {r['repeats']} "
             "runs (5 for the long prompt), the configurations alternating. Rows of one "
             "Poisson workload move from run to run, most of all goodput, which counts "
             "requests on either side of the SLO's edge; compare rows of the same table, and "
             "rerun before reading a single difference.", "",
             "## Latency by arrival rate", "",
             "| load | policy | req/s | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | E2E p50 | "
             "p99 | tokens/s | goodput req/s | SLO met |", "|" + "---|" * 14]

    def ms(row, key):
        return f"{row[key] * 1e3:.0f} ({row[key + '_steps']:.1f})"
    for row in r["rates"]:
        lines.append(f"| {row['load']:.2f} | {row['policy']} | {row['rate']:.2f} | "
                     + " | ".join(ms(row, f"{k}_p{q}") for k, qs in
                                  (("ttft", (50, 90, 99)), ("itl", (50, 90, 99)),
                                   ("e2e", (50, 99))) for q in qs)
                     + f" | {row['tokens_per_s']:.0f} | {row['goodput_per_s']:.2f} | "
                       f"{row['slo_met']:.0%} |")
    lines += ["", "## Policy and chunk budget at 0.75 of capacity", "",
              "| policy | TTFT p50 | p99 | ITL p50 | p99 | tokens/s | goodput req/s | SLO met |",
              "|" + "---|" * 8]
    for row in r["policies"]:
        lines.append(f"| {row['policy']} | " + " | ".join(
            ms(row, k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"))
            + f" | {row['tokens_per_s']:.0f} | {row['goodput_per_s']:.2f} | "
              f"{row['slo_met']:.0%} |")
    lp = r["long_prompt"][0]
    lines += ["", f"## A {lp['long_len']}-token prompt arriving beside {lp['n_running']} "
              "decoding requests", "",
              "| policy | running ITL p50 ms | p99 ms | max ms | p99 / FCFS p99 | "
              "long prompt's TTFT ms |", "|---|---|---|---|---|---|"]
    base = r["long_prompt"][0]["itl_p99"]
    for row in r["long_prompt"]:
        lines.append(f"| {row['policy']} | {row['itl_p50'] * 1e3:.1f} | "
                     f"{row['itl_p99'] * 1e3:.1f} | {row['itl_max'] * 1e3:.1f} | "
                     f"{row['itl_p99'] / base:.2f} | {row['long_ttft'] * 1e3:.0f} |")
    fit = r["step_cost_fit"]
    lines += ["", "## A step's cost by the tokens it computes (chunked prefill)", "",
              f"Least-squares line: {fit['fixed_s'] * 1e3:.2f} ms + "
              f"{fit['per_token_s'] * 1e6:.1f} µs × tokens.", "",
              "| tokens | measured ms | line ms |", "|---|---|---|"]
    for row in r["step_cost"]:
        lines.append(f"| {row['tokens']} | {row['seconds'] * 1e3:.2f} | "
                     f"{row['predicted'] * 1e3:.2f} |")
    peer = r["vs_transformers"]
    if peer:
        lines += ["", f"## Peer: {peer['requests']} requests at once, {peer['new_tokens']} greedy "
                  "tokens each, against transformers' continuous batching", "",
                  "| engine | seconds | tokens/s | speed-up over transformers | same tokens |",
                  "|---|---|---|---|---|"]
        for row in peer["rows"]:
            lines.append(f"| {row['engine']} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} | "
                         f"{row['speedup']:.2f} | {row['same_tokens']} |")
    lines += ["", "![latency by load and by chunk budget](plots.png)"]
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "plots.png", plots(r))
    write_atomically(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a random tiny model, few requests: checks the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-load; the committed run: benchmarks/load)")
    args = parser.parse_args(argv)
    out = args.out or Path("runs") / ("bench-load-quick" if args.quick else "bench-load")
    try:
        # new, empty, or bench-load's own (benchmarks/load is): never anyone else's folder
        claim_directory(out, "bench-load")
    except ValueError as e:
        parser.error(str(e))
    if args.quick:
        from . import random_model
        model, name = random_model("tiny", "cpu"), "tiny preset, random weights"
    else:
        from ..course.checkpoint import load_course_model
        model, name = load_course_model("target", "cpu")[0], "course target"
    results = {"machine": {"date": datetime.date.today().isoformat(), "model": name,
                           "device": "cpu", "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "platform": platform.platform(),
                           "load_average_at_start": os.getloadavg()[0]},
               "load": bench(model, args.quick)}
    mark_directory(out, "bench-load")
    write_report(results, out)
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
