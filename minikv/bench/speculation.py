"""`python -m minikv bench-spec`: speculation beyond a draft model, measured on this machine.

For the same prompts in the same run: the target alone (cached greedy, the baseline), the draft
model proposing chains, the feature head (engine/eagle.py) proposing chains, and the feature head
proposing token trees; for each, γ from a range, the output checked identical to the baseline's,
α (accepted over judged proposals), tokens committed per target pass, and the speed-up: the
baseline's median time over the method's, the two run in turn (A, B, A, B, ...) so that drift hits
both alike. Writes results.json, README.md and serving.png to runs/bench-spec (the committed run,
quoted by chapter 10: `--out benchmarks/speculation`); `--quick` checks the machinery on tiny
random models (its numbers mean nothing) and writes nothing unless given --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..course.device import describe_device
from ..course.files import mark_directory, write_atomically
from ..engine import GPT, GPTConfig, Request, Speculation, generate, serve, speculative_generate
from ..engine.eagle import FeatureHead, feature_generate, tree_size
from ..engine.speculative import Proposer
from . import OUT_DIR as BENCHMARKS
from . import alternate, alternate_all, device_and_out

OUT_DIR = BENCHMARKS / "speculation"
PROMPTS = ("Once upon a time", "The color of dog", "A coin's state is heads. Alice flips",
           "A coin's state is tails. Bob doesn't flip it. Carol flips")


def methods(target, draft, head, gammas, trees) -> dict[str, tuple[int, object]]:
    """label -> (γ, generate(prompt, n) for that method)."""
    out = {}
    for g in gammas:
        out[f"draft model, γ={g}"] = (g, lambda p, n, g=g: speculative_generate(
            target, draft, p, n, gamma=g))
        out[f"feature head, γ={g}"] = (g, lambda p, n, g=g: feature_generate(
            target, head, p, n, gamma=g))
        for t in trees:
            out[f"feature tree {t[0]}x{t[1]}, γ={g}"] = (g, lambda p, n, g=g, t=t: feature_generate(
                target, head, p, n, gamma=g, tree=t))
    return out


def bench_proposers(target, draft, head, prompts, n_tokens, gammas, trees, repeats,
                    device) -> list[dict]:
    base = [generate(target, p, n_tokens).tokens for p in prompts]
    rows = []
    for label, (gamma, run) in tqdm(methods(target, draft, head, gammas, trees).items(),
                                    desc="proposers"):
        outs = [run(p, n_tokens) for p in prompts]
        stats = [o.stats for o in outs]
        accepted = sum(s.accepted for s in stats)
        judged = accepted + sum(s.rejected_rounds for s in stats)
        t = alternate({"target": lambda: [generate(target, p, n_tokens) for p in prompts],
                       "method": lambda run=run: [run(p, n_tokens) for p in prompts]},
                      repeats, device)
        rows.append({
            "method": label.split(",")[0], "gamma": gamma, "label": label,
            "identical": [o.tokens for o in outs] == base,
            "alpha": accepted / judged if judged else None,
            "tokens_per_target_pass": (sum(s.new_tokens for s in stats)
                                       / sum(s.target_passes for s in stats)),
            "proposed_per_round": sum(s.proposed for s in stats) / max(sum(s.rounds for s in stats),
                                                                       1),
            "target_s": t["target"], "method_s": t["method"],
            "speedup": t["target"] / t["method"]})
    return rows


class RowTimer:
    """Seconds of each forward pass of `model` and the token rows it computed (idx.numel())."""

    def __init__(self, model):
        self.model, self.passes, self._start, self._handles = model, [], 0.0, []

    def __enter__(self) -> RowTimer:
        def before(module, args):
            self._start = time.perf_counter()

        def after(module, args, output):
            self.passes.append((args[0].numel(), time.perf_counter() - self._start))
        self._handles = [self.model.register_forward_pre_hook(before),
                         self.model.register_forward_hook(after)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


class NoProposals(Proposer):
    """A proposer that never proposes: `serve(..., speculative=Speculation(proposer=
    NoProposals()))` decodes one token a step through the same packed pass with a mask that
    verifies proposals, the plain server's twin on the speculating server's kernel."""

    def propose(self, seq: list[int], k: int) -> list[int]:
        return []


def spread(times: dict[str, list[float]]) -> dict:
    """min, median and max of each callable's seconds."""
    return {name: {"min": min(t), "median": statistics.median(t), "max": max(t)}
            for name, t in times.items()}


def bench_serving(target, speculation: Speculation, prompts, n_tokens, batches, repeats,
                  device) -> list[dict]:
    """For each batch size B: B greedy requests (the prompts in turn) served together, plainly
    and with speculation, timed in turn. Both run on the same kernel: plain decoding is the
    speculating server with a proposer that proposes nothing (`NoProposals`), so each of its
    steps is ONE packed pass with a mask of B rows, the verify pass's kind (the server's own
    decode step reads the paged cache with another kernel, `paged_attention`: its pass is
    timed beside, for reference, and compared with nothing). Throughput: new tokens per
    second; latency: seconds per new token of a request (all arrive at once and run
    together); min, median and max of the alternated runs. Beside them what explains the
    curve: the rows a step's pass computes (B plain; B × (1 + proposals) to verify), that
    pass's median seconds, and the tokens a row commits per step."""
    plain_spec = Speculation(gamma=1, proposer=NoProposals())
    rows = []
    for b in tqdm(batches, desc="serving"):
        reqs = [Request(prompts[i % len(prompts)], n_tokens) for i in range(b)]
        plain_out = serve(target, reqs, speculative=plain_spec)
        paged_out = serve(target, reqs)
        with RowTimer(target) as paged_t:
            serve(target, reqs)
        with RowTimer(target) as plain_t:
            serve(target, reqs, speculative=plain_spec)
        with RowTimer(target) as spec_t, RowTimer(speculation.draft) as draft_t:
            spec_out = serve(target, reqs, speculative=speculation)
        times = alternate_all(
            {"plain": lambda: serve(target, reqs, speculative=plain_spec),
             "speculative": lambda: serve(target, reqs, speculative=speculation)},
            repeats, device)
        t = {name: statistics.median(x) for name, x in times.items()}
        tokens = sum(len(o.tokens) for o in plain_out)
        steps = statistics.mean(o.stats.rounds for o in spec_out)
        new = statistics.mean(len(o.tokens) for o in spec_out)
        accepted = sum(o.stats.accepted for o in spec_out)
        judged = accepted + sum(o.stats.rejected_rounds for o in spec_out)
        # the steady passes: decode rows = B (plain), verify rows > B (speculative)
        plain_pass = [sec for r, sec in plain_t.passes if r == b]
        paged_pass = [sec for r, sec in paged_t.passes if r == b]
        spec_pass = [(r, sec) for r, sec in spec_t.passes if r > b] or [(b, 0.0)]
        verify_steps = len([1 for r, _ in spec_t.passes if r > b]) or 1
        plain_tokens = [o.tokens for o in plain_out]
        rows.append({
            "batch": b, "identical": [o.tokens for o in spec_out] == plain_tokens,
            "identical_to_paged": [o.tokens for o in paged_out] == plain_tokens,
            "plain_s": t["plain"], "speculative_s": t["speculative"],
            "spread": spread(times),
            "plain_tokens_per_s": tokens / t["plain"],
            "speculative_tokens_per_s": tokens / t["speculative"],
            "plain_s_per_token": t["plain"] / n_tokens,
            "speculative_s_per_token": t["speculative"] / n_tokens,
            "speedup": t["plain"] / t["speculative"],
            "speedup_min": min(times["plain"]) / max(times["speculative"]),
            "speedup_max": max(times["plain"]) / min(times["speculative"]),
            "alpha": accepted / judged if judged else None,
            "tokens_per_row_step": (new - 1) / steps if steps else None,
            "decode_pass_rows": b, "decode_pass_s": statistics.median(plain_pass),
            "paged_decode_pass_s": statistics.median(paged_pass),
            "verify_pass_rows": statistics.median(r for r, _ in spec_pass),
            "verify_pass_s": statistics.median(sec for _, sec in spec_pass),
            # the draft's passes (one request at a time) over the steps that verified
            "draft_s_per_step": sum(sec for _, sec in draft_t.passes) / verify_steps})
    return rows


def serving_table(rows: list[dict]) -> str:
    lines = ["| batch | identical | tokens/s plain | tokens/s speculative | speed-up (min–max) | "
             "α | "
             "tokens a row commits per step | decode pass: rows, ms | verify pass: rows, ms | "
             "verify pass / decode pass | paged decode pass, ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {'yes' if r['identical'] else 'NO'} | "
            f"{r['plain_tokens_per_s']:.0f} | {r['speculative_tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | "
            f"{r['alpha']:.3f} | {r['tokens_per_row_step']:.2f} | "
            f"{r['decode_pass_rows']}, {1e3 * r['decode_pass_s']:.1f} | "
            f"{r['verify_pass_rows']:.0f}, {1e3 * r['verify_pass_s']:.1f} | "
            f"{r['verify_pass_s'] / r['decode_pass_s']:.2f} | "
            f"{1e3 * r['paged_decode_pass_s']:.1f} |")
    return "\n".join(lines)


# (key, label, line style, SERIES colour): the target decoding alone, and with a draft proposing
SERVING_SERIES = (("plain", "decode one token a step", "o-", "target"),
                  ("speculative", "speculate, verify in one pass", "s--", "draft"))


def plot_serving(rows: list[dict], path: Path) -> None:
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..viz.draw import SERIES
    batch = [r["batch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, style, colour in SERVING_SERIES:
        a.plot(batch, [r[f"{key}_tokens_per_s"] for r in rows], style, label=label,
               color=SERIES[colour])
        b.plot(batch, [1e3 * r[f"{key}_s_per_token"] for r in rows], style, label=label,
               color=SERIES[colour])
    for ax, title in ((a, "throughput (new tokens / s)"), (b, "latency (ms per new token)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests served together (batch)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomically(path, buf.getvalue())


def best(rows: list[dict]) -> list[dict]:
    """Each method's row at its fastest γ."""
    top: dict[str, dict] = {}
    for r in rows:
        if r["method"] not in top or r["speedup"] > top[r["method"]]["speedup"]:
            top[r["method"]] = r
    return list(top.values())


def table(rows: list[dict]) -> str:
    lines = ["| method | γ | identical | α | tokens / target pass | proposed / round | "
             "speed-up |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        alpha = "–" if r["alpha"] is None else f"{r['alpha']:.3f}"
        lines.append(f"| {r['method']} | {r['gamma']} | {'yes' if r['identical'] else 'NO'} | "
                     f"{alpha} | {r['tokens_per_target_pass']:.2f} | "
                     f"{r['proposed_per_round']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random models; checks only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None,
                        help="default: runs/bench-spec, nothing with --quick (the committed "
                             "run: --out benchmarks/speculation)")
    parser.add_argument("--serving-only", action="store_true",
                        help="rerun the serving curve only; keep the proposers' rows of the "
                             "results.json already in --out")
    args = parser.parse_args(argv)
    device, out = device_and_out(parser, args, "bench-spec")
    if args.quick:
        torch.manual_seed(0)
        target = GPT(GPTConfig.preset("tiny")).to(device).eval()
        draft = GPT(GPTConfig.preset("tiny", n_layer=1)).to(device).eval()
        head = FeatureHead(FeatureHead.config_for(target)).to(device).eval()
        prompts, n_tokens, gammas, trees, repeats = [[1, 2, 3], [4, 5]], 12, [2], [(2, 2)], 1
        batches, serve_tokens = [1, 2], 8
    else:
        from ..course.checkpoint import load_course_model, load_feature_head
        target, tok = load_course_model("target", device)
        draft, _ = load_course_model("draft", device)
        head = load_feature_head(target)
        prompts = [tok.encode(p) for p in PROMPTS]
        n_tokens, gammas, trees, repeats = 100, [2, 3, 4, 5, 6, 7, 8], [(2, 2), (4, 2), (2, 4)], 5
        batches, serve_tokens = [1, 2, 4, 8, 16, 32, 64], 48
    speculation = Speculation(gamma=3, draft=draft)  # the draft: timed in the serving rows
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    kept = None
    if args.serving_only:  # the proposers' rows of an earlier run in the same folder
        earlier = (out or OUT_DIR) / "results.json"
        if not earlier.is_file():
            parser.error(f"--serving-only keeps the proposers' rows of {earlier}, which does "
                         f"not exist: run without it first, or give that run's --out")
        kept = json.loads(earlier.read_text())
    with torch.inference_mode():
        rows = kept["rows"] if kept else bench_proposers(target, draft, head, prompts, n_tokens,
                                                          gammas, trees, repeats, device)
        serving = bench_serving(target, speculation, prompts, serve_tokens, batches,
                                max(1, (repeats + 1) // 2), device)
    results = {"device": describe_device(device), "threads": torch.get_num_threads(),
               "proposers_date": (kept.get("proposers_date") or kept["date"]) if kept else now,
               "proposers_threads": ((kept.get("proposers_threads") or kept["threads"]) if kept
                                     else torch.get_num_threads()),
               "platform": platform.platform(), "torch": torch.__version__,
               "date": now,
               "prompts": list(PROMPTS), "n_tokens": n_tokens, "repeats": repeats,
               "tree_sizes": {f"{w}x{b}": {g: tree_size(g, w, b) for g in gammas}
                              for w, b in trees},
               "rows": rows, "best": best(rows),
               "serving": {"gamma": speculation.gamma, "proposer": "draft model",
                           "n_tokens": serve_tokens, "rows": serving}}
    print(table(results["best"]))
    print(serving_table(serving))
    if out is not None:
        mark_directory(out, "bench-spec")
        write_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")
        write_atomically(out / "README.md", readme(results))
        plot_serving(serving, out / "serving.png")
    return 0 if all(r["identical"] for r in rows + serving) else 1


def readme(results: dict) -> str:
    return f"""# Speculation beyond a draft model (`python -m minikv bench-spec`)

Written by `python -m minikv bench-spec` on {results['device']} ({results['threads']} threads),
torch {results['torch']}, {results['date']}. Greedy, {results['n_tokens']} new tokens after each of
{len(results['prompts'])} course prompts; speed-up = the target alone (cached greedy) over the
method, medians of {results['repeats']} alternated runs in the same process. α: accepted over
judged proposals (a tree's round judges one node per depth until a refusal). A tree `WxB`: every
node that grows gets B children, and the W most likely paths grow at each depth (γ deep).

## Each method at its fastest γ

The largest speed-up of each method over the γ it was run at: on a noisy machine the top of many
noisy numbers, so read it with "Every row" below (a method's speed-up moves from one γ to the
next by as much as two methods differ).

{table(results['best'])}

## Every row

{table(results['rows'])}

## Speculation in a busy server

`serve(..., speculative=Speculation(gamma={results['serving']['gamma']}, draft=draft))`: B greedy
requests of {results['serving']['n_tokens']} new tokens, the prompts in turn, all arriving at once;
speed-up = plain serving's median time over the speculating server's (alternated runs; in brackets
the slowest plain run over the fastest speculative one, and the other way round). Both on the same
kernel: plain serving is the speculating server with a proposer that proposes nothing, one packed
pass with a mask a step, the verify pass's kind. The server's own decode step (`paged_attention`
through the block tables) is another kernel; its pass is timed in the last column, for reference.
Proposers' rows from {results.get('proposers_date') or results['date']}
({results.get('proposers_threads') or results['threads']} threads); this curve:
{results['threads']} thread(s).

{serving_table(results['serving']['rows'])}

![throughput and latency against batch size](serving.png)
"""
