"""More than one process (chapter 13). Tensor parallelism (Megatron-LM, arXiv:1909.08053):
`world` ranks each hold a slice of every layer and run the same decoder in lockstep.

- Attention is split by heads: rank r keeps query heads r·nh/world .. (r+1)·nh/world − 1
  and the K/V heads they read, so its cache holds only those K/V heads. When ranks
  outnumber K/V heads (grouped-query attention), a K/V head is replicated on the ranks
  that share it: past world = n_kv_head a rank's cache stops shrinking. MLA's latent
  serves every head, so every rank caches all of it.
- q, k, v and the MLP's first layer are column-parallel (each rank computes its columns,
  no talking); the attention's and MLP's output projections are row-parallel: each rank
  multiplies its slice of the input by its rows of the weight, and ONE all-reduce sums
  the partial products. Two all-reduces per layer per pass; everything else (embeddings,
  norms, the head) is replicated, so every rank ends a pass with the same logits.

A rank's shard is an ordinary GPT of a smaller config (its heads, its MLP width,
head_size kept), so every cache kind and decoder runs on it unchanged. The ranks are
processes in one torch.distributed group (gloo: CPU tensors; `launch` starts them)."""
from __future__ import annotations

import os
import queue
import tempfile
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from .model import GPT, CausalSelfAttention, LatentAttention
from .validate import check_model, int_at_least


class RowParallel(nn.Module):
    """A linear layer over this rank's slice of its input features: the partial products,
    summed over the ranks by one all-reduce, then the bias (whole on every rank) once."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.calls = 0  # all-reduces this layer has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (B, T, n_embd): this rank's share of the sum
        dist.all_reduce(y)  # every rank now holds the sum of every rank's shares
        self.calls += 1
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: its query heads and K/V heads (ranges of the
    whole model's), and the MLP's hidden units."""
    rank: int
    world: int
    q_heads: range
    kv_heads: range
    hidden: range


def plan(cfg, rank: int, world: int) -> Shard:
    """Rank `rank`'s heads and hidden units; ValueError where `world` cannot split them."""
    int_at_least("world", world, hint=" (ranks)")
    hidden, kv = cfg.n_inner or 4 * cfg.n_embd, cfg.kv_heads
    if cfg.n_head % world or hidden % world or (kv % world and world % kv):
        raise ValueError(f"world={world} does not split {cfg.n_head} heads, {kv} K/V heads "
                         f"and {hidden} hidden units evenly: pick a world that divides "
                         f"n_head and the MLP's width, and divides or is a multiple of "
                         f"n_kv_head")
    nh, h = cfg.n_head // world, hidden // world
    if kv >= world:  # each rank its own K/V heads
        kv_heads = range(rank * kv // world, (rank + 1) * kv // world)
    else:  # ranks outnumber K/V heads: world / kv ranks share (replicate) one
        kv_heads = range(rank * kv // world, rank * kv // world + 1)
    return Shard(rank, world, range(rank * nh, (rank + 1) * nh), kv_heads,
                 range(rank * h, (rank + 1) * h))


def shard(model: GPT, rank: int, world: int) -> GPT:
    """Rank `rank`'s part of `model` (a GPT, or a FeatureHead: any model of blocks): one
    of its kind with its heads and MLP slice, the output projections all-reducing. Run it
    inside a process group of `world` ranks."""
    check_model("model", model)
    cfg, s = model.config, plan(model.config, rank, world)
    kv = None if cfg.n_kv_head is None or cfg.kv_lora_rank is not None else len(s.kv_heads)
    local = replace(cfg, n_head=len(s.q_heads), n_kv_head=kv, head_size=cfg.head_dim,
                    n_inner=len(s.hidden))
    part = type(model)(local).to(device=model.device, dtype=model.dtype).eval()
    own = part.state_dict()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if own[name].shape == t.shape:  # replicated: embeddings, norms, the head
                own[name].copy_(t)
        for full, mine in zip(model.transformer.h, part.transformer.h):
            _split_attention(full.attn, mine.attn, s, cfg.head_dim)
            _split_mlp(full.mlp, mine.mlp, s)
            mine.attn.c_proj, mine.mlp.c_proj = (RowParallel(mine.attn.c_proj),
                                                 RowParallel(mine.mlp.c_proj))
    part.shard = s
    return part


def _heads(t: torch.Tensor, heads: range, width: int, dim: int = 0) -> torch.Tensor:
    """Heads `heads` of a weight whose `dim` lists heads `width` apart."""
    return t.narrow(dim, heads.start * width, len(heads) * width)


def _split_attention(full, mine, s: Shard, hs: int) -> None:
    q_cols = _heads(full.c_proj.weight, s.q_heads, hs, dim=1)  # row-parallel: its inputs
    mine.c_proj.weight.copy_(q_cols)
    if mine.c_proj.bias is not None:
        mine.c_proj.bias.copy_(full.c_proj.bias)  # added once, after the sum
    if isinstance(full, LatentAttention):  # the latent's projection is replicated
        dr = full.rope_dim
        mine.q_proj.weight.copy_(_heads(full.q_proj.weight, s.q_heads, hs + dr))
        if full.q_proj.bias is not None:
            mine.q_proj.bias.copy_(_heads(full.q_proj.bias, s.q_heads, hs + dr))
        mine.kv_b_proj.weight.copy_(_heads(full.kv_b_proj.weight, s.q_heads, 2 * hs))
        return
    assert isinstance(full, CausalSelfAttention)
    kv = full.n_kv_head * hs * full.makes_kv
    for name in ("weight", "bias"):
        t = getattr(full.c_attn, name)
        if t is None:
            continue
        q, k, v = t.split([full.n_head * hs, kv, kv])  # column-parallel: its heads' rows
        rows = [_heads(q, s.q_heads, hs)]
        if full.makes_kv:
            rows += [_heads(k, s.kv_heads, hs), _heads(v, s.kv_heads, hs)]
        getattr(mine.c_attn, name).copy_(torch.cat(rows))


def _split_mlp(full, mine, s: Shard) -> None:
    mine.c_proj.weight.copy_(_heads(full.c_proj.weight, s.hidden, 1, dim=1))
    if mine.c_proj.bias is not None:
        mine.c_proj.bias.copy_(full.c_proj.bias)
    for name in ("weight", "bias"):
        t = getattr(full.c_fc, name)
        if t is None:
            continue
        parts = t.chunk(2) if full.swiglu else (t,)  # SwiGLU: gate and up, each split
        getattr(mine.c_fc, name).copy_(torch.cat([_heads(p, s.hidden, 1) for p in parts]))


def all_reduces(part: GPT) -> int:
    """All-reduces a shard has run (two per layer per forward pass)."""
    return sum(m.calls for m in part.modules() if isinstance(m, RowParallel))


# --- the ranks: processes in one group --------------------------------------------------
def launch(fn, world: int, *args, threads: int = 1, timeout: float = 600.0, **kwargs) -> list:
    """Start `world` processes in one gloo group, each running fn(rank, world, *args,
    **kwargs) on `threads` CPU threads; their results, by rank. `fn` and its arguments
    must be picklable (a module-level function: a notebook's own cannot be started)."""
    int_at_least("world", world, hint=" (ranks)")
    int_at_least("threads", threads)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked locks or threads
    results, done = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")  # where the ranks find each other
        procs = [ctx.Process(target=_rank, daemon=True,
                             args=(fn, rank, world, store, threads, results, done, args, kwargs))
                 for rank in range(world)]
        for p in procs:
            p.start()
        try:
            out = _collect(procs, results, world, timeout)
        finally:
            done.set()  # the ranks may exit once their results are read
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    return out


def _collect(procs, results, world: int, timeout: float) -> list:
    out, waited = {}, 0.0
    while len(out) < world:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            waited += 1.0
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or waited > timeout:
                raise RuntimeError(f"rank {dead[0] if dead else '?'} died or timed out "
                                   f"before returning (a script that starts ranks needs "
                                   f"`if __name__ == '__main__':` around them)") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out[rank] = value
    return [out[r] for r in range(world)]


def _rank(fn, rank, world, store, threads, results, done, args, kwargs) -> None:
    torch.set_num_threads(threads)
    parent = os.getppid()  # if it is killed (SIGKILL: no `done` ever comes), stop waiting
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        results.put((rank, True, fn(rank, world, *args, **kwargs)))
    except Exception:  # the parent raises it, naming the rank
        results.put((rank, False, traceback.format_exc()))
    while not done.wait(1.0) and os.getppid() == parent:
        pass  # tensors sent through the queue live in this process until read
    if dist.is_initialized():
        dist.destroy_process_group()


def run_sharded(rank: int, world: int, model: GPT, decoder, args: tuple = (),
                kwargs: dict | None = None) -> dict:
    """One rank's run of `decoder(shard, *args, **kwargs)` (generate, speculate, serve,
    ...): its output, its shard, the all-reduces it ran and its config (its cache's shape)."""
    part = shard(model, rank, world)
    output = decoder(part, *args, **(kwargs or {}))
    return dict(output=output, shard=part.shard, all_reduces=all_reduces(part),
                config=part.config)


def tensor_parallel(model: GPT, world: int, decoder, *args, **kwargs) -> list[dict]:
    """Run `decoder(model, *args, **kwargs)` with `model` split over `world` processes:
    each rank's `run_sharded` result (rank 0's output is the answer; every rank's is the
    same)."""
    check_model("model", model)
    plan(model.config, 0, world)  # refuse a bad world before starting any process
    return launch(run_sharded, world, model, decoder, args, kwargs)  # kwargs: the decoder's
