"""Chapter 12's checkers (shrinking the cache in the architecture), against the engine on the
CPU, leaving the caller's random state alone: absorbed_decode (tensors, with the latents watched
so that an expanded cache is named), predict_bytes_per_token (predict, then measure),
heavy_hitters (debug: an H2O cache that scores along the wrong axis) and choose_cache (design:
a table the learner measures, then a choice under a memory budget). All four are code checkers;
the hints are in hints/ch12.toml."""
from __future__ import annotations

import functools
import math

import torch

from ...engine import GPT, GPTConfig, H2OCache, KVCache, kv_cache_bytes
from ...engine.config import LLAMA
from ...engine.evict import ScoredCache
from ...engine.model import LatentAttention
from .. import checks as ck
from .. import corpus
from ..checkpoint import load_course_model
from ..eviction import eviction_accuracy, make_cache, read, through

H = ck.hints("ch12")
A, P, HH, C = (H[k] for k in ("absorbed_decode", "predict_bytes_per_token", "heavy_hitters",
                              "choose_cache"))


def _question_ids(tok, index: int = -1) -> list[int]:
    """A held-out coin-flip question with unseen names (the last: 8 people), as token ids."""
    return tok.encode(corpus.unseen_coin_flips(1)[index].prompt())


# --- exercise 1 (build): the absorbed decode ------------------------------------------------
def naive_decode(q, latent, w_uk, w_uv) -> torch.Tensor:
    """The naive form, in float64: every cached latent expanded to each head's key and value,
    then softmax(q kᵀ / √hs) v. q (B, nh, 1, hs), latent (B, L, dc), w_uk and w_uv (nh, hs, dc)."""
    q, latent, w_uk, w_uv = (t.double() for t in (q, latent, w_uk, w_uv))
    keys = latent[:, None] @ w_uk.transpose(1, 2)                            # (B, nh, L, hs)
    values = latent[:, None] @ w_uv.transpose(1, 2)                          # (B, nh, L, hs)
    weights = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return weights @ values                                                   # (B, nh, 1, hs)


def absorbed(q, latent, w_uk, w_uv, scale=None, dim=-1, softmax=True, swap=False,
             one_head=False, uv=True) -> torch.Tensor:
    """The absorbed decode; its keywords make the usual mistakes."""
    hs = w_uk.size(1)
    if swap:
        w_uk, w_uv = w_uv, w_uk
    if one_head:
        w_uk, w_uv = (w[:1].expand_as(w) for w in (w_uk, w_uv))
    c = latent[:, None]                                                       # (B, 1, L, dc)
    scores = (q @ w_uk) @ c.transpose(-1, -2) * (                            # (B, nh, 1, L)
        1 / math.sqrt(hs) if scale is None else scale(w_uk.size(1), w_uk.size(2)))
    weights = scores.softmax(dim) if softmax else scores
    mixed = weights @ c                                                       # (B, nh, 1, dc)
    return mixed @ w_uv.transpose(1, 2) if uv else mixed                      # (B, nh, 1, hs)


DECODE_MISTAKES = {  # hint -> a wrong absorbed_decode
    A["no_scale"]: functools.partial(absorbed, scale=lambda hs, dc: 1.0),
    A["latent_scale"]: functools.partial(absorbed, scale=lambda hs, dc: 1 / math.sqrt(dc)),
    A["head_scale"]: functools.partial(absorbed, scale=lambda hs, dc: 1 / hs),
    A["swapped"]: functools.partial(absorbed, swap=True),
    A["over_queries"]: functools.partial(absorbed, dim=-2),
    A["over_heads"]: functools.partial(absorbed, dim=1),
    A["no_softmax"]: functools.partial(absorbed, softmax=False),
    A["one_head"]: functools.partial(absorbed, one_head=True),
    A["no_uv"]: functools.partial(absorbed, uv=False),
    A["heads_last"]: lambda *a: absorbed(*a).transpose(1, 2),
}
# (B, n_head, hs, dc, L): the first tells every mistake apart (hs != dc, several heads); L is
# never a head's width, so a tensor of L positions by hs (or n_head x hs) is an expanded cache
DECODE_SHAPES = [(1, 4, 6, 10, 7), (2, 3, 8, 5, 9), (1, 2, 4, 12, 1), (3, 8, 16, 24, 33)]
DECODE_LAYER = 5


class _Watched(torch.Tensor):
    """The latents, watched: every tensor computed from them whose shape has the L positions
    and a head's width (hs, or n_head x hs) is an expanded cache, recorded in `seen`."""
    seen: list
    positions: int
    widths: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and cls.positions in t.shape and any(
                        w in t.shape for w in cls.widths):
                    cls.seen.append(tuple(t.shape))
        return out


def watched(latent: torch.Tensor, n_head: int, hs: int) -> torch.Tensor:
    cls = type("Latents", (_Watched,), {"seen": [], "positions": latent.size(1),
                                         "widths": (hs, n_head * hs)})
    return latent.as_subclass(cls)


def _plain(t):
    if not isinstance(t, _Watched):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


@functools.cache
def mla_decode_inputs() -> tuple[torch.Tensor, ...]:
    """What layer DECODE_LAYER of the shipped target-mla has in hand at the decode step of an
    8-person question: the new query (1, nh, 1, hs), the cached latents (1, L, dc) and the
    layer's up-projections (nh, hs, dc) each."""
    model, tok = load_course_model("target-mla", "cpu")
    ids, cfg = _question_ids(tok), model.config
    attn, seen = model.transformer.h[DECODE_LAYER].attn, {}
    handle = attn.register_forward_hook(lambda module, args, out: seen.update(x=args[0]))
    cache = KVCache.for_model(model, max_len=len(ids))
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
        q = attn.q_proj(seen["x"][:, -1:]).view(1, 1, cfg.n_head, cfg.head_dim).transpose(1, 2)
    handle.remove()
    w_uk, w_uv = attn.kv_b_proj.weight.detach().view(cfg.n_head, 2, cfg.head_dim,
                                                     cfg.kv_lora_rank).unbind(1)
    latent = cache.keys[DECODE_LAYER][:, 0, :len(ids)]
    return q.clone(), latent.clone(), w_uk.clone(), w_uv.clone()


def _decode_cases() -> list[tuple[str, tuple]]:
    gen, cases = torch.Generator().manual_seed(120), []
    for B, nh, hs, dc, L in DECODE_SHAPES:
        dtype = torch.float64 if L > 30 else torch.float32
        q = torch.randn(B, nh, 1, hs, generator=gen, dtype=dtype) * 1.5
        latent = torch.randn(B, L, dc, generator=gen, dtype=dtype)
        w_uk, w_uv = (torch.randn(nh, hs, dc, generator=gen, dtype=dtype) * 0.4 for _ in "kv")
        what = ("only the new token cached" if L == 1 else f"{L} latents cached")
        cases.append((f"q ({B}, {nh}, 1, {hs}), latent ({B}, {L}, {dc}), w_uk and w_uv "
                      f"({nh}, {hs}, {dc}): {what}, {str(dtype).replace('torch.', '')}",
                      (q, latent, w_uk, w_uv)))
    q, latent, w_uk, w_uv = mla_decode_inputs()
    cases.append((f"the shipped target-mla, layer {DECODE_LAYER}, the decode step of an 8-person "
                  f"question: {latent.size(1)} latents of {latent.size(2)}, {q.size(1)} heads of "
                  f"{q.size(-1)}", (q, latent, w_uk, w_uv)))
    return cases


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_absorbed_decode(absorbed_decode) -> None:
    """absorbed_decode(q, latent, w_uk, w_uv) -> (B, nh, 1, hs), the naive form's output,
    without expanding the latents to keys or values."""
    name, cases = "absorbed_decode", _decode_cases()
    for case, (q, latent, w_uk, w_uv) in cases:
        B, nh, _, hs = q.shape
        watch = latent.size(1) > 1
        given = watched(latent, nh, hs) if watch else latent
        with ck.forbid(name, LatentAttention.forward):
            got = ck.call_kept(name, case, A["unchanged"], absorbed_decode, q, given, w_uk, w_uv,
                               raised=ck.raised_as(RuntimeError, A["crash"]))
        got = _plain(got)
        if watch and type(given).seen:
            ck.fail(name, case, "the latents read as they are, never expanded",
                    f"a tensor of shape {type(given).seen[0]} computed from them",
                    A["expanded"].format(shape=type(given).seen[0]))
        want = naive_decode(q, latent, w_uk, w_uv).to(q.dtype)
        real = case.startswith("the shipped")
        ck.expect_tensor(name, case, got, want, shape_words=" (B, n_head, 1, hs)",
                         values="the naive form's output (to 1e-4)", mistakes=DECODE_MISTAKES,
                         inputs=(q, latent, w_uk, w_uv),
                         hints={**A, "close": A["model"] if real else A["close"]},
                         same=lambda a, b: ck.close(a, b, 1e-4))
    ck.passed(name, len(cases))


# --- exercise 2 (predict, then measure): bytes per token of DeepSeek-V3 and of ours ----------
V3 = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
          num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, torch_dtype="bfloat16")  # its config.json
OURS = dict(kv_lora_rank=96, qk_rope_head_dim=12, n_inner=512, **LLAMA)  # V3's ratios, our size
BYTE_KEYS = ("deepseek_v3", "deepseek_v3_mha", "ours")
BYTE_LABELS = {"deepseek_v3": "DeepSeek-V3 (MLA, bf16)",
               "deepseek_v3_mha": "DeepSeek-V3's attention as multi-head attention (bf16)",
               "ours": "the target's shape with a latent of 96 and a rotary key of 12 (bf16)"}


def _one_token(cache: KVCache) -> KVCache:
    """`cache` with one token written in every layer (zeros: bytes do not depend on them)."""
    for layer in range(cache.n_layer):
        cache.update(torch.zeros(1, cache.n_head, 1, cache.head_dim, dtype=cache.dtype),
                     torch.zeros(1, cache.n_head, 1, cache.value_dim, dtype=cache.dtype), layer)
    return cache


@functools.cache
def measure_per_token() -> dict[str, int]:
    """Bytes per token of live caches: DeepSeek-V3's shapes (one token in a cache of its 61
    layers, the latent and rotary key as one head; then every head's key and value), and a model
    of the target's shape with V3's ratios (d_c = 4 hs, d_r = hs / 2) reading 10 tokens."""
    bf16, v = torch.bfloat16, V3
    latent = _one_token(KVCache(v["num_hidden_layers"], 1, 1, v["kv_lora_rank"]
                                + v["qk_rope_head_dim"], 1, value_dim=0, dtype=bf16))
    mha = _one_token(KVCache(v["num_hidden_layers"], 1, v["num_attention_heads"],
                             v["qk_nope_head_dim"] + v["qk_rope_head_dim"], 1,
                             value_dim=v["v_head_dim"], dtype=bf16))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12)
        model = GPT(GPTConfig.preset("target", **OURS)).to(bf16).eval()
    cache = KVCache.for_model(model, max_len=10)
    with torch.no_grad():
        model(torch.arange(10)[None], cache=cache)
    return {"deepseek_v3": latent.nbytes, "deepseek_v3_mha": mha.nbytes,
            "ours": cache.nbytes // 10}


def _byte_mistakes(key: str) -> list[tuple[int, str]]:
    """(bytes per token, hint): what each usual mistake predicts."""
    v = V3
    if key == "deepseek_v3":
        n, dc, dr, nh = v["num_hidden_layers"], v["kv_lora_rank"], v["qk_rope_head_dim"], 128
        return [(n * 2 * (dc + dr) * 2, P["k_and_v"]), (n * (dc + dr) * 4, P["fp32"]),
                (n * dc * 2, P["no_rope"]), (n * nh * (dc + dr) * 2, P["per_head"]),
                (n * (dc + nh * dr) * 2, P["rope_per_head"]),
                (n * (v["q_lora_rank"] + dc + dr) * 2, P["queries"]),
                (n * (dc + dr) * 16, P["bits"]), ((dc + dr) * 2, P["one_layer"])]
    if key == "deepseek_v3_mha":
        n, nh, k, val = (v["num_hidden_layers"], v["num_attention_heads"],
                         v["qk_nope_head_dim"] + v["qk_rope_head_dim"], v["v_head_dim"])
        return [(n * nh * (v["qk_nope_head_dim"] + val) * 2, P["mha_rope"]),
                (n * nh * k * 2, P["mha_no_v"]), (n * nh * 2 * 56 * 2, P["mha_hidden"]),
                (n * nh * (k + val) * 4, P["fp32"]), (nh * (k + val) * 2, P["one_layer"]),
                (n * nh * (k + val) * 16, P["bits"]), (n * 2 * (k + val) * 2, P["mha_kv_heads"])]
    n, dc, dr, nh = 12, OURS["kv_lora_rank"], OURS["qk_rope_head_dim"], 8
    return [(n * (dc + dr) * 4, P["ours_fp32"]), (n * 2 * (dc + dr) * 2, P["k_and_v"]),
            (n * dc * 2, P["ours_rope"]), (n * nh * (dc + dr) * 2, P["per_head"]),
            ((dc + dr) * 2, P["ours_layers"]), (n * (dc + nh * dr) * 2, P["rope_per_head"])]


@ck.one_thread
@ck.guarded
def check_predict_bytes_per_token(predict_bytes_per_token) -> None:
    """predict_bytes_per_token() -> {"deepseek_v3", "deepseek_v3_mha", "ours"}: bytes per
    token, against live caches (measure_per_token)."""
    name = "predict_bytes_per_token"
    case = "DeepSeek-V3's config as given, and the target's shape with V3's ratios, all in bf16"
    got = ck.predicted(name, case, ck.prediction(name, case, predict_bytes_per_token,
                                                 GPT.forward, KVCache.update, kv_cache_bytes),
                       BYTE_KEYS, P["dict"], P["int"])
    measured = measure_per_token()
    ck.as_measured(name, case, got, measured, _byte_mistakes, P["wrong"], P["otherwise"],
                   BYTE_LABELS.get)
    v3, ours = measured["deepseek_v3_mha"] / measured["deepseek_v3"], 9216 / measured["ours"]
    print(f"  measured: {measured['deepseek_v3']:,}, {measured['deepseek_v3_mha']:,} and "
          f"{measured['ours']:,} bytes per token; the latent saves {v3:.1f}x in DeepSeek-V3 "
          f"(128 heads) and {ours:.1f}x in a model of our 8 heads with the same ratios (against "
          f"the bf16 target's 9,216)")
    ck.passed(name, len(BYTE_KEYS))


# --- exercise 3 (debug): an H2O that scores along the wrong axis ------------------------------
class BuggyH2OCache(ScoredCache):
    """The notebook's broken H2O cache, verbatim: _record sums the attention weights over the
    keys axis, so every position gets the same score."""

    def __init__(self, model, heavy, recent):
        (n_layer, n_head, head_dim), shapes = self._shapes(model, 1)
        super().__init__(n_layer, n_head, head_dim, heavy + recent, **shapes)
        self.heavy, self.recent = heavy, recent
        self.scores = [torch.zeros(1, 0, device=self.device)] * n_layer  # attention received

    def _record(self, weights):
        """What a pass's attention gives each position; weights is (B, n_head, T, held + T)."""
        return weights.sum(dim=(1, 3))

    def _keep(self, layer, received):
        """Add this pass's scores; keep the `heavy` older positions with the most attention
        received so far, and the `recent` newest."""
        held = self.keys[layer].size(2)  # positions held before this pass, and its new ones
        old = self.scores[layer]
        scores = torch.cat([old, old.new_zeros(1, held - old.size(1))], dim=1) + received
        if held <= self.budget:
            self.scores[layer] = scores
            return None
        older = held - self.recent
        heavy = scores[:, :older].topk(self.heavy, dim=1).indices.sort(dim=1).values
        recent = torch.arange(older, held, device=self.device).expand(1, self.recent)
        keep = torch.cat([heavy, recent], dim=1)  # (1, heavy + recent) slots, increasing
        self.scores[layer] = scores.gather(1, keep)
        return keep


def _recording(record):
    return type("Mistake", (BuggyH2OCache,), {"_record": lambda self, w: record(w)})


class _NoHistory(BuggyH2OCache):
    def _record(self, weights):
        return weights.sum(dim=(1, 2))

    def _keep(self, layer, received):
        self.scores[layer] = self.scores[layer] * 0
        return super()._keep(layer, received)


H2O_MISTAKES = {  # hint -> a wrong fix, as a class
    HH["last_query"]: _recording(lambda w: w[:, :, -1].sum(1)),
    HH["max_queries"]: _recording(lambda w: w.amax(2).sum(1)),
    HH["mean_queries"]: _recording(lambda w: w.mean(2).sum(1)),
    HH["one_head"]: _recording(lambda w: w[:, 0].sum(1)),
    HH["no_history"]: _NoHistory,
}
# (what, model, heavy, recent, tokens, how): a prompt in one pass then decode steps, or every
# token in a pass of its own (H2O's own setting)
H2O_CASES = [("a random tiny model", 0, 4, 4, 22, "prefill"),
             ("a random tiny model", 0, 3, 5, 18, "streamed"),
             ("a random tiny model, heavy only", 1, 6, 1, 16, "prefill"),
             ("the shipped target, an 8-person question", None, 12, 12, None, "prefill"),
             ("the shipped target, an 8-person question", None, 12, 12, None, "streamed")]


@functools.cache
def _h2o_model(which):
    if which is None:
        return load_course_model("target", "cpu")
    return ck.tiny_model(120 + which, std=0.3), None


def _h2o_run(model, cache, ids, how):
    """[(logits of the pass's last token, kept positions per layer)] after every pass."""
    cuts = list(range(len(ids) + 1)) if how == "streamed" else (
        [0, len(ids) - 5] + list(range(len(ids) - 4, len(ids) + 1)))
    out = []
    for start, end in zip(cuts, cuts[1:]):
        logits = model(torch.tensor([ids[start:end]]), **through(cache))[0, -1]
        out.append((logits, cache.kept()))
    return out


def _record_shape(cls, model) -> tuple | None:
    """The shape of what cls._record returns for a probe (1, heads, 3, 5), if not (1, 5)."""
    probe = torch.softmax(torch.randn(1, model.config.kv_heads, 3, 5), dim=-1)
    bare = cls.__new__(cls)
    bare.score_dtype, bare._seen = torch.float32, 0
    try:
        got = cls._record(bare, probe)
    except Exception:  # noqa: BLE001 - its own failure shows in the case itself
        return None
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else None
    return None if shape == (1, 5) else shape


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_heavy_hitters(cache_class) -> None:
    """cache_class(model, heavy, recent), through the model's passes, against the engine's
    H2OCache: the logits of every pass and the positions each layer keeps."""
    name, same_as_buggy, steps = "heavy_hitters", True, 0
    ck.expect(isinstance(cache_class, type) and issubclass(cache_class, ScoredCache), name,
              "the class", "a ScoredCache subclass (of BuggyH2OCache)", cache_class, HH["class"])
    for what, which, heavy, recent, n, how in H2O_CASES:
        model, tok = _h2o_model(which)
        ids = (_question_ids(tok) if tok else
               [(31 * i * i + 7 * i + 3) % model.config.vocab_size for i in range(n)])
        case = (f"{what}, heavy={heavy}, recent={recent}, {len(ids)} tokens "
                + ("fed one per pass" if how == "streamed" else "(all but 5 in one pass, then "
                   "5 decode steps)"))
        mine = ck.call(name, case, cache_class, model, heavy, recent)
        with ck.forbid(name, H2OCache._record, H2OCache._keep):
            runs = ck.call_hinted(name, case, lambda e: HH["shape"].format(
                got=_record_shape(cache_class, model)) if _record_shape(cache_class, model)
                else "your cache raised in this case", _h2o_run, model, mine, ids, how)
        engine = _h2o_run(model, H2OCache.for_model(model, heavy, recent), ids, how)
        buggy = _h2o_run(model, BuggyH2OCache(model, heavy, recent), ids, how)
        for t, ((got, kept), (want, want_kept), (_, buggy_kept)) in enumerate(
                zip(runs, engine, buggy)):
            steps += 1
            where = f"{case}: after pass {t + 1}"
            as_buggy = kept == buggy_kept
            same_as_buggy &= as_buggy
            if kept != want_kept:
                layer = next(i for i, (a, b) in enumerate(zip(kept, want_kept)) if a != b)
                hint = HH["buggy"] + HH["symptom"] if as_buggy else _h2o_diagnose(
                    model, heavy, recent, ids, how, runs) or HH["kept"]
                ck.fail(name, f"{where}, layer {layer}", f"positions {want_kept[layer]}",
                        f"positions {kept[layer]}", hint)
            if not torch.allclose(got, want, atol=1e-4):
                ck.fail(name, where, "the engine's logits (max |Δ| < 1e-4)", f"max |Δ| = "
                        f"{float((got - want).abs().max()):.3g}", HH["logits"])
    ck.expect(not same_as_buggy, name, "every case", "a fixed cache", "BuggyH2OCache's positions",
              HH["buggy_everywhere"] + HH["symptom"])
    ck.passed(name, steps)


def _h2o_diagnose(model, heavy, recent, ids, how, runs) -> str:
    """The hint of the wrong fix that keeps what the learner's cache kept, pass for pass."""
    for hint, cls in H2O_MISTAKES.items():
        try:
            theirs = _h2o_run(model, cls(model, heavy, recent), ids, how)
        except Exception:  # noqa: BLE001 - a mistake that cannot run here explains nothing
            continue
        if [k for _, k in theirs] == [k for _, k in runs]:
            return hint
    return ""


# --- exercise 4 (design): a cache for a memory budget -------------------------------------------
OPTIONS = ("target", "target-gqa2", "target-mqa", "target-mla", "target-cla2", "window 24",
           "window 48", "h2o 24", "h2o 48", "snapkv 24", "snapkv 48")
DESIGN_PER_COUNT, DESIGN_SEED = 4, 12  # corpus.unseen_coin_flips(4, seed=12): 32 questions


def option_parts(option: str) -> tuple[str, str, int | None]:
    """("target-mla", "full", None) for a model, ("target", "h2o", 24) for a policy."""
    if option.startswith("target"):
        return option, "full", None
    policy, budget = option.split()
    return "target", policy, int(budget)


def design_questions() -> list:
    return corpus.unseen_coin_flips(DESIGN_PER_COUNT, seed=DESIGN_SEED)


@functools.cache
def reference_table() -> dict[str, tuple[int, float]]:
    """{option: (K/V bytes held after reading the longest question, share answered)}."""
    qs = design_questions()
    table = {}
    for option in OPTIONS:
        model_name, policy, budget = option_parts(option)
        model, tok = load_course_model(model_name, "cpu")
        longest = max(qs, key=lambda q: len(tok.encode(q.prompt())))
        cache = make_cache(policy, model, budget)
        with torch.no_grad():
            read(model, torch.tensor([tok.encode(longest.prompt())]), cache)
        acc = eviction_accuracy(model, tok, budgets=(budget or 24,), policies=(policy,),
                                questions=qs)[policy, budget]
        table[option] = (cache.nbytes, sum(acc.values()) / len(acc))  # equal counts per people
    return table


def _design_lengths() -> tuple[int, float]:
    tok = load_course_model("target", "cpu")[1]
    lengths = [len(tok.encode(q.prompt())) for q in design_questions()]
    return max(lengths), sum(lengths) / len(lengths)


BYTES_MISTAKES = ("per_token", "mean_length", "evicts", "snapkv_decode", "bf16")


def _bytes_mistakes() -> dict[str, dict[str, int]]:
    """hint -> the bytes column a usual mistake gives."""
    table, (longest, mean) = reference_table(), _design_lengths()
    per_position = {o: kv_cache_bytes(load_course_model(option_parts(o)[0], "cpu")[0].config, 1,
                                      dtype=torch.float32) for o in OPTIONS}
    right = {o: b for o, (b, _) in table.items()}
    policy = {o for o in OPTIONS if not o.startswith("target")}
    return {
        C["per_token"]: {o: right[o] // longest for o in OPTIONS},
        C["mean_length"]: {o: right[o] if o in policy else round(per_position[o] * mean)
                           for o in OPTIONS},
        C["evicts"]: {o: per_position[o] * longest for o in OPTIONS},
        C["snapkv_decode"]: {o: right[o] - per_position[o] if o.startswith("snapkv") else right[o]
                             for o in OPTIONS},
        C["bf16"]: {o: right[o] // 2 for o in OPTIONS},
    }


def _table(got) -> dict[str, tuple[int, float]]:
    """The contract: {option: (int bytes, accuracy in [0, 1])} for every option."""
    if not isinstance(got, dict) or set(got) != set(OPTIONS):
        raise ck.Refused(C["not_a_dict"], f"a dict with the keys {list(OPTIONS)}")
    out = {}
    for option, entry in got.items():
        pair = entry if isinstance(entry, (tuple, list)) and len(entry) == 2 else None
        if pair is None or ck.as_int(pair[0]) is None or not isinstance(
                pair[1], (int, float)) or isinstance(pair[1], bool):
            raise ck.Refused(C["not_a_pair"], "(bytes, accuracy) for every option")
        if pair[1] > 1 and pair[1] <= 100:
            raise ck.Refused(C["percent"], "accuracy as a fraction between 0 and 1")
        out[option] = (ck.as_int(pair[0]), float(pair[1]))
    return out


def best_choice(budget: int, table: dict) -> str | None:
    """The most accurate option that fits the budget (ties: fewer bytes), or None."""
    fits = [o for o in table if table[o][0] <= budget]
    return max(fits, key=lambda o: (table[o][1], -table[o][0])) if fits else None


CHOOSE_MISTAKES = {  # hint key -> a wrong choose_cache
    "over_budget": lambda budget, table: max(table, key=lambda o: table[o][1]),
    "smallest": lambda budget, table: min((o for o in table if table[o][0] <= budget),
                                          key=lambda o: table[o][0], default=None),
    "strict": lambda budget, table: best_choice(budget - 1, table),
    "none_fits": lambda budget, table: best_choice(budget, table) or min(
        table, key=lambda o: table[o][0]),
    "tie": lambda budget, table: max((o for o in table if table[o][0] <= budget),
                                     key=lambda o: (table[o][1], table[o][0]), default=None),
}
SYNTHETIC = {  # a table with ties and a boundary, the same on every machine
    "target": (2_400_000, 0.97), "target-gqa2": (600_000, 0.60), "target-mqa": (300_000, 0.50),
    "target-mla": (300_000, 0.95), "target-cla2": (1_200_000, 0.60),
    "window 24": (442_368, 0.72), "window 48": (884_736, 0.92), "h2o 24": (442_368, 0.81),
    "h2o 48": (884_736, 0.95), "snapkv 24": (460_800, 0.84), "snapkv 48": (903_168, 0.97)}


def _design_budgets(table) -> list[int]:
    """Budgets that tell the usual mistakes apart: exactly what an option holds, one byte less
    than the smallest, and a few in between."""
    small = min(b for b, _ in table.values())
    return sorted({10 ** 8, table["target"][0], table["target-mla"][0], small - 1,
                   table["h2o 48"][0], (table["target-mla"][0] + table["window 24"][0]) // 2},
                  reverse=True)


@ck.one_thread
@ck.guarded
@torch.no_grad()
def check_choose_cache(cache_table, choose_cache) -> None:
    """cache_table() -> {option: (bytes, accuracy)}, against reference_table(); then
    choose_cache(budget, table) -> an option or None, on the reference table and on SYNTHETIC."""
    name = "choose_cache"
    case = (f"cache_table(): every option on corpus.unseen_coin_flips({DESIGN_PER_COUNT}, "
            f"seed={DESIGN_SEED}), fp32")
    table = ck.obeyed(name, case, _table, ck.call(name, case, cache_table),
                      expected="{option: (bytes, accuracy)} for every option")
    want = reference_table()
    wrong = [o for o in OPTIONS if table[o][0] != want[o][0]]
    if wrong:
        mine = {o: b for o, (b, _) in table.items()}
        hint = next((h for h, column in _bytes_mistakes().items()
                     if column[wrong[0]] == mine[wrong[0]]), C["bytes_otherwise"])
        ck.fail(name, f"{case}: the bytes of {wrong[0]!r}", want[wrong[0]][0],
                table[wrong[0]][0], hint)
    one = 1 / (DESIGN_PER_COUNT * 8)
    off = [o for o in OPTIONS if abs(table[o][1] - want[o][1]) > one + 1e-9]
    if off:
        ck.fail(name, f"{case}: the accuracy of {off[0]!r}", f"{want[off[0]][1]:.4f} (within "
                f"one question)", table[off[0]][1], C["accuracy"])
    n = 0
    for which, given in (("the measured table", want), ("a made-up table", SYNTHETIC)):
        for budget in _design_budgets(given):
            n += 1
            where = f"choose_cache({budget:,}, {which})"
            got = ck.call(name, where, choose_cache, budget, dict(given))
            right = best_choice(budget, given)
            if got is not None and got not in OPTIONS:
                ck.fail(name, where, right, got, C["not_an_option"])
            alike = [o for o in OPTIONS if given[o] == given.get(right)] if right else [None]
            if got in alike:
                continue
            if got is not None and given[got][0] > budget:
                hint = C["over_budget"].format(got=got, bytes=given[got][0], budget=budget) + (
                    f"; {C['none_fits']}" if right is None else "")
            else:
                key = next((k for k in ("smallest", "strict", "tie")
                            if CHOOSE_MISTAKES[k](budget, given) == got), "not_best")
                hint = C[key].format(want=right, want_acc=given[right][1],
                                     got_acc=given[got][1] if got else 0.0)
            ck.fail(name, where, right, got, hint)
    ck.passed(name, 1 + n)
