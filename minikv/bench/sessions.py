"""`python -m minikv bench-sessions`: chapter 11's cache across turns, measured on this machine.

Two multi-turn workloads, one script each (the same messages; the replies the model's own,
greedy), under four prefix caches: none (the baseline), chapter 06's hashed blocks, chapter 11's
radix tree, and the tree with a second tier in host memory:

- dialogues: coin-flip conversations, a round of turns in one batch (`session.turn`): turn 1
  states a coin, who flips, and asks the state; each later turn adds people and asks again;
- agent: one long instruction said once, then waves of branches forked after it, a short
  tool-result-like message a round; some rounds edit a branch (last turn rewound, another sent).

Each at two pools: roomy (every position the script makes fits: the tree never evicts) and tight
(half what the tree held at its peak in the roomy pool: every cache lets go of half of what it
could use); the tier holds as many blocks as the roomy pool. Measured: prefill tokens computed
(the trace's prefill, chunk and recompute events, so a preemption's recomputation counts;
checked against the K/V counted on the model), hit rate (positions read from the cache over
those read or computed), TTFT p50/p99 (wall clock from a turn's request added to its first token
out of Engine.step; closed loop: a round starts when the last is done), the most blocks held at
the end of a step, blocks evicted and moved to and back from the tier. Counts are exact; times
are medians of --repeats runs, the caches in turn (A, B, C, D, A, ...), each a ratio against no
cache and hashed blocks in the same run. Replies are checked equal across caches in float64 on
the CPU (in float32 a near-tie may flip a greedy token when a prefix is read rather than
computed; float32's agreement is reported too). Writes results.json and README.md to --out
(default runs/bench-sessions; the committed run: benchmarks/sessions); --quick runs a tiny random
model (its numbers mean nothing) and writes nothing unless given --out.
"""
from __future__ import annotations

import argparse
import copy
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
from ..course.corpus import random_coin_flip, random_fact
from ..course.device import describe_device
from ..course.files import mark_directory, write_atomically
from ..engine import KVCounter, Radix
from ..engine.serving import Engine
from ..engine.session import Session, turn
from . import SERVE_WINDOW, device_and_out
from .load import pct

PAGE = 16  # the Engine's default page size
PREFILL = ("prefill", "chunk", "recompute")  # the trace's kinds of prompt work


def caches(tier_blocks: int) -> dict:
    return {"no cache": False, "hash blocks": True, "radix tree": Radix(),
            "radix + tier": Radix(tier_blocks=tier_blocks)}


# --- the workloads: scripts of ("say", [(session, ids), ...]), ("fork", parent, children),
# ("rewind", sessions); a script is built once, so every cache runs the same messages --------
def clauses(steps) -> str:
    """Who flips, as a coin-flip document says it, the first name opening a sentence."""
    said = [f"{n} " + ("flips" if f else "doesn't flip") for n, f in steps]
    return ", then ".join([said[0][:1].upper() + said[0][1:]] + said[1:])


def dialogues(tok, n_sessions: int, n_turns: int, seed: int = 0) -> list:
    """n_sessions coin-flip conversations of n_turns turns, one or two new people a turn."""
    rng = random.Random(seed)
    coins = [random_coin_flip(rng, 2 * n_turns) for _ in range(n_sessions)]
    script, told = [], [0] * n_sessions
    for t in range(n_turns):
        said = []
        for i, coin in enumerate(coins):
            k = told[i] + rng.randint(1, 2)
            text = (coin.question(k) if t == 0 else
                    f" {clauses(coin.steps[told[i]:k])}. What's the state? A:")
            said.append((i, tok.encode(text)))
            told[i] = k
        script.append(("say", said))
    return script


def agent(tok, instruction_tokens: int, waves: int, branches: int, rounds: int,
          seed: int = 0) -> list:
    """An instruction of the corpus' sentences (at least instruction_tokens), said once; then
    waves of `branches` forks of it, each round a tool result a branch; from the second round
    on, a third of the branches edit (rewind their last turn, send another result)."""
    rng = random.Random(seed)
    text = ""
    while len(tok.encode(text)) < instruction_tokens:
        text += random_fact(rng) + " "
    script, new = [("say", [(0, tok.encode(text.strip()))])], 1
    for w in range(waves):
        kids = list(range(new, new + branches))
        new += branches
        script.append(("fork", 0, kids))
        for r in range(rounds):
            if edits := [b for j, b in enumerate(kids) if r and (j + r + w) % 3 == 0]:
                script.append(("rewind", edits))
            script.append(("say", [(b, tok.encode(f" Tool: {random_fact(rng)} Next:"))
                                   for b in kids]))
    return script


def pool_sizes(script: list, max_new: int) -> tuple[int, int]:
    """(roomy, alone) in blocks, from the script's lengths with every reply max_new long (an
    upper bound): `alone`, what the longest turn takes by itself (fit's count: prompt, reply,
    the replay window ahead, a block copied on write); roomy, the blocks the largest round's
    turns take at once plus those of every turn's new positions, all a tree can keep."""
    starts, rounds, kept, alone = {}, [], 0, 0
    for op, *args in script:
        if op == "fork":
            starts.update({c: list(starts[args[0]]) for c in args[1]})
        elif op == "rewind":
            for s in args[0]:
                starts[s].pop()
        else:
            need = [0]
            for s, ids in args[0]:
                begin = starts.setdefault(s, [0])[-1]
                end = begin + len(ids) + max_new
                need.append(-(-(end + SERVE_WINDOW) // PAGE) + 1)
                kept += -(-(end - begin) // PAGE) + 1
                starts[s].append(end)
            rounds.append(sum(need))
            alone = max(alone, *need)
    return kept + max(rounds), alone


# --- one run ---------------------------------------------------------------------------------
class Stamped(Engine):
    """An Engine that stamps when each request is added and when its first token comes out of
    a step, and the most blocks held at the end of any step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.added, self.ttft, self.peak = {}, [], 0

    def add(self, request, index=None) -> int:
        index = super().add(request, index)
        self.added[index] = time.perf_counter()
        return index

    def step(self) -> dict:
        moved, now = super().step(), time.perf_counter()
        for i, (tokens, _) in moved.items():
            if tokens and i in self.added:
                self.ttft.append(now - self.added.pop(i))
        stats = self.stats()
        self.peak = max(self.peak, stats["num_blocks"] - stats["free_blocks"])
        return moved


def run(model, script: list, setting, num_blocks: int, max_new: int, eos: int | None) -> dict:
    """The script on a fresh engine: its replies and what each measure of the docstring
    counted."""
    engine = Stamped(model, num_blocks, prefix_caching=setting, trace=True)
    sessions, replies, outs = {}, [], []
    with torch.inference_mode(), KVCounter(model) as counter:
        for op, *args in script:
            if op == "fork":
                sessions.update(zip(args[1], sessions[args[0]].fork(len(args[1]))))
            elif op == "rewind":
                for s in args[0]:
                    sessions[s].rewind()
            else:
                group = [sessions.setdefault(s, Session(engine)) for s, _ in args[0]]
                replies += turn(group, [ids for _, ids in args[0]], max_new, eos_id=eos)
                outs += [s.last for s in group]
    events = [e for o in outs for e in o.trace]
    prefill = sum(e.kv_computed for e in events if e.kind in PREFILL)
    assert counter.count == sum(e.kv_computed for e in events), "a pass the trace missed"
    reused = sum(o.stats.reused for o in outs)
    # The tree's own books (the Engine has no call for them: read as tests/test_radix.py does).
    books = dict(getattr(engine.scheduler.prefix, "counts", {}))
    return {"replies": replies, "prefill": prefill, "reused": reused,
            "hit_rate": reused / (reused + prefill), "turns": len(outs),
            "prompt_positions": sum(o.stats.prompt_len for o in outs),
            "preempted": sum(o.stats.preempted for o in outs), "peak_blocks": engine.peak,
            "evicted": books.get("evicted", 0), "to_tier": books.get("to_tier", 0),
            "from_tier": books.get("from_tier", 0), "dropped": books.get("dropped", 0),
            "tier_bytes_moved": books.get("bytes_moved", 0), "ttft": engine.ttft}


def block_bytes(model) -> int:
    c = model.config
    return 2 * c.n_layer * c.kv_heads * PAGE * c.head_dim * model.dtype.itemsize


def bench_workload(model, exact, name: str, script: list, max_new: int, eos,
                   repeats: int) -> list[dict]:
    """Every cache at both pool sizes: exact counts, replies checked in float64 (`exact`, a
    copy of the model on the CPU), times alternated over `repeats` runs."""
    roomy, alone = pool_sizes(script, max_new)
    rows, pools, settings = [], {"roomy": roomy}, caches(roomy)
    for pool in ("roomy", "tight"):
        blocks = pools[pool]
        checked = {c: run(exact, script, s, blocks, max_new, eos) for c, s in settings.items()}
        # Tight: half of what the tree held at its peak in the roomy pool, so that every cache
        # must let go of half of what it could use (never less than the longest turn alone).
        pools["tight"] = max(alone, -(-checked["radix tree"]["peak_blocks"] // 2))
        run(model, script, False, blocks, max_new, eos)  # warm-up, untimed
        runs = {c: [] for c in settings}
        for _ in range(repeats):  # the caches in turn: drift hits all alike
            for c, s in settings.items():
                runs[c].append(run(model, script, s, blocks, max_new, eos))
        for c, done in runs.items():
            counts = [{k: v for k, v in r.items() if k != "ttft"} for r in done]
            assert all(x == counts[0] for x in counts), "counts differ between repeats"
            ms = {q: [1e3 * pct(r["ttft"], q) for r in done] for q in (50, 99)}
            rows.append({k: v for k, v in counts[0].items() if k != "replies"} | {
                "workload": name, "pool": pool, "pool_blocks": blocks, "cache": c,
                "tier_blocks": roomy if c == "radix + tier" else 0,
                "same_replies": checked[c]["replies"] == checked["no cache"]["replies"],
                "same_replies_float32": done[0]["replies"] == runs["no cache"][0]["replies"],
                "peak_mb": counts[0]["peak_blocks"] * block_bytes(model) / 2**20}
                | {f"ttft_p{q}_ms": statistics.median(t) for q, t in ms.items()}
                | {f"ttft_p{q}_spread": [min(t), max(t)] for q, t in ms.items()})
        base = {r["cache"]: r for r in rows[-len(settings):]}
        for r in rows[-len(settings):]:
            for key in ("prefill", "ttft_p50_ms", "ttft_p99_ms"):
                r[f"{key}_vs_none"] = r[key] / base["no cache"][key]
                r[f"{key}_vs_hash"] = r[key] / base["hash blocks"][key]
    return rows


def tier_beats_hash(rows: list[dict]) -> list[str]:
    """Where the tree with its tier computes no fewer prefill tokens than hashed blocks."""
    at = {(r["workload"], r["pool"], r["cache"]): r["prefill"] for r in rows}
    return [f"{w}, {p} pool: {at[w, p, 'radix + tier']} >= {at[w, p, 'hash blocks']}"
            for w, p, c in at if c == "hash blocks" and at[w, p, "radix + tier"] >= at[w, p, c]]


def table(rows: list[dict]) -> str:
    lines = ["| workload | pool (blocks) | cache | prefill tokens | ÷ none | ÷ hash | hit rate | "
             "TTFT p50 ms (min–max) | ÷ none | ÷ hash | TTFT p99 ms (min–max) | ÷ none | ÷ hash "
             "| peak blocks (MB) | evicted | to / from tier (MB moved) | preempted | "
             "same replies |", "|" + "---|" * 18]
    for r in rows:
        lo50, hi50 = r["ttft_p50_spread"]
        lo99, hi99 = r["ttft_p99_spread"]
        same = "yes" if r["same_replies"] else "NO"
        lines.append(
            f"| {r['workload']} | {r['pool']} ({r['pool_blocks']}) | {r['cache']} | "
            f"{r['prefill']:,} | {r['prefill_vs_none']:.2f} | {r['prefill_vs_hash']:.2f} | "
            f"{r['hit_rate']:.0%} | {r['ttft_p50_ms']:.1f} ({lo50:.1f}–{hi50:.1f}) | "
            f"{r['ttft_p50_ms_vs_none']:.2f} | {r['ttft_p50_ms_vs_hash']:.2f} | "
            f"{r['ttft_p99_ms']:.1f} ({lo99:.1f}–{hi99:.1f}) | {r['ttft_p99_ms_vs_none']:.2f} | "
            f"{r['ttft_p99_ms_vs_hash']:.2f} | {r['peak_blocks']} ({r['peak_mb']:.1f}) | "
            f"{r['evicted']} | {r['to_tier']} / {r['from_tier']} "
            f"({r['tier_bytes_moved'] / 2**20:.1f}) | {r['preempted']} | "
            f"{same}{'' if r['same_replies_float32'] else ' (float32: no)'} |")
    return "\n".join(lines)


def readme(results: dict) -> str:
    m, worse = results["machine"], tier_beats_hash(results["rows"])
    work = "\n".join(f"- {name}: {w['sessions']} sessions, {w['turns']} turns of up to "
                     f"{w['max_new_tokens']} reply tokens, {w['prompt_positions']:,} prompt "
                     f"positions; pools of {w['roomy']} (roomy) and {w['tight']} (tight) blocks of "
                     f"{results['page_size']} positions; the tier {w['roomy']} blocks"
                     for name, w in results["workloads"].items())
    return f"""# The cache across turns (`python -m minikv bench-sessions`)

Written by `{results['command']}` on {m['device']} ({m['cores']} cores, torch on {m['threads']}
thread(s); load average {m['load_average_at_start']:.1f} at the start: other work was running
if it is near the cores or above), torch {m['torch']}, {m['platform']}, {m['date']}; the
{m['model']} model. Each workload is one script run under every cache at each pool size (the
docstring of `minikv/bench/sessions.py` says how they are built and why these pools):

{work}

Prefill tokens, hit rates, blocks and evictions are exact counts, the same on any machine;
TTFT is wall-clock, the median of {results['repeats']} runs with the caches alternating (min–max
in brackets; p99 over a few dozen turns is near their maximum). "÷ none", "÷ hash": the row's
number over no cache's and over hashed blocks' at the same pool size, in the same run (below 1:
fewer tokens, sooner). Peak blocks: the most held at the end of a step, running turns and what
the cache keeps (a tree holds what it keeps; a freed hashed block counts as free, though
findable until reallocated). Same replies: every turn's reply equal to no cache's, in float64.
The tree with its tier computes fewer prefill tokens than hashed blocks in every row:
{"yes" if not worse else "NO (" + "; ".join(worse) + ")"}.

{table(results['rows'])}
"""


def in_float64(model):
    """The model in float64 on the CPU, for the replies' equality check."""
    return copy.deepcopy(model).to("cpu", torch.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-sessions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random model; checks only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=positive, default=None,
                        help="timed runs of each configuration (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=positive, default=None,
                        help="torch's CPU threads (default: torch's own); on a machine that "
                             "other work keeps busy, 1 keeps a pass from waiting on a thread "
                             "the OS took away")
    parser.add_argument("--out", default=None,
                        help="default: runs/bench-sessions, nothing with --quick (the committed "
                             "run: --out benchmarks/sessions)")
    args = parser.parse_args(argv)
    device, out = device_and_out(parser, args, "bench-sessions")
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..course.tokenizer import load_tokenizer
    tok = load_tokenizer()
    if args.quick:
        from . import random_model
        model, name = random_model("tiny", device, vocab_size=tok.n_vocab), "tiny preset, random"
        sizes = dict(dialogues=(3, 3), agent=(48, 2, 3, 2))
    else:
        from ..course.checkpoint import load_course_model
        model, name = load_course_model("target", device)[0], "course target"
        sizes = dict(dialogues=(8, 6), agent=(128, 3, 6, 3))
    repeats = args.repeats or (1 if args.quick else 3)
    machine = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "model": name, "device": describe_device(device), "cores": os.cpu_count(),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "platform": platform.platform(),
               "load_average_at_start": os.getloadavg()[0]}  # other work skews the times
    exact = in_float64(model)
    workloads = {"dialogues": (dialogues(tok, *sizes["dialogues"]), 4),
                 "agent": (agent(tok, *sizes["agent"]), 6)}
    rows, described = [], {}
    for w, (script, max_new) in workloads.items():
        rows += bench_workload(model, exact, w, script, max_new, tok.eot_token, repeats)
        mine = [r for r in rows if r["workload"] == w]
        described[w] = {"turns": mine[0]["turns"], "prompt_positions": mine[0]["prompt_positions"],
                        "sessions": len({s for op, *a in script if op == "say" for s, _ in a[0]}),
                        "max_new_tokens": max_new, "roomy": mine[0]["pool_blocks"],
                        "tight": mine[-1]["pool_blocks"]}
    results = {"command": "python -m minikv bench-sessions " + " ".join(
                   sys.argv[2:] if argv is None else argv),
               "machine": machine,
               "page_size": PAGE, "repeats": repeats, "workloads": described, "rows": rows}
    print(table(rows))
    if out is not None:
        mark_directory(out, "bench-sessions")
        write_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")
        write_atomically(out / "README.md", readme(results))
    worse, differ = tier_beats_hash(rows), [r for r in rows if not r["same_replies"]]
    for line in worse:
        print(f"radix + tier computed no fewer prefill tokens than hash blocks: {line}")
    for r in differ:
        print(f"replies differ from no cache's: {r['workload']}, {r['pool']}, {r['cache']}")
    return 1 if worse or differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
