"""The engine against an earlier commit's, in the same run (`python -m minikv bench --previous
REF`): the course target's batch-1 decode step and a serving step at batch 16, each engine run in
turn (A, B, A, B, ...), medians, and the ratio earlier / now (1.0 or more: no slower).

The earlier engine is read from git (`git archive REF minikv/engine`) into a temporary folder and
imported beside this one as `minikv_previous_engine`: the engine imports nothing from outside its
folder (tests/test_layout.py), so it loads alone. Both run the same weights on the same prompts."""
from __future__ import annotations

import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from .. import engine as current

REPO = Path(__file__).resolve().parents[2]


def load_engine(ref: str, repo: Path = REPO):
    """The package minikv/engine as it was at git revision `ref`, imported under another name."""
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "minikv/engine"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"cannot read minikv/engine at {ref!r} from git in {repo} ({e}): "
                         f"give a revision of this repository, e.g. HEAD~1") from None
    folder = Path(tempfile.mkdtemp(prefix="minikv-previous-")) / "minikv" / "engine"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder.parents[1], filter="data")
    name = "minikv_previous_engine"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def twin(engine, model):
    """`model`'s weights in `engine`'s GPT (the fields both configs know)."""
    known = {f.name for f in fields(engine.GPTConfig)}
    config = engine.GPTConfig(**{k: v for k, v in asdict(model.config).items() if k in known})
    other = engine.GPT(config).to(model.device, model.dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def decode_seconds(engine, model, prompt: list[int], n: int) -> float:
    """Seconds per new token of engine.generate(model, prompt, n) (its one prefill included)."""
    start = time.perf_counter()
    engine.generate(model, prompt, n)
    return (time.perf_counter() - start) / n


def serving_step_seconds(engine, model, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of a serving step once every request is decoding (one row each)."""
    server = engine.serving.Engine(model, 256, page_size=16)
    for p in prompts:
        server.add(engine.Request(p, steps + 8))
    for _ in range(3):  # admitted and prefilled: from here on, one decode pass a step
        server.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        server.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_vs_previous(ref: str, target, prompts: list[list[int]], repeats: int,
                      n_tokens: int = 64, batch: int = 16, steps: int = 24) -> dict:
    """Both engines, in turn: seconds per decode token at batch 1, seconds per serving step at
    `batch` requests; medians over `repeats`, and earlier / now."""
    previous = load_engine(ref)
    models = {"now": (current, target), "previous": (previous, twin(previous, target))}
    crowd = [prompts[i % len(prompts)] for i in range(batch)]
    rows = {"decode": {k: [] for k in models}, "serving": {k: [] for k in models}}
    with torch.inference_mode():
        for engine, model in models.values():  # untimed: the first run of each pays warm-up
            decode_seconds(engine, model, prompts[0], 8)
            serving_step_seconds(engine, model, crowd, 2)
        for _ in range(repeats):
            for name, (engine, model) in models.items():
                rows["decode"][name].append(decode_seconds(engine, model, prompts[0], n_tokens))
                rows["serving"][name].append(serving_step_seconds(engine, model, crowd, steps))
    out = {"ref": ref, "repeats": repeats, "batch": batch}
    for what, times in rows.items():
        now, before = statistics.median(times["now"]), statistics.median(times["previous"])
        out[what] = {"now_s": now, "previous_s": before, "speedup": before / now}
    return out


def describe(result: dict) -> str:
    d, s = result["decode"], result["serving"]
    return (f"against the engine at {result['ref']} (medians of {result['repeats']} alternating "
            f"runs): batch-1 decode {d['now_s'] * 1e3:.2f} ms a token vs "
            f"{d['previous_s'] * 1e3:.2f} ms ({d['speedup']:.2f}x); a serving step at batch "
            f"{result['batch']} {s['now_s'] * 1e3:.2f} ms vs {s['previous_s'] * 1e3:.2f} ms "
            f"({s['speedup']:.2f}x)")
