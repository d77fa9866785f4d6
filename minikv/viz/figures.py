"""`python -m minikv figures`: redraw every picture in figures/ from real engine runs,
deterministically.

One figure per seed diagram, each computed from traces and tensors of the shipped course models (or
of whatever models are passed in): change the model or the prompt and the picture changes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ..course.bugs import PositionsFromZero
from ..course.corpus import CoinFlip
from ..course.files import claim_directory, mark_directory, write_atomically
from ..engine import (
    GPTConfig,
    KVCache,
    Request,
    generate,
    kv_cache_bytes,
    serve,
    speculative_generate,
)
from .draw import COLORS, SERIES, attention_weights, draw_attention, draw_steps, png
from .replay import replay

FIGURES_DIR = Path(__file__).resolve().parents[2] / "figures"


def seed_002_prefill_decode(target, tok) -> plt.Figure:
    """"The color of dog" → the target's own continuation: prefill, then one decode step per
    token."""
    out = generate(target, tok.encode("The color of dog"), 8, eos_id=tok.eot_token, trace=True)
    return draw_steps(replay(out.trace), tok.decode,
                      suptitle="Seed 002: prefill, then decode with a KV cache")


def seed_003_kv_cache_guide(target, tok, counted: dict[int, tuple[int, int]] | None = None
                            ) -> plt.Figure:
    """Waste counted by the engine, O(N²) vs N, one-row attention, cache bytes, the position bug,
    timeline. `counted` maps N to the (naive, cached) K/V counts of N tokens from a 1-token
    prompt, when the caller has them already (chapter 02 does); otherwise they are counted."""
    prompt = tok.encode("Once upon a")
    naive = generate(target, prompt, 5, mode="naive", trace=True)
    cached = generate(target, prompt, 5, mode="cached", trace=True)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))

    ax = axes[0, 0]  # timeline: K/V computed per step
    steps = range(1, 6)
    ax.barh([s + 0.2 for s in steps], [e.kv_computed for e in naive.trace], 0.4,
            color=SERIES["naive"], label="without cache")
    ax.barh([s - 0.2 for s in steps], [e.kv_computed for e in cached.trace], 0.4,
            color=SERIES["cached"], label="with cache")
    ax.invert_yaxis()
    ax.set(xlabel="K/V vectors computed per layer", ylabel="generation step",
           title=f"'Once upon a' + 5 tokens: {naive.stats.kv_computed} vs "
                 f"{cached.stats.kv_computed} K/V computed")
    ax.legend(fontsize=8)

    ax = axes[0, 1]  # scaling, counted by the engine's hooks
    ns = [1, 2, 4, 8, 16, 32, 64, 100, 200]
    if counted is None:
        counted = {n: (generate(target, prompt[:1], n, mode="naive").stats.kv_computed,
                       generate(target, prompt[:1], n, mode="cached").stats.kv_computed)
                   for n in ns}
    counted = [counted[n] for n in ns]
    ax.loglog(ns, [c[0] for c in counted], "o", color=SERIES["naive"],
              label="without cache (counted)")
    ax.loglog(ns, [c[1] for c in counted], "o", color=SERIES["cached"],
              label="with cache (counted)")
    ax.loglog(ns, [n * (n + 1) / 2 for n in ns], "--", color=SERIES["formula"],
              label="N(N+1)/2 and N")
    ax.loglog(ns, ns, "--", color=SERIES["formula"])
    ax.set(xlabel="tokens generated N (1-token prompt)", ylabel="K/V vectors computed per layer",
           title=f"O(N²) vs O(N): at N=100, {counted[-2][0] / counted[-2][1]:.1f}x the work")
    ax.legend(fontsize=8)

    ids = prompt + cached.tokens[:1]  # "Once upon a" + its first new token: seed 003's step 2
    labels = [tok.decode([t]) for t in ids]
    cache = KVCache.for_model(target, max_len=len(ids))
    with torch.inference_mode():
        target(torch.tensor([ids[:-1]], device=target.device), cache=cache)
    # two heat maps, same keys: the full causal triangle, then the cached step's one row
    axes[0, 2].axis("off")
    full, row = (axes[0, 2].inset_axes([0.1, 0.42, 0.8, 0.58]),
                 axes[0, 2].inset_axes([0.1, 0.0, 0.8, 0.2]))
    triangle = attention_weights(target, ids).mean(0)
    one_row = attention_weights(target, ids[-1:], cache=cache).mean(0)
    vmax = float(max(triangle.max(), one_row.max()))  # one colour scale for both
    draw_attention(triangle, labels, "attention without cache: all rows\n(darker: more weight; "
                   "hatched: masked)", ax=full, vmax=vmax, colorbar=False)  # no room for a bar
    draw_attention(one_row, labels, "with cache: one row", ax=row, vmax=vmax,
                   ylabel="queries (new)", colorbar=False)
    full.set(xlabel="")

    ax = axes[1, 0]  # cache bytes, GPT-2 small in fp16: the formula and a real cache agree
    gpt2 = GPTConfig.preset("gpt2")
    lengths = [1, 100, 256, 512, 1024]
    ax.plot(lengths, [kv_cache_bytes(gpt2, n) / 2**20 for n in lengths], "o-",
            color=SERIES["cached"])
    real = KVCache(gpt2.n_layer, 1, gpt2.n_head, gpt2.head_dim, 100,
                   dtype=torch.float16).allocated_nbytes
    ax.annotate(f"100 tokens: {real:,} B\n= {real / 1e6:.2f} MB = {real / 2**20:.2f} MiB",
                (100, real / 2**20), xytext=(300, 10), arrowprops={"arrowstyle": "->"}, fontsize=9)
    ax.set(xlabel="cached tokens", ylabel="MiB", title="GPT-2 small KV cache, fp16, batch 1")

    ax = axes[1, 1]  # the position-offset bug
    wrapped = PositionsFromZero(target)
    buggy = generate(wrapped, prompt, 5)
    for used, out, color, name in (
            ([e.positions for e in cached.trace], cached, SERIES["cached"],
             "positions from the cache length"),
            (wrapped.given, buggy, SERIES["naive"], "positions from 0 (bug)")):
        ax.plot(range(1, 6), [p[-1] for p in used], "o-", color=color,
                label=f"{name}: …{tok.decode(out.tokens)!r}")
    ax.set(xlabel="generation step", ylabel="position id of the last token fed",
           title="Seed 003's position bug", ylim=(-1, len(prompt) + 12))  # room for the legend
    ax.set_xticks(range(1, 6))  # steps are whole
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1, 2]  # the timeline of seed 003: 1, 2, 3, 4 positions against 1, 1, 1, 1
    runs = [generate(target, prompt[:1], 4, mode=mode, trace=True) for mode in ("naive", "cached")]
    for row, (out, color) in enumerate(zip(runs, (SERIES["naive"], SERIES["cached"]))):
        left = 0
        for e in out.trace:
            ax.barh(row, len(e.input_ids), left=left, color=color, edgecolor="white")
            left += len(e.input_ids)
    ax.set_yticks([0, 1], ["without cache", "with cache"])
    ax.invert_yaxis()
    done = [out.stats.positions_processed for out in runs]
    ax.set(xlabel="positions processed (cumulative, one segment per token)",
           title=f"Timeline, 1-token prompt + 4 tokens: {done[0]} vs {done[1]} positions "
                 f"({done[0] / done[1]:.1f}x)")
    fig.suptitle("Seed 003: the KV-cache visual guide, measured by the engine", x=0.01, ha="left")
    fig.tight_layout()
    return fig


def seed_000_coin_flip(target, tok) -> plt.Figure:
    """S_i: the state after each person lives in the cache; Z_i: the answer asked at step i by
    forking it."""
    question = CoinFlip("heads", (("Alice", True), ("Bob", True)))
    full = tok.encode(question.prompt())
    cache = KVCache.for_model(target, max_len=len(full) + 16)
    with torch.inference_mode():
        target(torch.tensor([full[:-1]], device=target.device), cache=cache)
    asked = []
    for i in range(len(question.steps) + 1):
        cut = len(tok.encode(question.prefix(i)))
        branch = cache.fork()
        branch.crop(cut)  # the prefix up to person i, reused as is
        suffix = tok.encode(question.question(i))[cut:]
        out = generate(target, suffix, 3, eos_id=tok.eot_token, cache=branch)
        asked.append((cut, suffix, tok.decode(out.tokens), question.states[i]))
    statement = len(tok.encode(question.prefix(len(question.steps))))
    fig = plt.figure(figsize=(13, 2.2 + 1.05 * len(asked)))
    ax = fig.add_subplot()
    for p, t in enumerate(full[:statement]):  # the main cache: the statement, computed once
        ax.add_patch(plt.Rectangle((p, 0), 0.95, 0.8, facecolor=COLORS["prompt"],
                                   edgecolor="#777777", lw=0.5))
        ax.text(p + 0.47, 0.4, tok.decode([t]).strip(), ha="center", va="center", fontsize=7)
    ax.text(-0.4, 0.4, "main cache", ha="right", va="center", fontsize=8)
    for i, (cut, suffix, answer, truth) in enumerate(asked):
        # S_i, the true state, marks the slot where person i's clause ends: not a token
        ax.text(cut - 0.53, 1.15, f"S{i}={truth}", ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "#333333"})
        # the fork: its own copy of the question's suffix on top of the cut, then Z_i
        y = -1.25 * (i + 1)
        ax.plot([cut - 0.02, cut - 0.02], [0, y + 0.8], color="#777777", lw=0.8, ls=":")
        ax.text(cut - 0.3, y + 0.4, f"fork {i}", ha="right", va="center", fontsize=7)
        for k, t in enumerate(suffix):
            ax.add_patch(plt.Rectangle((cut + k, y), 0.95, 0.8, facecolor=COLORS["prompt"],
                                       edgecolor="#777777", lw=0.5, ls="--"))
            ax.text(cut + k + 0.47, y + 0.4, tok.decode([t]).strip(), ha="center",
                    va="center", fontsize=7)
        word = answer.strip().split(".")[0].split("<")[0]  # the answer word, not what follows
        ok = word == truth
        x = cut + len(suffix)
        ax.add_patch(plt.Rectangle((x, y), 3.2, 0.8, facecolor=COLORS["generated"],
                                   edgecolor="#777777"))
        ax.text(x + 1.6, y + 0.4, f"Z{i} = {word!r} {'✓' if ok else '✗'}", ha="center",
                va="center", fontsize=8)
    ax.set_xlim(-6, max(cut + len(suffix) for cut, suffix, _, _ in asked) + 4)
    ax.set_ylim(-1.25 * len(asked) - 0.3, 1.6)
    ax.axis("off")
    ax.set_title("Seed 000: the main cache is cut after each step (S_i, the true state there); "
                 "each fork gets its own copy of the question (dashed) and answers Z_i, "
                 "without recomputing the prefix", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def _round(trace, accepted: int, proposed: int):
    """Index of the first verify event with exactly `accepted` of `proposed` proposals accepted."""
    for i, e in enumerate(trace):
        if e.kind == "verify" and len(e.positions) == proposed and len(e.accepted) == accepted:
            return i
    return None


def seed_004_speculative_rollback(target, draft, tok) -> plt.Figure:
    """A round where T1' is accepted and T2' rejected, found by searching prompts, drawn step by
    step."""
    prompts = ["Once upon a time", "The color of dog", "A coin's state is tails.",
               "Every cat likes to"]
    for text in prompts:
        out = speculative_generate(target, draft, tok.encode(text), 40, gamma=3,
                                   eos_id=tok.eot_token, trace=True)
        i = _round(out.trace, accepted=1, proposed=3)
        if i is not None:
            snaps = replay(out.trace)[i - 1:i + 3]  # the last draft, verify, rollback, commit
            return draw_steps(snaps, tok.decode, max_positions=18,
                              suptitle="Seed 004: draft → verify → rollback "
                                       f"(prompt {text!r}, γ = 3)")
    raise RuntimeError("no round with T1 accepted and T2 rejected in the searched prompts")


def seed_001_no_rollback(target, tok) -> plt.Figure:
    """A deterministic request batched with others: its fast-path tokens verified, all match, no
    rollback."""
    others = [Request(tok.encode(t), 12, temperature=1.0, seed=s)
              for s, t in enumerate(["Once upon a time", "A coin's state is heads. Alice flips",
                                     "The color"])]
    det = Request(tok.encode("The color of dog"), 12, deterministic=True)
    trace = serve(target, [det] + others, replay_window=4, trace=True)[0].trace
    i = _round(trace, accepted=3, proposed=3)
    if i is None:
        raise RuntimeError("no fully accepted window in this run")
    return draw_steps(replay(trace)[i - 3:i + 2], tok.decode, max_positions=18,
                      suptitle="Seed 001: deterministic request — fast decode, verify, all match: "
                               "no rollback")


def make_figures(target, draft, tok, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = {
        "seed_002_prefill_decode.png": lambda: seed_002_prefill_decode(target, tok),
        "seed_003_kv_cache_guide.png": lambda: seed_003_kv_cache_guide(target, tok),
        "seed_000_coin_flip.png": lambda: seed_000_coin_flip(target, tok),
        "seed_004_speculative_rollback.png":
            lambda: seed_004_speculative_rollback(target, draft, tok),
        "seed_001_no_rollback.png": lambda: seed_001_no_rollback(target, tok),
    }
    written = []
    for name, make in jobs.items():
        path = out_dir / name
        write_atomically(path, png(make(), dpi=100))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv figures", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs") / "figures",
                        help="where to draw them (default: runs/figures; the course's own are in "
                             "figures/: `make figures`)")
    args = parser.parse_args(argv)
    try:  # new, empty, or figures' own (figures/ is): never a folder of anyone else's files
        claim_directory(args.out, "figures")
    except ValueError as e:
        parser.error(str(e))
    from ..course.checkpoint import load_course_model
    # identical pictures on any machine: no thread-count-dependent reductions
    torch.set_num_threads(1)
    target, tok = load_course_model("target", device="cpu")
    draft, _ = load_course_model("draft", device="cpu")
    start = time.perf_counter()
    mark_directory(args.out, "figures")
    for path in make_figures(target, draft, tok, args.out):
        print(path)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
