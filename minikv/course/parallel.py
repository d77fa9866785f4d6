"""Chapter 13's helpers around the engine's tensor parallelism (minikv/engine/parallel.py).

- `rank_layouts`: what one rank of a launched group holds and decodes for several course
  models, so that a notebook starts its processes once per world (a notebook's own function
  cannot be started in a spawned process; this one is importable).
- `in_threads`: `world` ranks as threads of this process, `torch.distributed.all_reduce`
  summing across them while they run. A layer written in a notebook cannot travel to a
  spawned process, but it can run here: the exercise on a row-parallel layer and its checker
  use it. A rank that calls all_reduce more often than another is reported, never left
  waiting."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..engine import generate
from ..engine.parallel import all_reduces, shard
from .checkpoint import load_course_model


def rank_layouts(rank: int, world: int, names: tuple, prompt: list[int], n: int) -> dict:
    """Run in each rank of `launch(rank_layouts, world, names, prompt, n)`: for every course
    model named, this rank's shard of it, its config, its greedy tokens and all-reduces."""
    out = {}
    for name in names:
        model, _ = load_course_model(name, "cpu")
        part = shard(model, rank, world)
        tokens = generate(part, prompt, n).tokens
        out[name] = dict(shard=part.shard, config=part.config, tokens=tokens,
                         all_reduces=all_reduces(part))
    return out


class Unmatched(RuntimeError):
    """A rank's all-reduce that no other rank joined."""


def in_threads(fn, world: int, *args, timeout: float = 30.0) -> tuple[list, list[int]]:
    """fn(rank, world, *args) on `world` threads with dist.all_reduce (SUM, in place) summing
    each call over the ranks, in rank order; (the results by rank, all-reduces each rank ran).
    Raises the first rank's error, or Unmatched where the ranks' all-reduces do not pair up."""
    cond, local = threading.Condition(), threading.local()
    deposits: dict[tuple[int, int], torch.Tensor] = {}
    done: dict[int, int] = {}  # rank -> all-reduces it ran, once it has returned
    calls, results, errors = [0] * world, [None] * world, [None] * world

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.SUM or async_op:
            raise ValueError("this simulated group sums (ReduceOp.SUM), synchronously")
        r = local.rank
        k = calls[r]
        calls[r] += 1
        with cond:
            deposits[k, r] = tensor.detach().clone()
            cond.notify_all()
            joined = cond.wait_for(lambda: all((k, q) in deposits for q in range(world)) or any(
                done.get(q, k + 1) <= k for q in range(world)) or any(errors), timeout)
            if not all((k, q) in deposits for q in range(world)):
                raise Unmatched(f"rank {r}'s all-reduce number {k + 1} was joined by no other "
                                f"rank" + ("" if joined else " (timed out)"))
        total = deposits[k, 0].clone()
        for q in range(1, world):
            total += deposits[k, q]
        with torch.no_grad():
            tensor.copy_(total)
        return None

    def run(rank: int) -> None:
        local.rank = rank
        try:
            results[rank] = fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001 - raised again by the caller
            errors[rank] = e
        with cond:
            done[rank] = calls[rank]
            cond.notify_all()

    saved = dist.all_reduce, dist.get_rank, dist.get_world_size
    dist.all_reduce, dist.get_rank = all_reduce, lambda group=None: local.rank
    dist.get_world_size = lambda group=None: world
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        dist.all_reduce, dist.get_rank, dist.get_world_size = saved
    first = next((e for e in errors if e is not None and not isinstance(e, Unmatched)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    if len(set(calls)) > 1:
        raise Unmatched(f"the ranks ran {calls} all-reduces")
    return results, calls
