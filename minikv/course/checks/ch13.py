"""Chapter 13's checkers (tensor parallelism, disaggregated serving), against the engine on the
CPU, leaving the caller's random state alone: shard_attention (build: one layer's slices for one
rank, against what `shard` holds), predict_cache_per_rank (predict Llama-3-8B's cache per rank,
then measure ours on the shards' configs), row_parallel (debug: a row-parallel layer that adds
its bias on every rank, run on ranks as threads), choose_tp (design: the fewest ranks whose
memory holds the weights and a context's K/V), restore_blocks (build: the decode side's restore,
against RadixTree.restore on a real pool) and transfer_or_recompute (design: the break-even of
moving a prompt's K/V against computing it again). shard_attention, choose_tp and
transfer_or_recompute are checked from data (EXERCISES); the hints are in hints/ch13.toml."""
from __future__ import annotations

import copy
import functools
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...engine import GPT, GPTConfig, KVCache, Radix, RadixTree, kv_cache_bytes
from ...engine.paged import BlockPool
from ...engine.parallel import RowParallel, plan, shard
from .. import checks as ck
from ..checkpoint import load_course_model
from ..parallel import Unmatched, in_threads

H = ck.hints("ch13")
S, P, R, D, B, T = (H[k] for k in ("shard_attention", "predict_cache_per_rank",
                                   "row_parallel", "choose_tp", "restore_blocks",
                                   "transfer_or_recompute"))


# --- exercise 1 (build): one attention layer's slices for one rank ----------------------------
def _sizes(c_attn, c_proj, n_head, n_kv_head):
    hs = c_proj.size(1) // n_head  # c_proj reads n_head heads of hs: (n_embd, n_head * hs)
    return hs, n_head * hs, n_kv_head * hs


def attention_slices(c_attn, c_proj, n_head, n_kv_head, rank, world):
    """Rank `rank`'s rows of the fused c_attn (its query heads', then its K/V heads' keys and
    values) and its columns of c_proj, by the engine's plan of the ranks' heads."""
    hs, nq, nkv = _sizes(c_attn, c_proj, n_head, n_kv_head)
    cfg = GPTConfig(n_layer=1, n_head=n_head, n_kv_head=n_kv_head, n_embd=c_proj.size(0),
                    head_size=hs, n_inner=world, vocab_size=8, block_size=8)
    s = plan(cfg, rank, world)
    q, k, v = c_attn.split([nq, nkv, nkv])
    rows = [t[h.start * hs:h.stop * hs] for t, h in ((q, s.q_heads), (k, s.kv_heads),
                                                      (v, s.kv_heads))]
    return torch.cat(rows), c_proj[:, s.q_heads.start * hs:s.q_heads.stop * hs]


def by_hand(c_attn, c_proj, n_head, n_kv_head, rank, world):
    """The exercise's answer as a learner writes it: the head ranges worked out, not planned."""
    hs = c_proj.size(1) // n_head
    nh = n_head // world                              # query heads per rank
    q0 = rank * nh                                    # this rank's first query head
    kv0 = q0 * n_kv_head // n_head                    # the K/V head that query head reads
    nkv = max(n_kv_head // world, 1)                  # K/V heads per rank, at least one
    q, k, v = c_attn.split([n_head * hs, n_kv_head * hs, n_kv_head * hs])
    rows = [q[q0 * hs:(q0 + nh) * hs], k[kv0 * hs:(kv0 + nkv) * hs], v[kv0 * hs:(kv0 + nkv) * hs]]
    return torch.cat(rows), c_proj[:, q0 * hs:(q0 + nh) * hs]


def _wrong_slices(c_attn, c_proj, n_head, n_kv_head, rank, world, *, kv=None, proj_rows=False,
                  q_width=None):
    """The slices with one usual mistake: `kv(rank, world, n_head, n_kv_head)` the K/V heads
    (a range), `proj_rows` c_proj's rows, `q_width` the query rows' total."""
    hs, nq, nkv = _sizes(c_attn, c_proj, n_head, n_kv_head)
    q, k, v = c_attn.split([nq, nkv, nkv])
    width = (q_width or nq) // world
    heads = kv(rank, world, n_head, n_kv_head) if kv else None
    rows = [q[rank * width:(rank + 1) * width]]
    if heads is not None:
        rows += [t[heads.start * hs:heads.stop * hs] for t in (k, v)]
    else:
        own = by_hand(c_attn, c_proj, n_head, n_kv_head, rank, world)[0]
        rows = [q[rank * width:(rank + 1) * width], own[nq // world:]]
    proj = (c_proj[rank * (nq // world):(rank + 1) * (nq // world)] if proj_rows
            else c_proj[:, rank * (nq // world):(rank + 1) * (nq // world)])
    return torch.cat(rows), proj


def _kv_by_query(rank, world, n_head, n_kv_head):
    return range(rank * n_head // world, (rank + 1) * n_head // world)


def _kv_no_replication(rank, world, n_head, n_kv_head):
    return range(rank * n_kv_head // world, (rank + 1) * n_kv_head // world)


def _kv_round_robin(rank, world, n_head, n_kv_head):
    if n_kv_head >= world:
        return range(rank * n_kv_head // world, (rank + 1) * n_kv_head // world)
    return range(rank % n_kv_head, rank % n_kv_head + 1)


def _kv_all(rank, world, n_head, n_kv_head):
    return range(n_kv_head)


def _wrong(**how):
    return functools.partial(_wrong_slices, **how)


def _course_layer(name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    model, _ = load_course_model(name, "cpu")
    attn, cfg = model.transformer.h[layer].attn, model.config
    return (attn.c_attn.weight.detach().clone(), attn.c_proj.weight.detach().clone(),
            cfg.n_head, cfg.kv_heads)


def _tiny_layer() -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """6 query heads of 4 over a width of 16 (q is 24 rows, not 16), 3 K/V heads."""
    gen = torch.Generator().manual_seed(130)
    return (torch.randn(24 + 2 * 12, 16, generator=gen), torch.randn(16, 24, generator=gen), 6,
            3)


def _shard_cases() -> list[tuple]:
    target, gqa, mqa = (_course_layer(n, i) for n, i in (("target", 3), ("target-gqa2", 0),
                                                         ("target-mqa", 7)))
    return [(*target, 0, 1), (*target, 0, 2), (*target, 1, 2), (*target, 3, 4),
            (*gqa, 1, 2), (*gqa, 1, 4), (*gqa, 2, 4), (*mqa, 1, 2), (*mqa, 5, 8),
            (*_tiny_layer(), 2, 3), (*_tiny_layer(), 1, 6)]


def _describe_shard(c_attn, c_proj, n_head, n_kv_head, rank, world) -> str:
    kind = ("multi-head" if n_kv_head == n_head else "multi-query" if n_kv_head == 1
            else f"grouped-query, {n_kv_head} K/V heads")
    return (f"c_attn {tuple(c_attn.shape)}, c_proj {tuple(c_proj.shape)}, {n_head} query heads "
            f"({kind}), rank {rank} of {world}")


def _same_slices(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _slices(got, *case):
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(
            isinstance(t, torch.Tensor) for t in got):
        raise ck.Refused(S["pair"], "(c_attn rows, c_proj columns): two tensors")
    return tuple(got)


def _show_slices(value) -> str:
    return " and ".join(f"shape {tuple(t.shape)}" for t in value)


SHARD = ck.Exercise(
    "shard_attention", cases=_shard_cases(), describe=_describe_shard,
    reference=attention_slices, returns=_slices, same=_same_slices, show=_show_slices,
    mistakes=ck.named(S, no_replication=_wrong(kv=_kv_no_replication),
                      kv_by_query=_wrong(kv=_kv_by_query),
                      round_robin=_wrong(kv=_kv_round_robin), all_kv=_wrong(kv=_kv_all),
                      proj_rows=_wrong(proj_rows=True),
                      q_by_width=lambda a, p, nh, kv, r, w: _wrong_slices(
                          a, p, nh, kv, r, w, q_width=p.size(0))),
    otherwise=S["otherwise"], raised=S["raised"], unchanged=S["unchanged"],
    forbid=(shard, plan), solution=by_hand)
check_shard_attention = SHARD.check


# --- exercise 2 (predict, then measure): each rank's cache ------------------------------------
LLAMA3_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, hidden_size=4096, intermediate_size=14336,
                 torch_dtype="bfloat16")  # its config.json, the fields that matter here
TPS = (1, 2, 4, 8, 16)
OURS = ("target", "target-gqa2", "target-mqa", "target-mla")
WORLDS = (1, 2, 4, 8)


def _llama_config() -> GPTConfig:
    v = LLAMA3_8B
    return GPTConfig(n_layer=v["num_hidden_layers"], n_head=v["num_attention_heads"],
                     n_kv_head=v["num_key_value_heads"], n_embd=v["hidden_size"],
                     head_size=v["head_dim"], n_inner=v["intermediate_size"], vocab_size=8,
                     block_size=8)


@functools.cache
def llama_per_rank() -> dict[int, int]:
    """Bytes per token of one rank's cache at each TP degree: a live bf16 cache of the rank's
    K/V heads (the engine's plan), 32 layers, one token written."""
    cfg, out = _llama_config(), {}
    for tp in TPS:
        heads = len(plan(cfg, 0, tp).kv_heads)
        cache = KVCache(cfg.n_layer, 1, heads, cfg.head_dim, 1, dtype=torch.bfloat16)
        for layer in range(cfg.n_layer):
            zeros = torch.zeros(1, heads, 1, cfg.head_dim, dtype=torch.bfloat16)
            cache.update(zeros, zeros, layer)
        out[tp] = cache.nbytes
    return out


def _llama_mistakes(tp: int) -> list[tuple[int, str]]:
    v = LLAMA3_8B
    n, kv, hd, nh = (v["num_hidden_layers"], v["num_key_value_heads"], v["head_dim"],
                     v["num_attention_heads"])
    right = n * 2 * hd * 2 * max(kv // tp, 1)
    return [(w, hint) for w, hint in [
            (n * 2 * hd * 2 * kv // tp, P["past_kv"]), (n * 2 * hd * 2 * nh // tp, P["query"]),
            (right * 2, P["fp32"]), (right // 2, P["k_only"]), (right // n, P["one_layer"]),
            (right * 8, P["bits"]), (right * tp, P["all_ranks"]),
            (n * 2 * hd * 2 * kv, P["whole"])] if w != right]


def measured_per_rank(model: GPT, world: int) -> list[int]:
    """Each rank's cache bytes per token, in the model's dtype, from its shard's config."""
    return [kv_cache_bytes(shard(model, r, world).config, 1, dtype=model.dtype)
            for r in range(world)]


@functools.cache
def _course_per_rank(name: str, world: int) -> list[int]:
    return measured_per_rank(load_course_model(name, "cpu")[0], world)


def _ours_mistakes(model: GPT, world: int) -> dict[str, list[int]]:
    cfg, dtype = model.config, model.dtype
    whole = kv_cache_bytes(cfg, 1, dtype=dtype)
    query = kv_cache_bytes(cfg, 1, dtype=dtype, n_kv_head=cfg.n_head // world) if (
        cfg.kv_lora_rank is None) else whole // world
    return {P["ours_whole"]: [whole] * world, P["ours_divided"]: [whole // world] * world,
            P["ours_query"]: [query] * world,
            P["ours_total"]: [sum(measured_per_rank(model, world))] * world}
OURS_HINTS = (P["ours_whole"], P["ours_divided"], P["ours_query"], P["ours_total"])
# the (model, world) pairs tell these apart: whole and divided differ at every world > 1,
# divided and the shards' differ past n_kv_head (target-gqa2 at 4, target-mqa at 2, MLA)


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_predict_cache_per_rank(predict_llama_per_rank, cache_per_rank) -> None:
    """predict_llama_per_rank() -> {tp: bytes per token on one rank}, against live caches;
    cache_per_rank(model, world) -> [bytes per token of each rank's cache], against the shards'
    configs, for four course models at worlds 1 to 8."""
    name = "predict_cache_per_rank"
    case = "Llama-3-8B (32 layers, 8 K/V heads of 128, bf16) at TP " + ", ".join(map(str, TPS))
    got = ck.predicted(name, case, ck.prediction(name, case, predict_llama_per_rank, GPT.forward,
                                                 KVCache.update, kv_cache_bytes, plan, shard),
                       TPS, P["dict"], P["int"])
    measured = llama_per_rank()
    ck.as_measured(name, case, got, measured, _llama_mistakes, P["wrong"], P["otherwise"],
                   lambda tp: f"one rank's cache at TP {tp}")
    n, wrong = len(TPS), []
    for model_name in OURS:
        model, _ = load_course_model(model_name, "cpu")
        for world in WORLDS:
            n += 1
            where = f"cache_per_rank(the shipped {model_name}, world={world})"
            mine = ck.int_list(ck.call(name, where, cache_per_rank, model, world))
            want = _course_per_rank(model_name, world)
            if mine is None or len(mine) != world:
                ck.fail(name, where, want, mine, P["ours_list"])
            if mine != want:
                wrong.append(((model, world), mine, where, want))
    if wrong:  # the mistake that gives every wrong answer (several agree on some models)
        (_, mine, where, want), mistakes = wrong[0], {
            hint: lambda m, w, hint=hint: _ours_mistakes(m, w)[hint] for hint in OURS_HINTS}
        hint = ck.diagnose(mistakes, [(case, got) for case, got, _, _ in wrong])
        ck.fail(name, where, want, mine, hint or P["ours_otherwise"])
    print(f"  measured: Llama-3-8B's rank holds {measured[1]:,} bytes a token at TP 1, "
          f"{measured[8]:,} at TP 8 and {measured[16]:,} at TP 16: past 8 ranks, 8 K/V heads "
          f"cannot be split further")
    ck.passed(name, n)


# --- exercise 3 (debug): a row-parallel layer that adds its bias on every rank ---------------
class BuggyRowParallel(nn.Module):
    """The notebook's row-parallel layer, verbatim: this rank's slice of the input features
    times its columns of the weight, summed over the ranks by one all-reduce. It has a bug."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (B, T, out): this rank's share of the sum
        dist.all_reduce(y)                       # every rank now holds the sum over the ranks
        return y


class _Twice(BuggyRowParallel):
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class _NoBias(BuggyRowParallel):
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y


class _Mean(BuggyRowParallel):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        dist.all_reduce(y)
        return y / dist.get_world_size()


class _NoReduce(BuggyRowParallel):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


ROW_MISTAKES = {R["twice"]: _Twice, R["no_bias"]: _NoBias, R["mean"]: _Mean,
                R["no_reduce"]: _NoReduce}
# (what, in_features, out_features, bias, world, tokens)
ROW_CASES = [("a random layer", 12, 5, True, 1, 3), ("a random layer", 12, 5, True, 2, 3),
             ("a random layer", 12, 5, True, 4, 2), ("a random layer", 18, 7, True, 3, 4),
             ("a random layer without a bias", 12, 5, False, 2, 3),
             ("the shipped target's layer 4, attention c_proj, its real input", None, None, True,
              2, None)]


@functools.cache
def _target_c_proj() -> tuple[nn.Linear, torch.Tensor]:
    """The target's layer-4 attention output projection and what it reads for a prompt."""
    model, tok = load_course_model("target", "cpu")
    attn, seen = model.transformer.h[4].attn, {}
    handle = attn.c_proj.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    with torch.no_grad():
        model(torch.tensor([tok.encode("The color of dog can vary widely")]))
    handle.remove()
    return attn.c_proj, seen["x"].clone()


def _row_layer(case) -> tuple[nn.Linear, torch.Tensor]:
    what, n_in, n_out, bias, world, tokens = case
    if n_in is None:
        return _target_c_proj()
    gen = torch.Generator().manual_seed(131 + n_in + world)
    layer = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=gen) * 3)
    return layer, torch.randn(1, tokens, n_in, generator=gen)


def _rank_linear(whole: nn.Linear, rank: int, world: int) -> nn.Linear:
    """Rank `rank`'s nn.Linear of a row-parallel layer: its columns, the bias whole."""
    n = whole.in_features // world
    part = nn.Linear(n, whole.out_features, bias=whole.bias is not None)
    with torch.no_grad():
        part.weight.copy_(whole.weight[:, rank * n:(rank + 1) * n])
        if whole.bias is not None:
            part.bias.copy_(whole.bias)
    return part


def run_row_parallel(cls, whole: nn.Linear, x: torch.Tensor, world: int, forbid: tuple = ()):
    """cls(rank's linear) on each of `world` ranks as threads, each reading its slice of x's
    features; (each rank's output, all-reduces each rank ran). `forbid`: engine functions no
    rank may call (watched in each rank's thread)."""
    n = whole.in_features // world

    def rank_output(rank, world):
        layer = cls(_rank_linear(whole, rank, world))
        with torch.no_grad(), ck.forbid("row_parallel", *forbid):
            return layer(x[..., rank * n:(rank + 1) * n].clone())
    return in_threads(rank_output, world)


def _row_describe(case, whole) -> str:
    what, _, _, _, world, _ = case
    return (f"{what}: {whole.in_features} features in, {whole.out_features} out, on {world} "
            f"rank{'s' if world > 1 else ''}")


def _row_diagnose(whole, x, world, outs) -> str:
    for hint, cls in ROW_MISTAKES.items():
        try:
            theirs, _ = run_row_parallel(cls, whole, x, world)
        except Exception:  # noqa: BLE001 - a mistake that cannot run here explains nothing
            continue
        if all(ck.close(a, b, 1e-5) for a, b in zip(theirs, outs)):
            return hint
    return ""


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_row_parallel(layer_class) -> None:
    """layer_class(rank's nn.Linear) on ranks as threads: every rank's output equals the whole
    layer's, with one all-reduce per forward pass."""
    name, n = "row_parallel", 0
    ck.expect(isinstance(layer_class, type) and issubclass(layer_class, nn.Module), name,
              "the class", "an nn.Module subclass (of BuggyRowParallel)", layer_class,
              R["class"])
    same_as_buggy, counted = True, []
    for case in ROW_CASES:
        whole, x = _row_layer(case)
        world = case[4]
        where = _row_describe(case, whole)
        want = whole(x)
        outs, calls = ck.call_hinted(name, where, lambda e: R["unmatched"] if isinstance(
            e, Unmatched) else "your layer raised in this case", run_row_parallel,
            layer_class, whole, x, world, (RowParallel.forward,))
        n += 1
        buggy, _ = run_row_parallel(BuggyRowParallel, whole, x, world)
        as_buggy = all(isinstance(o, torch.Tensor) and ck.close(o, b, 1e-5)
                       for o, b in zip(outs, buggy))
        same_as_buggy &= as_buggy
        for rank, out in enumerate(outs):
            if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                ck.fail(name, f"{where}, rank {rank}", f"a tensor of shape {tuple(want.shape)}",
                        ck.kind(out), R["shape"])
            if not ck.close(out, want, 1e-4):
                off = float((out - want).abs().max())
                hint = (R["buggy"] + R["symptom"] if as_buggy and world > 1 else
                        _row_diagnose(whole, x, world, outs) or R["otherwise"])
                ck.fail(name, f"{where}, rank {rank}", "the whole layer's output (to 1e-4)",
                        f"values off by up to {off:.4g}", hint)
        counted.append((where, calls[0]))
    ck.expect(not same_as_buggy, name, "every case", "a fixed layer", "BuggyRowParallel's outputs",
              R["buggy"] + R["symptom"])
    for where, calls in counted:  # right outputs everywhere; then the cost: one all-reduce
        ck.expect(calls == 1, name, where, "one all-reduce per forward pass",
                  f"{calls} all-reduces", R["one"])
    ck.passed(name, n)


# --- exercise 4 (design): how many ranks, and how much K/V fits ----------------------------
GIB = 2 ** 30
MODELS = {  # parameters and attention shapes from each model's config.json; bf16 weights
    "Llama-3-8B": dict(params=8_030_261_248, layers=32, heads=32, kv_heads=8, head_dim=128,
                       bytes=2),
    "Llama-3-70B": dict(params=70_553_706_496, layers=80, heads=64, kv_heads=8, head_dim=128,
                        bytes=2),
    "Qwen2.5-14B": dict(params=14_770_033_664, layers=48, heads=40, kv_heads=8, head_dim=128,
                        bytes=2),
    "a 12-head MQA model": dict(params=2_000_000_000, layers=24, heads=12, kv_heads=1,
                                head_dim=128, bytes=2),
}
TP_WORLDS = (1, 2, 4, 8, 16)


def splits(model: dict, world: int) -> bool:
    """Does `world` split the query heads, and divide or multiply the K/V heads?"""
    kv = model["kv_heads"]
    return model["heads"] % world == 0 and (kv % world == 0 or world % kv == 0)


def kv_per_token(model: dict, world: int) -> int:
    """One rank's K/V bytes per token: its K/V heads (at least one: replicated past kv)."""
    return model["layers"] * 2 * model["head_dim"] * model["bytes"] * max(
        model["kv_heads"] // world, 1)


def best_tp(model: dict, memory: int, context: int):
    """(the fewest ranks in TP_WORLDS whose memory holds the weights / world and `context`
    tokens of K/V, the tokens of K/V each rank then holds), or None."""
    for world in TP_WORLDS:
        if not splits(model, world):
            continue
        tokens = (memory - model["params"] * model["bytes"] // world) // kv_per_token(model,
                                                                                       world)
        if tokens >= context:
            return world, int(tokens)
    return None


def _tp_rule(kv_bytes=kv_per_token, weights=lambda m, w: m["params"] * m["bytes"] // w,
             fits=lambda tokens, context: tokens >= context, worlds=TP_WORLDS, check=splits,
             report=lambda tokens, world: tokens):
    def rule(model, memory, context):
        for world in worlds:
            if not check(model, world):
                continue
            tokens = (memory - weights(model, world)) // kv_bytes(model, world)
            if fits(tokens, context):
                return world, int(report(tokens, world))
        return None
    return rule


def _whole_kv(m, w):
    return kv_per_token(m, 1)


def _kv_past(m, w):
    return max(kv_per_token(m, 1) // w, 1)


def _query_heads(m, w):
    return m["layers"] * 2 * m["head_dim"] * m["bytes"] * m["heads"] // w


CHOOSE_CASES = [("Llama-3-8B", 24 * GIB, 8192), ("Llama-3-8B", 24 * GIB, 65536),
                ("Llama-3-8B", 16 * GIB, 32768), ("Llama-3-8B", 10_177_744_896, 32768),
                ("Llama-3-8B", 12 * GIB, 131072),
                ("Llama-3-70B", 80 * GIB, 8192), ("Llama-3-70B", 80 * GIB, 131072),
                ("Llama-3-70B", 40 * GIB, 131072), ("Llama-3-70B", 24 * GIB, 131072),
                ("Llama-3-70B", 10 * GIB, 8192), ("Qwen2.5-14B", 24 * GIB, 32768),
                ("Qwen2.5-14B", 12 * GIB, 65536), ("a 12-head MQA model", 2 * GIB, 65536),
                ("a 12-head MQA model", 1 * GIB, 16384)]


def _choose_case(name, memory, context):
    return dict(MODELS[name]), memory, context


def _describe_choice(model, memory, context) -> str:
    name = next(n for n, m in MODELS.items() if m == model)
    return (f"{name} ({model['params']:,} parameters, {model['layers']} layers, "
            f"{model['heads']} heads, {model['kv_heads']} K/V heads of {model['head_dim']}, "
            f"bf16), {memory:,} bytes ({memory / GIB:.2f} GiB) a device, a context of "
            f"{context:,} tokens")


def _choice(got, *case):
    if got is None:
        return None
    pair = ck.int_list(got) if isinstance(got, (tuple, list)) else None
    if pair is None or len(pair) != 2:
        raise ck.Refused(D["pair"], "(world, tokens) as two ints, or None")
    return tuple(pair)


CHOOSE = ck.Exercise(
    "choose_tp", cases=[_choose_case(*c) for c in CHOOSE_CASES], describe=_describe_choice,
    reference=best_tp, returns=_choice,
    mistakes=ck.named(D, whole_kv=_tp_rule(kv_bytes=_whole_kv),
                      kv_past=_tp_rule(kv_bytes=_kv_past),
                      query_heads=_tp_rule(kv_bytes=_query_heads),
                      whole_weights=_tp_rule(weights=lambda m, w: m["params"] * m["bytes"]),
                      strict=_tp_rule(fits=lambda tokens, context: tokens > context),
                      largest=_tp_rule(worlds=TP_WORLDS[::-1]),
                      any_world=_tp_rule(check=lambda m, w: True),
                      all_ranks=_tp_rule(report=lambda tokens, world: tokens * world),
                      no_weights=_tp_rule(weights=lambda m, w: 0)),
    otherwise=D["otherwise"], raised=D["raised"])
check_choose_tp = CHOOSE.check




# --- exercise 5 (build): the decode side's restore ---------------------------------------------
def restore_by_hand(keys, values, blocks_there, pool_keys, pool_values, free, page_size):
    """The exercise's answer: fresh blocks from the front of `free`, each page_size positions
    of every layer's keys and values written into its first slots."""
    n = keys.shape[2]                                   # (layers, kv_heads, n, head_dim)
    table = [free.pop(0) for _ in range(-(-n // page_size))]
    for pool, src in ((pool_keys, keys), (pool_values, values)):
        for layer, x in zip(pool, src):
            for i, block in enumerate(table):
                chunk = x[:, i * page_size:(i + 1) * page_size]  # (kv_heads, <= ps, hd)
                layer[block, :, :chunk.shape[1]] = chunk
    return table


def _restore_worker_ids(keys, values, there, pk, pv, free, ps):
    table = list(there)
    for pool, src in ((pk, keys), (pv, values)):
        for layer, x in zip(pool, src):
            for i, block in enumerate(table):
                chunk = x[:, i * ps:(i + 1) * ps]
                layer[block, :, :chunk.shape[1]] = chunk
    return table


def _restore_whole_blocks(keys, values, there, pk, pv, free, ps):
    table = [free.pop(0) for _ in range(keys.shape[2] // ps)]  # the partial block lost
    for pool, src in ((pk, keys), (pv, values)):
        for layer, x in zip(pool, src):
            for i, block in enumerate(table):
                layer[block] = x[:, i * ps:(i + 1) * ps]
    return table


def _restore_swapped(keys, values, there, pk, pv, free, ps):
    return restore_by_hand(values, keys, there, pk, pv, free, ps)


def _restore_offset(keys, values, there, pk, pv, free, ps):
    n = keys.shape[2]
    table = [free.pop(0) for _ in range(-(-n // ps))]
    for pool, src in ((pk, keys), (pv, values)):
        for layer, x in zip(pool, src):
            for p in range(n):
                layer[table[p // ps], :, (p + 1) % ps] = x[:, p]
    return table


def _restore_kept_free(keys, values, there, pk, pv, free, ps):
    table = free[:-(-keys.shape[2] // ps)]  # the blocks taken, but left on the free list
    return restore_by_hand(keys, values, there, pk, pv, list(table), ps)


RESTORE_MISTAKES = {B["worker_ids"]: _restore_worker_ids, B["whole_blocks"]: _restore_whole_blocks,
                    B["swapped"]: _restore_swapped, B["offset"]: _restore_offset,
                    B["kept_free"]: _restore_kept_free}
# (what, config, positions, page_size, pool blocks, free blocks in order, the worker's ids)
RESTORE_CASES = [
    ("2 full blocks", "tiny", 32, 16, 12, [5, 2, 9, 3, 7, 11], [0, 1]),
    ("a partial last block", "tiny", 37, 16, 12, [8, 4, 10, 6, 1], [0, 2, 3]),
    ("fewer positions than a block", "tiny", 5, 8, 6, [3, 1, 5], [0]),
    ("one position", "tiny", 1, 4, 5, [4, 0, 2], [1]),
    ("grouped-query K/V, 6 blocks of 4", "gqa", 23, 4, 10, [9, 2, 7, 0, 5, 3, 8], [1, 2, 3, 4,
                                                                                     5, 6]),
    ("the course target's shapes, 40 positions", "target", 40, 16, 8, [6, 3, 7, 5], [0, 1, 2]),
    ("a pool with just enough room", "tiny", 24, 8, 5, [3, 0, 4], [1, 2, 0]),
]
_RESTORE_CONFIGS = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=32),
    "gqa": dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=32),
    "target": None,
}


def _restore_config(kind: str) -> GPTConfig:
    if _RESTORE_CONFIGS[kind] is None:
        return load_course_model("target", "cpu")[0].config
    return GPTConfig(vocab_size=64, block_size=64, **_RESTORE_CONFIGS[kind])


def _restore_case(case) -> tuple:
    """(keys, values, blocks_there, pool_keys, pool_values, free, page_size): random K/V of n
    positions, and a pool whose every block holds something (other requests' K/V where in use,
    stale K/V where free)."""
    what, kind, n, ps, blocks, free, there = case
    cfg = _restore_config(kind)
    heads, hd, _ = cfg.kv_shape
    gen = torch.Generator().manual_seed(135 + n + ps)
    kv = [torch.randn(cfg.n_layer, heads, n, hd, generator=gen) for _ in range(2)]
    pool = [[torch.randn(blocks, heads, ps, hd, generator=gen) for _ in range(cfg.n_layer)]
            for _ in range(2)]
    return kv[0], kv[1], list(there), pool[0], pool[1], list(free), ps


def engine_restore(keys, values, pool_keys, pool_values, free, page_size):
    """What the engine's RadixTree.restore does with them: a BlockPool holding these tensors,
    `free` its free list (every other block in use), the tree's blocks for the positions
    after; (blocks, pool keys, pool values, free list after)."""
    layers, heads, n, hd = keys.shape
    cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=heads * hd, vocab_size=8,
                    block_size=max(8, n))
    pool = BlockPool(cfg, pool_keys[0].shape[0], page_size)
    pool.keys, pool.values = [t.clone() for t in pool_keys], [t.clone() for t in pool_values]
    pool.free = deque(free)
    pool.ref = [0 if b in free else 1 for b in range(pool.num_blocks)]
    tree = RadixTree(pool, Radix())
    tree.restore(list(range(n)), keys, values)
    blocks = [b for node, _ in tree.match(list(range(n))) for b in node.blocks]
    return blocks, pool.keys, pool.values, list(pool.free)


def _through(pool: list[torch.Tensor], table: list[int], n: int, ps: int) -> torch.Tensor:
    """n positions read back through `table`: (layers, kv_heads, n, head_dim)."""
    return torch.stack([torch.cat([layer[b] for b in table], dim=1)[:, :n] for layer in pool])


def _restore_outcome(fn, case):
    """fn on fresh copies of the case: (its answer, pool keys, pool values, free list)."""
    keys, values, there, pk, pv, free, ps = copy.deepcopy(_restore_case(case))
    got = fn(keys, values, there, pk, pv, free, ps)
    return got, pk, pv, free


def _same_outcome(a, b) -> bool:
    (t1, k1, v1, f1), (t2, k2, v2, f2) = a, b
    return (ck.int_list(t1) == ck.int_list(t2) and list(f1) == list(f2)
            and all(torch.equal(x, y) for x, y in zip(k1 + v1, k2 + v2)))


def _restore_hint(case, outcome) -> str:
    for hint, wrong in RESTORE_MISTAKES.items():
        try:
            if _same_outcome(_restore_outcome(wrong, case), outcome):
                return hint
        except Exception:  # noqa: BLE001 - a mistake that cannot run here explains nothing
            continue
    return ""


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_restore_blocks(restore_blocks) -> None:
    """restore_blocks(keys, values, blocks_there, pool_keys, pool_values, free, page_size) ->
    the new block table, on pools that hold other K/V: the same K/V at the same positions
    through its table as the engine's RadixTree.restore puts there, only fresh blocks written,
    and taken off the free list."""
    name = "restore_blocks"
    for case in RESTORE_CASES:
        what, _, n, ps, blocks, free, there = case
        where = (f"{what}: {n} positions, page_size {ps}, a pool of {blocks} blocks, free "
                 f"{free}, the worker's ids {there}")
        with ck.forbid(name, RadixTree.restore, BlockPool.reserve, BlockPool.allocate):
            outcome = ck.call_hinted(name, where, lambda e: B["raised"], _restore_outcome,
                                     restore_blocks, case)
        got, pk, pv, left = outcome
        keys, values, _, k0, v0, _, _ = _restore_case(case)
        want, wk, wv, wfree = engine_restore(keys, values, k0, v0, free, ps)
        table = ck.int_list(got)
        ck.expect(table is not None, name, where, "the new block table: a list of block ids",
                  ck.kind(got), B["table"] + ck.FORGOT * (got is None))
        hint = _restore_hint(case, outcome)
        ck.expect(len(table) == len(want), name, where, f"{len(want)} blocks", table,
                  hint or B["count"])
        ck.expect(len(set(table)) == len(table) and set(table) <= set(free), name, where,
                  f"{len(want)} distinct blocks from free {free}", table,
                  hint or B["not_free"])
        ck.expect(list(left) == [b for b in free if b not in table], name, where,
                  "free without the blocks taken", list(left), hint or B["kept_free"])
        others = [b for b in range(blocks) if b not in table]
        ck.expect(all(torch.equal(a[others], b[others]) for a, b in zip(pk + pv, k0 + v0)),
                  name, where, "every other block as it was", "another block written",
                  hint or B["others"])
        for mine, theirs, label in ((pk, wk, "keys"), (pv, wv, "values")):
            ck.expect(torch.equal(_through(mine, table, n, ps), _through(theirs, want, n, ps)),
                      name, where, f"the {label} restore puts there, read through the table",
                      f"other {label} at some positions", hint or B["otherwise"])
    ck.passed(name, len(RESTORE_CASES))


# --- exercise 6 (design): move the K/V, or compute it again --------------------------------------
def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares: y ≈ a + b·x, as bench-disagg fits its lines."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def transfer_or_recompute(rows, bytes_per_position, link_bits_per_s, length):
    """(L*, "transfer" or "recompute" for a prompt of `length` positions) on a link of
    `link_bits_per_s`: a from the transfers' intercept, p0 and p1 from the recomputes."""
    lengths = [r["positions"] for r in rows]
    a, _ = fit_line(lengths, [r["transfer_s"] for r in rows])
    p0, p1 = fit_line(lengths, [r["recompute_s"] for r in rows])
    ship = bytes_per_position / (link_bits_per_s / 8)  # B / W, W in bytes a second
    moved, computed = a + length * ship, p0 + p1 * length
    return (a - p0) / (p1 - ship), "transfer" if moved < computed else "recompute"


def _plan_rule(fixed=True, bytes_of=lambda bits: bits / 8, slope=None, sign=1, way=None):
    """The rule with one knob turned: `fixed` False fits through the origin, `bytes_of` the
    link's bytes a second, `slope` the per-position cost measured (not the link's), `sign` -1
    the break-even's sign flipped, `way` a decision read from L* alone."""
    def rule(rows, bytes_per_position, link_bits_per_s, length):
        xs = [r["positions"] for r in rows]
        if fixed:
            a, measured = fit_line(xs, [r["transfer_s"] for r in rows])
            p0, p1 = fit_line(xs, [r["recompute_s"] for r in rows])
        else:
            sxx = sum(x * x for x in xs)
            a, p0 = 0.0, 0.0
            measured = sum(x * r["transfer_s"] for x, r in zip(xs, rows)) / sxx
            p1 = sum(x * r["recompute_s"] for x, r in zip(xs, rows)) / sxx
        ship = measured if slope else bytes_per_position / bytes_of(link_bits_per_s)
        cut = sign * (a - p0) / (p1 - ship)
        if way is not None:
            return cut, way(length, cut)
        return cut, "transfer" if a + length * ship < p0 + p1 * length else "recompute"
    return rule


def _table(a, per_position, p0, p1, lengths=(4, 16, 32, 64, 128, 192, 248)):
    """Measured-looking rows: the lines, each time off by a fixed fraction (up to 3%)."""
    wobble = [0.02, -0.01, 0.03, -0.02, 0.01, -0.03, 0.015]
    return [{"positions": n, "transfer_s": (a + per_position * n) * (1 + w),
             "recompute_s": (p0 + p1 * n) * (1 - w)} for n, w in zip(lengths, wobble)]


LOOPBACK = _table(1.2e-3, 8.8e-6, 2.8e-3, 1.8e-4)   # about the committed CPU run's lines
SETUP = _table(6e-3, 2e-6, 5e-4, 6e-5)               # a costly handshake, a cheap prefill
PLAN_CASES = [(LOOPBACK, 18_432, 400e9, 64), (LOOPBACK, 18_432, 0.5e9, 8),
              (LOOPBACK, 18_432, 0.5e9, 200), (SETUP, 18_432, 100e9, 16),
              (SETUP, 18_432, 100e9, 240), (SETUP, 18_432, 2e9, 120),
              (LOOPBACK, 1_024, 1e9, 32)]


def _describe_plan(rows, bytes_per_position, link_bits_per_s, length) -> str:
    a, per = fit_line([r["positions"] for r in rows], [r["transfer_s"] for r in rows])
    return (f"{len(rows)} measured lengths (transfers: {a * 1e3:.2f} ms + {per * 1e6:.2f} µs a "
            f"position there), {bytes_per_position:,} bytes a position, a link of "
            f"{link_bits_per_s / 1e9:g} Gbit/s, a prompt of {length} positions")


def _plan(got, *case):
    if not isinstance(got, (tuple, list)) or len(got) != 2 or got[1] not in (
            "transfer", "recompute") or isinstance(got[0], bool):
        raise ck.Refused(T["pair"], '(L*, "transfer" or "recompute")')
    try:
        return float(got[0]), got[1]
    except (TypeError, ValueError):
        raise ck.Refused(T["pair"], '(L*, "transfer" or "recompute")') from None


def _same_plan(a, b) -> bool:
    return a[1] == b[1] and abs(a[0] - b[0]) <= 1e-6 * max(1.0, abs(b[0]))


PLAN = ck.Exercise(
    "transfer_or_recompute", cases=PLAN_CASES, describe=_describe_plan,
    reference=transfer_or_recompute, returns=_plan, same=_same_plan,
    mistakes=ck.named(T, no_fixed=_plan_rule(fixed=False),
                      bits=_plan_rule(bytes_of=lambda bits: bits),
                      measured_link=_plan_rule(slope=True), sign=_plan_rule(sign=-1),
                      wrong_way=_plan_rule(way=lambda n, cut: "transfer" if n > cut
                                           else "recompute")),
    otherwise=T["otherwise"], raised=T["raised"])
check_transfer_or_recompute = PLAN.check

EXERCISES = (SHARD, CHOOSE, PLAN)
