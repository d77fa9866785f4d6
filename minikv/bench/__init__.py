"""`python -m minikv bench`: how fast the engine is, each number a ratio against a baseline in the
same run.

Machines are noisy, so every comparison alternates candidate and baseline run by run and reports
medians. On CPU the engine decodes with column-parallel linears (minikv/bench/parallel.py); the
plain model is measured next to it. Writes benchmarks/results.json, benchmarks/README.md (tables)
and plots. `--quick` checks the machinery on tiny models in well under a minute; its numbers mean
nothing.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from ..course.arguments import positive
from ..course.device import describe_device, resolve_device
from ..course.files import claim_directory, mark_directory, write_atomically
from ..engine import GPT, GPTConfig, Request, generate, serve, speculative_generate
from .parallel import column_parallel

OUT_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
# The committed results the chapters quote: the repository's benchmarks/ or, installed from a wheel
# (Colab, pip), the copy of its *.json files the wheel carries (setup.py), so a chapter quotes the
# same numbers wherever it runs.
RESULTS = OUT_DIR if OUT_DIR.is_dir() else Path(__file__).resolve().parents[1] / "_benchmarks"



def device_and_out(parser, args, command: str) -> tuple:
    """A bench command's device and --out folder (None with --quick and no --out; never a
    committed folder by default), both checked before any model is loaded: the folder new,
    empty, or the command's own."""
    out = Path(args.out) if args.out else (None if args.quick else Path("runs") / command)
    try:
        device = resolve_device(args.device)
        if out is not None:
            claim_directory(out, command)
    except ValueError as e:
        parser.error(str(e))
    return device, out


def checked_device(parser, args) -> torch.device:
    """A bench command's --device, or the parser's error before any model is loaded."""
    try:
        return resolve_device(args.device)
    except (RuntimeError, ValueError) as e:
        parser.error(str(e))


def claimed_out(parser, args, command: str) -> Path:
    """A bench command's --out (default: runs/<command>, runs/<command>-quick with --quick),
    checked before any work: new, empty, or the command's own, never anyone else's folder."""
    out = Path(args.out) if args.out else Path("runs") / (
        f"{command}-quick" if args.quick else command)
    try:
        claim_directory(out, command)
    except ValueError as e:
        parser.error(str(e))
    return out


def run_record(command: str, argv: list[str] | None, **extra) -> dict:
    """Where a bench command ran, for its report: the date, cores, torch, platform, the load
    at the start and the command line as given; `extra`: the command's own."""
    given = argv if argv is not None else sys.argv[2:]
    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "platform": platform.platform(),
            "load": os.getloadavg()[0],
            "command": " ".join(["python -m minikv", command, *given]), **extra}


def publish(out: Path, command: str, results: dict, write_report) -> int:
    """Mark `out` as `command`'s, write its report and print it."""
    mark_directory(out, command)
    write_report(results, out)
    print((out / "README.md").read_text())
    return 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate_all(runs: dict, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Every run's seconds, the callables run in turn (A, B, A, B, ...) so drift hits all."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def alternate(runs: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each callable, run in turn (alternate_all)."""
    return {name: statistics.median(t)
            for name, t in alternate_all(runs, repeats, device).items()}


def pass_cost(cfg: GPTConfig, n_new: int, n_cached: int = 0,
              bytes_per_value: int = 4) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one forward pass of batch 1 that feeds `n_new` tokens after
    `n_cached` cached ones and computes logits for the last position only (as generate does).

    FLOPs: 2 per multiply-add of the matmuls: per token and layer, Q/K/V (3C²), the attention
    output (C²) and the MLP (8C²); then the LM head on one row (V·C); plus attention itself,
    q·k and weights·v, 2·C multiply-adds per (query, key) pair it may see: the n_new queries see
    n_cached + 1, …, n_cached + n_new keys. Bytes: every weight read once (only n_new rows of
    each embedding, all of wte again as the tied LM head), the cached K/V read, the new K/V
    written. Biases and LayerNorms are counted in the bytes, not the FLOPs (they are a few
    per cent of either)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    pairs = n_new * n_cached + n_new * (n_new + 1) // 2  # (query, key) pairs under the mask
    flops = 2 * (n_new * L * 12 * C * C + V * C) + 2 * 2 * C * L * pairs
    weights = L * (12 * C * C + 13 * C) + 2 * C + V * C + 2 * n_new * C
    kv = 2 * L * C * (n_cached + n_new)  # K and V: the cached ones read, the new ones written
    return flops, (weights + kv) * bytes_per_value


def random_model(preset: str, device, dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(preset, **overrides)).to(device, dtype).eval()


SERVE_WINDOW = inspect.signature(serve).parameters["replay_window"].default
PROMPT = [1, 2, 3, 4]  # 4 tokens; every preset's vocabulary has these ids


def bench_naive_vs_cached(model, ns, naive_max, repeats, device) -> list[dict]:
    """Wall time, naive vs cached, from a 4-token prompt (naive only up to naive_max new tokens)."""
    rows = []
    for n in tqdm(ns, desc="naive vs cached"):
        runs = {"cached": lambda: generate(model, PROMPT, n, mode="cached")}
        if n <= naive_max:
            runs["naive"] = lambda: generate(model, PROMPT, n, mode="naive")
        t = alternate(runs, repeats, device)
        row = {"n": n, "cached_s": t["cached"]}
        if "naive" in t:
            row |= {"naive_s": t["naive"], "speedup": t["naive"] / t["cached"]}
        rows.append(row)
    return rows


def counted_kv(model, ns) -> list[dict]:
    """K/V vectors per layer as the engine's own counters report them (weights don't change the
    counts), next to the prediction: N·P + N(N−1)/2 without a cache, P + N − 1 with one (P = prompt
    length)."""
    p = len(PROMPT)
    return [{"n": n, "naive": generate(model, PROMPT, n, mode="naive").stats.kv_computed,
             "cached": generate(model, PROMPT, n, mode="cached").stats.kv_computed,
             "naive_predicted": n * p + n * (n - 1) // 2, "cached_predicted": p + n - 1}
            for n in ns]


def read_bandwidth(device, mbytes: int, repeats: int) -> float:
    """Streaming read bandwidth in bytes/s: the median time to sum a large tensor."""
    x = torch.ones(mbytes * 2**20 // 4, device=device)
    t = alternate({"sum": lambda: x.sum().item()}, repeats, device)["sum"]
    return x.numel() * 4 / t


def bench_roofline(models: dict, n_tokens, repeats, bandwidth, device) -> dict:
    """Cached decode tokens/s of each model against the memory-bandwidth bound: bytes read per
    token / bandwidth."""
    runs = {}
    for name, model in models.items():
        runs[name] = lambda model=model: generate(model, PROMPT, n_tokens)
        runs[name + " prefill"] = lambda model=model: generate(model, PROMPT, 1)
    t = alternate(runs, repeats, device)
    # the first is the plain model: its parameters are the bytes read
    plain = next(iter(models.values()))
    cfg = plain.config
    # wpe: one row read
    weight_bytes = (plain.num_params() - cfg.block_size * cfg.n_embd) * plain.dtype.itemsize
    mean_len = len(PROMPT) + n_tokens / 2
    kv_bytes = 2 * cfg.n_layer * mean_len * cfg.n_embd * plain.dtype.itemsize
    bound = bandwidth / (weight_bytes + kv_bytes)
    rows = {}
    for name in models:
        tokens_per_s = (n_tokens - 1) / (t[name] - t[name + " prefill"])
        rows[name] = {"tokens_per_s": tokens_per_s, "fraction": tokens_per_s / bound}
    return {"models": rows, "roofline_tokens_per_s": bound,
            "bytes_per_token": weight_bytes + kv_bytes, "bandwidth_GBps": bandwidth / 1e9}


def bench_vs_transformers(n_tokens, repeats, device, preset="gpt2",
                          dtype=torch.float32) -> dict | None:
    """Our cached decode (plain, and column-parallel on CPU) against Hugging Face's GPT-2
    generate(use_cache=True), same weights and prompt."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = GPTConfig.preset(preset)
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size,
                                     n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).to(device, dtype).eval()
    ours = {"minikv": GPT.from_gpt2_state_dict(hf.state_dict(), cfg).to(device, dtype).eval()}
    if device.type == "cpu":
        ours["minikv column-parallel"] = column_parallel(ours["minikv"])
    ids = torch.tensor([PROMPT], device=device)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                               do_sample=False, use_cache=True,
                               pad_token_id=0)[0, len(PROMPT):].tolist()

    reference = run_hf()
    runs = {name: lambda model=model: generate(model, PROMPT, n_tokens)
            for name, model in ours.items()}
    t = alternate(runs | {"transformers": run_hf}, repeats, device)
    return {"transformers_s": t["transformers"], "transformers_version": transformers.__version__,
            "models": {name: {"same_tokens": generate(model, PROMPT, n_tokens).tokens == reference,
                              "seconds": t[name], "speedup": t["transformers"] / t[name]}
                       for name, model in ours.items()}}


class PassTimer:
    """Seconds of each forward pass of `model`, by the number of positions it was fed (forward
    hooks)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.seconds, self._start, self._handles = model, {}, 0.0, []

    def _before(self, module, args) -> None:
        self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self.seconds.setdefault(args[0].shape[1], []).append(time.perf_counter() - self._start)

    def __enter__(self) -> "PassTimer":
        self._handles = [self.model.register_forward_pre_hook(self._before),
                         self.model.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def median(self, rows: int) -> float:
        return statistics.median(self.seconds[rows])


def bench_speculative(target, draft, prompts, n_tokens, gammas, repeats, device) -> dict:
    """Speed-up over target-only cached greedy for each γ, against (1 − α^(γ+1)) / ((1 − α)(γc + 1))
    with c measured on each model alone, and against the same accounting with every assumption
    replaced by what the speculative run itself measured: tokens per target pass / (γ c_run + v),
    where c_run is a draft pass and v a verification pass over γ + 1 rows, each in units of a target
    decode step (the formula: v = 1)."""
    step = alternate({"target": lambda: generate(target, prompts[0], 33),
                      "draft": lambda: generate(draft, prompts[0], 33),
                      "target1": lambda: generate(target, prompts[0], 1),
                      "draft1": lambda: generate(draft, prompts[0], 1)},
                     repeats, device)
    c = (step["draft"] - step["draft1"]) / (step["target"] - step["target1"])
    rows = []
    for gamma in tqdm(gammas, desc="speculative"):
        base = lambda: [generate(target, p, n_tokens) for p in prompts]  # noqa: E731
        spec = lambda: [speculative_generate(target, draft, p, n_tokens, gamma=gamma)  # noqa: E731
                        for p in prompts]
        with PassTimer(target) as alone:
            expected = base()
        with PassTimer(target) as verifier, PassTimer(draft) as proposer:
            outs = spec()
        same = [o.tokens for o in outs] == [o.tokens for o in expected]
        accepted = sum(o.stats.accepted for o in outs)
        # Leviathan et al.'s α: accepted over judged proposals (judging stops at a rejection)
        alpha = accepted / max(accepted + sum(o.stats.rejected_rounds for o in outs), 1)
        tokens_per_pass = (sum(o.stats.new_tokens for o in outs)
                           / sum(o.stats.target_passes for o in outs))
        # tokens a verification pass commits (the prefill's first token left out), against the
        # formula's (1 − α^(γ+1)) / (1 − α) for independent acceptances
        per_round = (sum(o.stats.accepted + o.stats.rounds for o in outs)
                     / max(sum(o.stats.rounds for o in outs), 1))
        target_step = alone.median(1)
        c_run, v = proposer.median(1) / target_step, verifier.median(gamma + 1) / target_step
        t = alternate({"cached": base, "speculative": spec}, repeats, device)
        predicted = ((1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1)) if alpha < 1
                     else (gamma + 1) / (gamma * c + 1))
        rows.append({"gamma": gamma, "alpha": alpha, "identical": same,
                     "tokens_per_round": per_round,
                     "tokens_per_round_iid": ((1 - alpha ** (gamma + 1)) / (1 - alpha)
                                              if alpha < 1 else gamma + 1),
                     "speedup": t["cached"] / t["speculative"], "predicted": predicted,
                     "tokens_per_target_pass": tokens_per_pass, "c_run": c_run, "verify_cost": v,
                     "predicted_measured": tokens_per_pass / (gamma * c_run + v)})
    return {"c": c, "rows": rows}


def bench_deterministic(model, prompts, n_tokens, windows, repeats, device) -> list[dict]:
    """One deterministic request among others: throughput with verification vs the fast path
    alone."""
    def batch():
        det = Request(prompts[0], n_tokens, deterministic=True)
        return [det] + [Request(p, n_tokens, temperature=1.0, seed=i)
                        for i, p in enumerate(prompts[1:])]
    rows = []
    for w in tqdm(windows, desc="deterministic"):
        t = alternate({"fast": lambda: serve(model, batch(), replay_window=w, replay=False),
                       "verified": lambda: serve(model, batch(), replay_window=w)}, repeats, device)
        stats = serve(model, batch(), replay_window=w)[0].stats
        rows.append({"window": w, "fast_s": t["fast"], "verified_s": t["verified"],
                     "throughput_fraction": t["fast"] / t["verified"],
                     "rollbacks": stats.rollbacks, "rounds": stats.rounds})
    return rows


def targets(results: dict) -> list[tuple[str, str, bool]]:
    """The course's targets for 2 CPU cores (issue 8): what was asked, what this run measured, met
    or not."""
    rows = []
    at200 = [r for r in results["naive_vs_cached"] if r["n"] == 200 and "naive_s" in r]
    if at200:
        rows.append(("cached ≥ 10x naive wall time at N = 200", f"{at200[0]['speedup']:.1f}x",
                     at200[0]["speedup"] >= 10))
    hf = results.get("vs_transformers")
    if hf:
        name, best = max(hf["models"].items(), key=lambda kv: kv[1]["speedup"])
        rows.append(("cached decode ≥ 1.3x transformers", f"{best['speedup']:.2f}x ({name})",
                     best["speedup"] >= 1.3))
    name, best = max(results["roofline"]["models"].items(), key=lambda kv: kv[1]["fraction"])
    rows.append(("cached decode ≥ 85% of the roofline", f"{100 * best['fraction']:.0f}% ({name})",
                 best["fraction"] >= 0.85))
    sp = max(results["speculative"]["rows"], key=lambda r: r["speedup"])
    rows.append(("speculative ≥ 2.5x cached, identical greedy output",
                 f"{sp['speedup']:.2f}x at γ = {sp['gamma']}, identical: {sp['identical']}",
                 sp["speedup"] >= 2.5 and sp["identical"]))
    off = abs(sp["speedup"] / sp["predicted"] - 1)
    rows.append(("… within 15% of the formula", f"{100 * off:.0f}% off at γ = {sp['gamma']}",
                 off <= 0.15))
    det = results["deterministic"]
    default = next((r for r in det if r["window"] == SERVE_WINDOW), det[0])
    worst = min(det, key=lambda r: r["throughput_fraction"])
    rows.append((f"deterministic ≥ 80% of the fast path (window {default['window']}, "
                 "serve's default)",
                 f"{100 * default['throughput_fraction']:.0f}% "
                 f"(worst: {100 * worst['throughput_fraction']:.0f}% at window {worst['window']})",
                 default["throughput_fraction"] >= 0.8))
    serving = results.get("serving", {}).get("course target, long-tailed")
    if serving:
        r = serving["rows"]
        cont = r["continuous batching"]
        rows.append(("continuous ≥ 2x static batching, same KV memory (course target, 64 "
                     "requests)", f"{cont['vs_static']:.2f}x", cont["vs_static"] >= 2))
        hf = r.get("transformers batched generate")
        if hf:
            ratio = hf["seconds"] / cont["seconds"]
            rows.append(("continuous ≥ 1.5x transformers' batched generate", f"{ratio:.2f}x",
                         ratio >= 1.5))
        rows.append(("paged waste ≤ one partly filled block a request",
                     f"{serving['waste_per_request']} positions (block of "
                     f"{serving['block_size']})",
                     serving["waste_per_request"] < serving["block_size"]))
    return rows


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "results.json", json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    lines = [f"# Benchmarks "
             f"({'quick check: numbers mean nothing' if results['quick'] else 'full run'})", "",
             f"{m['date']}, {m['device']}, {m.get('dtype', 'float32')}, torch {m['torch']}, "
             f"{m['threads']} threads, {m['platform']}"
             + (f", load average {m['load_average_at_start']:.1f} at the start"
                if "load_average_at_start" in m else "") + ". "
             "Medians of alternating runs; every ratio is against a baseline measured in the "
             "same run.", "",
             "| target (2 CPU cores, 124M fp32 unless stated) | this run | met |",
             "|---|---|---|"]
    lines += [f"| {what} | {measured} | {'yes' if met else '**no**'} |"
              for what, measured, met in targets(results)]
    lines += ["", "What limits the targets that are missed: [NOTES.md](NOTES.md).", "",
              "## Naive vs cached decoding", "",
              f"{results['naive_vs_cached_model']}, from a {len(PROMPT)}-token prompt.", "",
              "| N | cached s | naive s | speed-up | K/V naive (counted / predicted) "
              "| K/V cached (counted / predicted) | K/V ratio |",
              "|---|---|---|---|---|---|---|"]
    for r, kv in zip(results["naive_vs_cached"], results["kv_counted"]):
        naive = f"{r['naive_s']:.2f} | {r['speedup']:.1f}x" if "naive_s" in r else "not timed | —"
        lines.append(f"| {r['n']} | {r['cached_s']:.2f} | {naive} | "
                     f"{kv['naive']:,} / {kv['naive_predicted']:,} | "
                     f"{kv['cached']:,} / {kv['cached_predicted']:,} | "
                     f"{kv['naive'] / kv['cached']:.1f}x |")
    rf = results["roofline"]
    lines += ["", "## Cached decode against the memory-bandwidth roofline", "",
              f"Bound: {rf['roofline_tokens_per_s']:.1f} tokens/s "
              f"({rf['bytes_per_token'] / 1e6:.0f} MB of weights and KV "
              f"read per token at {rf['bandwidth_GBps']:.1f} GB/s, "
              "a streaming read measured in the same run).", "",
              "| model | tokens/s | fraction of the roofline |", "|---|---|---|"]
    for name, r in rf["models"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {100 * r['fraction']:.0f}% |")
    hf = results.get("vs_transformers")
    if hf:
        lines += ["", "## Against Hugging Face transformers", "",
                  f"Same weights and prompt, greedy; transformers {hf['transformers_version']} "
                  f"`generate(use_cache=True)`: {hf['transformers_s']:.2f} s.", "",
                  "| model | seconds | same tokens | speed-up over transformers |",
                  "|---|---|---|---|"]
        for name, r in hf["models"].items():
            lines.append(f"| {name} | {r['seconds']:.2f} | {r['same_tokens']} | "
                         f"**{r['speedup']:.2f}x** |")
    sp = results["speculative"]
    lines += ["",
              "## Speculative decoding (course target/draft, draft/target step cost "
              f"c = {sp['c']:.3f})", "",
              "Predicted: the formula (1 − α^(γ+1)) / ((1 − α)(γc + 1)), c measured on each model "
              "alone. Accounted: tokens per target pass / (γ c_run + v), with c_run (a draft pass) "
              "and v (a verification pass over γ + 1 rows) timed inside the speculative run, in "
              "target decode steps (the formula assumes c_run = c, v = 1).", "",
              "| γ | α | tokens / target pass | c_run | v | identical | speed-up | predicted "
              "| accounted |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sp["rows"]:
        lines.append(f"| {r['gamma']} | {r['alpha']:.2f} | {r['tokens_per_target_pass']:.2f} | "
                     f"{r['c_run']:.3f} | {r['verify_cost']:.2f} | {r['identical']} | "
                     f"{r['speedup']:.2f}x | {r['predicted']:.2f}x | "
                     f"{r['predicted_measured']:.2f}x |")
    lines += ["", "## Deterministic request: verified vs fast path alone", "",
              "| window | fast s | verified s | throughput kept | rollbacks / rounds |",
              "|---|---|---|---|---|"]
    for r in results["deterministic"]:
        lines.append(f"| {r['window']} | {r['fast_s']:.2f} | {r['verified_s']:.2f} | "
                     f"{100 * r['throughput_fraction']:.0f}% | {r['rollbacks']} / {r['rounds']} |")
    for name, sv in results.get("serving", {}).items():
        lines += ["", f"## Serving {sv['requests']} requests: {name}", "",
                  f"Prompts of {sv['prompt_lengths'][0]}–{sv['prompt_lengths'][1]} tokens, "
                  f"outputs of {sv['output_lengths'][0]}–{sv['output_lengths'][1]} "
                  f"({sv['new_tokens']} in all), greedy, Poisson arrivals (4 a step). Static "
                  f"batches of {sv['batch_size']}; continuous batching gets the same KV memory: "
                  f"{sv['num_blocks']} blocks of {sv['block_size']} ({sv['preempted']} "
                  f"preemptions), without and with prefix caching (the prompts are drawn from a "
                  f"smaller set, so some repeat). Same tokens: requests whose output equals "
                  f"generating alone.",
                  "", "| server | tokens/s | vs static | KV memory | forward passes | token rows "
                  "| same tokens |", "|---|---|---|---|---|---|---|"]
        for server, r in sv["rows"].items():
            lines.append(f"| {server} | {r['tokens_per_s']:.0f} | {r['vs_static']:.2f}x | "
                         f"{_size(r['kv_bytes'])} | {r['passes'] or '—'} | "
                         f"{r['rows'] or '—'} | {r['same_tokens']}/{sv['requests']} |")
    sh = results.get("shrink")
    if sh:
        lines += ["", f"## Caches that hold less: decode from {sh['context']:,} to "
                      f"{sh['context'] + sh['n_tokens']:,} positions ({sh['preset']} shapes)", "",
                  f"K/V held after the prompt, and {sh['n_tokens']} greedy decode steps timed from "
                  "there (random weights: speed only; chapter 07 measures quality on the course "
                  "models).", "", "| cache | K/V held | vs full | decode tokens/s | vs full |",
                  "|---|---|---|---|---|"]
        for name, r in sh["rows"].items():
            lines.append(f"| {name} | {_size(r['kv_bytes'])} | {r['bytes_vs_full']:.2f}x | "
                         f"{r['tokens_per_s']:.1f} | {r['speed_vs_full']:.2f}x |")
    pc = results.get("prefix_caching")
    if pc:
        lines += ["", f"## Prefix caching: {pc['requests']} requests sharing a "
                      f"{pc['shared_tokens']}-token prefix", "",
                  "One request an engine step, one new token each: a step's time is its "
                  f"request's time to first token. Same tokens either way: {pc['same_tokens']}.",
                  "", "| | K/V computed (positions) | K/V computed | reused positions "
                  "| mean time to first token |", "|---|---|---|---|---|"]
        for name, r in pc["rows"].items():
            lines.append(f"| {name} | {r['kv_computed']:,} | {_size(r['kv_bytes_computed'])} | "
                         f"{r['reused']:,} | {r['ttft_ms']:.1f} ms |")
        lines += ["", f"Prefix caching computes {pc['kv_ratio']:.1f}x less K/V and answers "
                      f"{pc['ttft_speedup']:.1f}x sooner."]
    write_atomically(out / "README.md", "\n".join(lines) + "\n")

    fig, (a, k, b) = plt.subplots(1, 3, figsize=(15, 4))
    rows = results["naive_vs_cached"]
    a.loglog([r["n"] for r in rows], [r["cached_s"] for r in rows], "o-", label="cached")
    timed = [r for r in rows if "naive_s" in r]
    a.loglog([r["n"] for r in timed], [r["naive_s"] for r in timed], "o-", label="naive")
    a.set(xlabel="new tokens N", ylabel="seconds", title="Wall time")
    a.legend()
    kv = results["kv_counted"]
    for mode, colour in (("naive", "C1"), ("cached", "C0")):
        k.loglog([r["n"] for r in kv], [r[mode] for r in kv], "o", color=colour,
                 label=f"{mode}, counted")
        k.loglog([r["n"] for r in kv], [r[f"{mode}_predicted"] for r in kv], "--", color=colour,
                 label=f"{mode}, predicted")
    k.set(xlabel="new tokens N", ylabel="K/V vectors per layer",
          title="K/V work: N·P + N(N−1)/2 vs P + N − 1")
    k.legend()
    b.plot([r["gamma"] for r in sp["rows"]], [r["speedup"] for r in sp["rows"]], "o-",
           label="measured")
    b.plot([r["gamma"] for r in sp["rows"]], [r["predicted"] for r in sp["rows"]], "--",
           label="formula")
    b.plot([r["gamma"] for r in sp["rows"]], [r["predicted_measured"] for r in sp["rows"]], ":",
           label="accounted")
    b.set(xlabel="γ", ylabel="speed-up over cached", title="Speculative decoding")
    b.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    write_atomically(out / "plots.png", buffer.getvalue())
    plt.close(fig)


def bench_many_requests(target, tok, quick: bool, device, dtype, repeats: int):
    """Serving 64 requests (chapter 06): on the course target (long-tailed and uniform output
    lengths) and the 124M preset (long-tailed); prefix caching with a 200-token shared prefix."""
    from . import serving
    if quick:
        rng = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 500, (int(n),), generator=rng).tolist() for n in (3, 9, 5)]
        requests = serving.workload(prompts, 8, new_tokens=(2, 8))
        rows = {"tiny, long-tailed": serving.bench_serving(target, requests, 4, 4, repeats,
                                                           device)}
        shared, suffixes = [7] * 24, [[1, 2], [3], [4, 5, 6]]
        return rows, serving.bench_prefix_caching(target, shared, suffixes, 4, repeats, device)
    prompts = serving.course_prompts(tok)
    rows = {}
    for name, model, long_tailed in (("course target, long-tailed", target, True),
                                     ("course target, uniform", target, False),
                                     ("124M preset, long-tailed",
                                      random_model("gpt2", device, dtype), True)):
        requests = serving.workload(prompts, 64, long_tailed=long_tailed)
        rows[name] = serving.bench_serving(model, requests, 8, 16, repeats, device)
    shared, suffixes = serving.shared_prefix_prompts(tok)
    return rows, serving.bench_prefix_caching(target, shared, suffixes, 16, repeats, device)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, one repeat: checks the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json, README.md and plots.png (default: "
                             "runs/bench; the committed run is in benchmarks/: `make bench`)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=positive, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="weights and activations (16-bit rows are for GPUs)")
    parser.add_argument("--naive-max", type=positive, default=200,
                        help="longest N to time naive decoding at")
    parser.add_argument("--previous", metavar="REF", default=None,
                        help="also time the engine of git revision REF (e.g. HEAD~1) beside "
                             "this one: batch-1 decode and a serving step at batch 16")
    parser.add_argument("--only-previous", action="store_true",
                        help="with --previous: that comparison alone, printed")
    args = parser.parse_args(argv)
    if args.only_previous and not args.previous:
        parser.error("--only-previous needs --previous REF")
    args.out = args.out or Path("runs") / ("bench-quick" if args.quick else "bench")
    try:
        device = resolve_device(args.device)
        # new, empty, or bench's own (benchmarks/ is): never a folder of anyone else's files
        claim_directory(args.out, "bench")
    except ValueError as e:
        parser.error(str(e))
    repeats = args.repeats or (1 if args.quick else 3)
    if args.previous:
        from ..course.checkpoint import load_course_model
        from .previous import bench_vs_previous, describe
        target, tok = load_course_model("target", device)
        prompts = [tok.encode(t) for t in ("Once upon a time", "The color of dog",
                                           "A coin's state is heads. Alice flips")]
        try:
            vs_previous = bench_vs_previous(args.previous, target, prompts, max(repeats, 5),
                                            n_tokens=16 if args.quick else 64)
        except ValueError as e:
            parser.error(str(e))
        print(describe(vs_previous))
        if args.only_previous:
            return 0
    preset = "tiny" if args.quick else "gpt2"
    dtype = getattr(torch, args.dtype)
    big = random_model(preset, device, dtype)
    # On CPU the engine decodes with column-parallel linears (bench/parallel.py); elsewhere
    # as it is.
    engine = column_parallel(big) if device.type == "cpu" else big
    # 4 + 1000 - 1 positions fit block_size 1024
    ns = [8, 16] if args.quick else [32, 64, 128, 200, 1000]
    results = {"quick": args.quick, "machine": {
        "date": datetime.date.today().isoformat(), "device": describe_device(device),
        "dtype": args.dtype, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "platform": platform.platform(),
        "processor": platform.processor(),
        # other work on the machine skews absolute numbers
        "load_average_at_start": os.getloadavg()[0]}}
    results["naive_vs_cached_model"] = f"{preset} preset, random weights" + (
        ", column-parallel linears" if engine is not big else "")
    results["naive_vs_cached"] = bench_naive_vs_cached(engine, ns,
                                                       16 if args.quick else args.naive_max,
                                                       repeats, device)
    results["kv_counted"] = counted_kv(random_model("tiny", device, block_size=1100), ns)
    bandwidth = read_bandwidth(device, 16 if args.quick else 256, repeats)
    decoders = {"minikv": big} | ({"minikv column-parallel": engine} if engine is not big else {})
    results["roofline"] = bench_roofline(decoders, 16 if args.quick else 128, repeats, bandwidth,
                                         device)
    results["vs_transformers"] = bench_vs_transformers(8 if args.quick else 200, repeats, device,
                                                       preset, dtype)
    if args.quick:
        target, draft = (random_model("tiny", device, dtype),
                         random_model("tiny", device, dtype, n_layer=1))
        tok = None
    else:
        from ..course.checkpoint import load_course_model
        target, tok = load_course_model("target", device)
        draft, _ = load_course_model("draft", device)
        target, draft = target.to(dtype), draft.to(dtype)
    prompts = ([[1, 2, 3], [4, 5]] if tok is None else
               [tok.encode(t) for t in ("Once upon a time", "The color of dog",
                                        "A coin's state is heads. Alice flips")])
    n_tokens = 12 if args.quick else 100
    results["speculative"] = bench_speculative(target, draft, prompts, n_tokens,
                                               [1, 2] if args.quick else list(range(1, 9)),
                                               repeats, device)
    results["deterministic"] = bench_deterministic(target, prompts, n_tokens,
                                                   [2, 4] if args.quick else [2, 4, 8, 16],
                                                   repeats, device)
    results["serving"], results["prefix_caching"] = bench_many_requests(
        target, tok, args.quick, device, dtype, 1 if args.quick else 2)
    from .shrink import bench_shrink
    # decode from 968 to 1,000 positions: 1000 + 32 would pass GPT-2's block_size of 1024
    results["shrink"] = bench_shrink(preset, 200 if args.quick else 968, 4 if args.quick else 32,
                                     repeats, device, dtype)
    if args.previous:
        results["vs_previous"] = vs_previous
    mark_directory(args.out, "bench")
    write_report(results, args.out)
    print((args.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
