"""`python -m minikv bench-syncs`: what each decoder makes the host wait for, counted on any
machine (issue 56, item 1: what makes a GPU run slower than it should).

On a GPU the host queues kernels and runs on ahead; it stops and waits for the device when it
needs a value the device computed (`int(t)`, `t.item()`, `t.tolist()`, `if t:`, a shape that
depends on values: `nonzero`, a boolean mask) and when it copies Python data to the device
(`torch.tensor(ids, device=...)`: from pageable memory, the copy waits for the queue). Each
wait empties the queue, so a step that waits ten times pays the launch latency ten times. On a
CPU every operation has finished when it returns, so there is nothing to wait for and no CPU
timing shows it; counting shows it, and the counts are the code's own, the same on any machine
that makes the same tokens.

For each decoder: the reads and uploads per generated token in steady state (the count for 2n
new tokens minus the count for n, over n: prefill and set-up cancel), and where they happen.
Checks of values that run only where reading is free (`validate.reads_are_free`) take their
GPU branch while counting. Writes results.json and README.md to --out (default
runs/bench-syncs; the committed run: benchmarks/syncs)."""
from __future__ import annotations

import argparse
import json
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import engine as current
from ..course import arguments
from ..course.device import describe_device
from ..course.files import write_atomically
from . import checked_device, claimed_out, publish, run_record

# Tensor methods and functions that hand the host a value the device computed.
READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__",
         "__format__", "__array__", "equal", "allclose"}
FROM_DATA = {"tensor", "as_tensor"}  # Python data: an upload when given a device
# Operations whose output's shape depends on values: the host reads a size back.
SHAPED = {"nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
          "repeat_interleave"}


@dataclass
class Waits:
    """Where the host waited, (what, "file:line" in minikv) -> times: reads (each waits for
    the value's kernels) and uploads that found kernels queued ahead of them (an upload
    with nothing queued, say the first thing a step does after the last step's read, waits
    for its own copy only; one made with non_blocking=True does not wait)."""
    reads: Counter = field(default_factory=Counter)
    uploads: Counter = field(default_factory=Counter)
    queued: bool = False  # kernels were launched since the host last waited
    skipped: tuple = ()   # functions whose reads are not counted (a GPU never ran them)
    cuda_syncs: float | None = None  # per token, as CUDA counted them (a GPU run only)


def _site(skipped: tuple = ()) -> str | None:
    """The innermost line of minikv (outside this file) on the stack: where the wait is;
    None inside a function named in `skipped`."""
    stack = traceback.extract_stack()
    if any(frame.name in skipped for frame in stack):
        return None
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "/minikv/" in path and not path.endswith("bench/syncs.py"):
            return f"{path.rsplit('/minikv/', 1)[1]}:{frame.lineno}"
    return "(outside minikv)"


def _read(waits: Waits, what: str) -> None:
    site = _site(waits.skipped)
    if site is not None:
        waits.reads[(what, site)] += 1


def _waiting_upload(name: str, args, kwargs) -> bool:
    """A copy of Python data to the device that waits for the device: torch.tensor(data,
    device=...), or a host tensor made from data copied with .to(...)/copy_ blocking."""
    if name in FROM_DATA:
        return kwargs.get("device") is not None
    if name in ("to", "copy_") and not kwargs.get("non_blocking", False):
        source = args[1] if name == "copy_" else args[0]
        return getattr(source, "_minikv_host", False) and (name == "copy_" or len(args) > 1
                                                            or "device" in kwargs)
    return False


class _Calls(TorchFunctionMode):
    def __init__(self, waits: Waits):
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, waits = kwargs or {}, self.waits
        name = getattr(func, "__name__", "")
        blocks = name in READS or _waiting_upload(name, args, kwargs)
        if name in READS:
            _read(waits, name)
        elif blocks and waits.queued:
            waits.uploads[(name, _site())] += 1
        out = func(*args, **kwargs)
        if blocks:
            waits.queued = False  # the host caught up with the device
        elif name in FROM_DATA and isinstance(out, torch.Tensor):
            out._minikv_host = True  # Python data in host memory, for an upload later
        return out


class _Launches(TorchDispatchMode):
    def __init__(self, waits: Waits):
        super().__init__()
        self.waits = waits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masked = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
        if name in SHAPED or masked:
            _read(self.waits, name)
        out = func(*args, **(kwargs or {}))
        # nonzero and its kind end with their read; a masked gather reads, then launches
        self.waits.queued = name not in SHAPED and (self.waits.queued or not func.is_view)
        return out


@contextmanager
def count_waits(engine=None):
    """Count the host's waits for the device inside the block (a `Waits`), as a GPU would
    have them: `engine`'s (default: this one's) value checks that run only on the host are
    off meanwhile. An engine from before that switch checked ids only on a CPU, in
    model._check_values: reads there are left out."""
    checks = (engine or current).validate
    waits, free = Waits(), getattr(checks, "FREE_READS", None)
    waits.skipped = () if free is not None else ("_check_values",)
    checks.FREE_READS = False
    try:
        with _Calls(waits), _Launches(waits):
            yield waits
    finally:
        if free is None:
            del checks.FREE_READS
        else:
            checks.FREE_READS = free


def per_token(run, n: int, engine=None) -> tuple[float, float, Waits]:
    """Reads and uploads per new token in steady state: run(2n) minus run(n), over n; with
    the sites of the difference (and on a GPU, `cuda_syncs`: CUDA's own count)."""
    counts = []
    for new in (n, 2 * n):
        with count_waits(engine) as waits, cuda_syncs() as synced:
            made = run(new)
        counts.append((waits, made, len(synced)))
    (small, made_small, synced_small), (large, made_large, synced_large) = counts
    diff = Waits(large.reads - small.reads, large.uploads - small.uploads)
    tokens = made_large - made_small
    diff.cuda_syncs = (synced_large - synced_small) / tokens
    return (sum(diff.reads.values()) / tokens, sum(diff.uploads.values()) / tokens, diff)


@contextmanager
def cuda_syncs():
    """On a CUDA machine, the synchronising calls CUDA itself saw inside the block (torch's
    sync debug mode, as warnings): every read, and every blocking upload, queued work or
    not. Elsewhere an empty list."""
    if not torch.cuda.is_available():
        yield []
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def decoders(engine, target, draft, head) -> dict:
    """name -> run(new tokens) -> tokens made: every decoder of `engine` on one prompt."""
    prompt = list(range(11, 43))
    four = [prompt, prompt[:9], prompt[5:], prompt[:20]]

    def server(batch: int, how: dict | None = None, **settings):
        def run(new: int) -> int:
            eng = engine.serving.Engine(target, num_blocks=64, **settings)
            for i, p in enumerate(four[:batch]):
                eng.add(engine.Request(p, new, seed=i, **(how or {})))
            while eng.has_work():
                eng.step()
            return sum(len(o.tokens) for o in eng.outputs().values())
        return run

    def made(out) -> int:
        return len(out.tokens) if hasattr(out, "tokens") else sum(len(o.tokens) for o in out)
    speculative, feature = engine.speculative_generate, engine.feature_generate
    runs = {
        "generate, greedy": lambda n: engine.generate(target, prompt, n),
        "generate, sampled": lambda n: engine.generate(target, prompt, n, temperature=1.0),
        "generate_batch, 4 rows": lambda n: engine.generate_batch(target, four, n),
        "speculative, draft, greedy": lambda n: speculative(target, draft, prompt, n, gamma=4),
        "speculative, draft, sampled": lambda n: speculative(target, draft, prompt, n, gamma=4,
                                                             temperature=1.0),
        "prompt lookup, greedy": lambda n: engine.lookup_generate(target, prompt * 2, n, gamma=4),
        "feature head, greedy": lambda n: feature(target, head, prompt, n, gamma=4),
        "feature head, tree (2, 2), greedy": lambda n: feature(target, head, prompt, n, gamma=4,
                                                               tree=(2, 2)),
        "feature head, tree (2, 2), sampled": lambda n: feature(
            target, head, prompt, n, gamma=4, tree=(2, 2), temperature=1.0)}
    runs = {name: (lambda n, run=run: made(run(n))) for name, run in runs.items()}
    return runs | {
        "server, 1 request": server(1),
        "server, 4 requests": server(4),
        "server, 4 requests, CUDA-graph pass": server(4, graphs=(1, 2, 4)),
        "server, 4 sampled requests": server(4, {"temperature": 1.0}),
        "server, 4 deterministic requests": server(4, {"deterministic": True}),
    }


def count_all(engine, models: tuple, new: int) -> dict[str, tuple[float, float, Waits]]:
    """Every decoder's per_token, run by `engine` on `models` (target, draft, head)."""
    return {name: per_token(run, new, engine)
            for name, run in decoders(engine, *models).items()}


def twins(engine, target, draft, head) -> tuple:
    """The same weights in an earlier `engine`'s classes (bench/previous.py)."""
    from .previous import twin
    other = twin(engine, target)
    head_twin = engine.FeatureHead(engine.FeatureHead.config_for(other)).eval()
    head_twin.load_state_dict(head.state_dict())
    return other, twin(engine, draft), head_twin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-syncs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="random models of the tiny preset, few tokens: the machinery only")
    parser.add_argument("--new", type=arguments.positive, default=16,
                        help="n: each decoder makes n, then 2n tokens (default 16)")
    parser.add_argument("--previous", default=None, metavar="REF",
                        help="also count the engine at this git revision (e.g. HEAD~1), beside")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-syncs; the committed run: benchmarks/syncs)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default: the counts are the same); on cuda, CUDA's own "
                             "count of synchronising calls too")
    args = parser.parse_args(argv)
    device, out = checked_device(parser, args), claimed_out(parser, args, "bench-syncs")
    previous = None
    if args.previous is not None:
        from .previous import load_engine
        try:
            previous = load_engine(args.previous)
        except ValueError as e:
            parser.error(str(e))
    from ..course.checkpoint import load_course_model, load_feature_head
    from . import random_model
    if args.quick:
        target, draft = random_model("tiny", device), random_model("tiny", device)
        head = current.FeatureHead(current.FeatureHead.config_for(target)).eval().to(device)
    else:
        target = load_course_model("target", device)[0]
        draft, head = load_course_model("draft", device)[0], load_feature_head(target, device)
    now = count_all(current, (target, draft, head), args.new)
    before = (count_all(previous, twins(previous, target, draft, head), args.new)
              if previous is not None else {})
    rows = []
    for name, (reads, uploads, waits) in now.items():
        sites = [f"{times} {what} {where}" for (what, where), times
                 in (waits.reads + waits.uploads).most_common()]
        row = {"decoder": name, "reads": reads, "uploads": uploads, "sites": sites,
               "cuda_syncs": waits.cuda_syncs if device.type == "cuda" else None}
        if name in before:
            row["previous"] = {"reads": before[name][0], "uploads": before[name][1]}
        rows.append(row)
    results = {"machine": run_record("bench-syncs", argv, new=args.new, previous=args.previous,
                                     models="tiny (random)" if args.quick else "course",
                                     device=describe_device(device)),
               "rows": rows}
    return publish(out, "bench-syncs", results, write_report)


def write_report(results: dict, out: Path) -> None:
    m, ref = results["machine"], results["machine"]["previous"]
    cuda = any(row["cuda_syncs"] is not None for row in results["rows"])
    lines = [
        "# What each decoder makes the host wait for (`python -m minikv bench-syncs`)", "",
        "On a GPU the host waits for the device at every read of a value it computed and "
        "at every blocking upload made while kernels are queued; on a CPU there is nothing to "
        "wait for, so no CPU timing shows them. Counted here per new token in steady state "
        f"((count at {2 * m['new']} tokens - count at {m['new']}) / tokens made), with the "
        f"{m['models']} models, on {m['device']}. The counts are the code's, the same on any "
        "machine that makes the same tokens (a speculative decoder's also depend on how many "
        "proposals its tokens let it accept)."]
    if cuda:
        lines += ["", "CUDA's own count (torch.cuda.set_sync_debug_mode) is beside them: every "
                  "synchronising call, a blocking upload with nothing queued included."]
    if ref:
        lines += ["", f"Beside them, the engine at `{ref}` on the same weights (read from git, "
                  "bench/previous.py); it checked ids only on a CPU, in model._check_values, "
                  "so its reads there are left out, as a GPU never made them."]
    head = "| decoder | reads / token | waiting uploads / token |"
    head += (" CUDA syncs / token |" if cuda else "") + (
        f" at `{ref}`: reads / uploads |" if ref else "")
    lines += ["", head + " where (times, in the difference of the two runs) |",
              "|---|---:|---:|" + "---:|" * (bool(cuda) + bool(ref)) + "---|"]
    for row in results["rows"]:
        was = row.get("previous")
        lines.append(f"| {row['decoder']} | {row['reads']:.2f} | {row['uploads']:.2f} | "
                     + (f"{row['cuda_syncs']:.2f} | " if cuda else "")
                     + (f"{was['reads']:.2f} / {was['uploads']:.2f} | " if ref else "")
                     + f"{'; '.join(row['sites'][:4]) or '-'} |")
    lines += ["", f"Command: `{m['command']}` ({m['date']}, torch {m['torch']})."]
    write_atomically(out / "README.md", "\n".join(lines) + "\n")
    write_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")
