"""Checkers for chapter 08 (a modern model: what rotary positions change for the cache), against
the engine's RoPE (minikv/engine/rope.py), target-rope and its SinkWindowCache, in a few CPU
seconds: rope_key (turn a key by hand), move_key (move a turned key without its input),
decode_one_head (debug: a cache that holds keys before their turn) and predict_reindexed (predict,
then measure, on target-rope) are tables; choose_long_window (design: a window for texts 4x the
trained length under a memory budget) is code. The hints are in hints/ch08.toml."""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ...engine import GPT, kv_cache_bytes
from ...engine.attention import window_attention
from ...engine.rope import rope_angles, rotate, turn
from ...engine.window import SinkWindowCache, feed
from ..checkpoint import load_course_model
from ..corpus import coin_flip_eval
from ..tokenizer import load_tokenizer
from . import (
    Exercise,
    as_int,
    call,
    expect,
    fail,
    guarded,
    hints,
    integer,
    named,
    parts,
    passed,
    tensor,
)

H = hints("ch08")
THETA = 10000.0
ROPE = (rope_angles, rotate, turn)  # the engine's RoPE: the exercises write it


def _vector(seed: int, hs: int) -> torch.Tensor:
    return torch.randn(hs, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # angles of a few hundred radians carry float32 rounding of ~1e-5: far below any mistake's
    return torch.allclose(got.double(), want.double(), atol=1e-3, rtol=1e-3)


def _shaped(hint: str):  # the contract: a tensor shaped like the first argument (a key, q_raw)
    return tensor(hint, shape=lambda first, *rest: tuple(first.shape))


# --- exercise 1: turn a key by its position, by hand ------------------------------------------

def rope_key_by_hand(k: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """The solution, as a student writes it: pair i is (k[i], k[i + hs/2])."""
    half = k.shape[-1] // 2
    angle = position * theta ** (-2 * torch.arange(half) / k.shape[-1])
    x, y = k[:half], k[half:]
    return torch.cat([x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos()])


def _rope_reference(k: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    cos, sin = rope_angles(torch.tensor([position]), k.shape[-1], theta)
    return rotate(k.view(1, 1, 1, -1), cos, sin).view(-1)


def _adjacent_pairs(k, position, theta):
    angle = position * theta ** (-2 * torch.arange(k.shape[-1] // 2) / k.shape[-1])
    x, y = k[0::2], k[1::2]
    out = torch.empty_like(k)
    out[0::2], out[1::2] = x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos()
    return out


R = H["rope_key"]
ROPE_KEY = Exercise(
    "rope_key",
    cases=[(_vector(1, 8), 1, THETA), (_vector(2, 16), 5, THETA), (_vector(3, 24), 37, THETA),
           (_vector(4, 16), 0, THETA), (_vector(5, 32), 250, 500.0), (_vector(6, 8), 3, 100.0)],
    describe=lambda k, position, theta: (f"a key of {k.shape[-1]} numbers at position "
                                         f"{position}, theta={theta:g}"),
    reference=_rope_reference,
    returns=_shaped(R["returns"]),
    same=_close,
    mistakes=named(R, adjacent=_adjacent_pairs,
                   exponent=lambda k, at, theta: rope_key_by_hand(k, at, theta ** 0.5),
                   wrong_way=lambda k, at, theta: rope_key_by_hand(k, -at, theta),
                   plus_one=lambda k, at, theta: rope_key_by_hand(k, at + 1, theta)),
    otherwise=R["otherwise"], forbid=ROPE, unchanged=R["unchanged"], solution=rope_key_by_hand)
check_rope_key = ROPE_KEY.check


# --- exercise 2: move a turned key to another position -----------------------------------------

def move_key_by_hand(k_turned: torch.Tensor, old: int, new: int, theta: float) -> torch.Tensor:
    """The solution: a turn by d after a turn by old is a turn by old + d."""
    return rope_key_by_hand(k_turned, new - old, theta)


def _move_case(seed: int, hs: int, old: int, new: int, theta: float = THETA) -> tuple:
    return _rope_reference(_vector(seed, hs), old, theta), old, new, theta


M = H["move_key"]
MOVE_KEY = Exercise(
    "move_key",
    cases=[_move_case(1, 16, 40, 8), _move_case(2, 8, 5, 9), _move_case(3, 24, 100, 20),
           _move_case(4, 16, 7, 7), _move_case(5, 32, 30, 0, 500.0)],
    describe=lambda k, old, new, theta: (f"a key of {k.shape[-1]} numbers turned for position "
                                         f"{old}, moved to {new}, theta={theta:g}"),
    reference=lambda k, old, new, theta: _rope_reference(k, new - old, theta),
    returns=_shaped(M["returns"]),
    same=_close,
    mistakes=named(M, new_only=lambda k, old, new, theta: rope_key_by_hand(k, new, theta),
                   backwards=lambda k, old, new, theta: rope_key_by_hand(k, old - new, theta),
                   to_zero=lambda k, old, new, theta: rope_key_by_hand(k, -old, theta)),
    otherwise=M["otherwise"], forbid=ROPE, unchanged=M["unchanged"], solution=move_key_by_hand)
check_move_key = MOVE_KEY.check


# --- exercise 3 (debug): one head decoding through a cache of unturned keys --------------------

def decode_fixed(q_raw, k_raw, v, theta, when_cached: bool = True, when_read: str = ""):
    """The fix: each key is turned once, by its own position, when it is cached; the outputs and
    the keys as the cache holds them. The knobs give the mistakes: when_read="newest" turns every
    cached key by the newest position as it is read (the notebook's bug), "own" by its own
    position as it is read (the right outputs, from a cache that holds keys before their turn)."""
    keys, values, out = [], [], []
    for t in range(q_raw.shape[0]):
        keys.append(_turned_by(k_raw[t], t, theta) if when_cached else k_raw[t])
        values.append(v[t])
        K = torch.stack(keys)
        if when_read == "newest":
            K = _turned_by(K, t, theta)
        elif when_read == "own":
            K = turn(K[None, None], torch.arange(t + 1), theta)[0, 0]
        q = _turned_by(q_raw[t], t, theta)
        out.append((K @ q / math.sqrt(q.shape[-1])).softmax(-1) @ torch.stack(values))
    return torch.stack(out), torch.stack(keys)


def _turned_by(x, position, theta):
    rows = x if x.dim() == 2 else x[None]
    by = torch.full((rows.shape[0],), position)
    return turn(rows[None, None], by, theta)[0, 0].reshape(x.shape)


def _attention_reference(q_raw, k_raw, v, theta):
    """One full causal pass with q and k turned by their positions (the engine's model), and the
    keys turned, as the engine's cache holds them."""
    at = torch.arange(q_raw.shape[0])
    q, k = (turn(x[None, None], at, theta) for x in (q_raw, k_raw))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v[None, None], is_causal=True)
    return out[0, 0], k[0, 0]


def _head_case(seed: int, T: int, hs: int, theta: float = THETA) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hs, generator=g) * 2, torch.randn(T, hs, generator=g) * 2,
            torch.randn(T, hs, generator=g), theta)


D = H["decode_one_head"]
DECODE = Exercise(
    "decode_one_head",
    cases=[_head_case(1, 6, 8), _head_case(2, 12, 16), _head_case(3, 9, 24, 500.0)],
    describe=lambda q, k, v, theta: (f"{q.shape[0]} tokens of one head, head_dim "
                                     f"{q.shape[1]}, theta={theta:g}"),
    reference=_attention_reference,
    returns=parts(D["returns"], _shaped(D["returns"]), _shaped(D["returns"])),
    same=lambda got, want: all(_close(g, w) for g, w in zip(got, want)),
    mistakes=named(D, bug=lambda *case: decode_fixed(*case, False, "newest"),
                   twice=lambda *case: decode_fixed(*case, when_read="newest"),
                   read_time=lambda *case: decode_fixed(*case, False, "own")),
    otherwise=D["otherwise"], unchanged=D["unchanged"], solution=decode_fixed)
check_decode_one_head = DECODE.check


# --- exercise 4: predict, then measure: which answers re-indexing changes ----------------------

QUESTIONS_PER_COUNT = 3  # the held-out plain questions, 1 to 8 people: 24 questions
# the held-out questions' prompts as the notebook makes them (a tokenizer, no model: quick)
PROMPTS = [load_tokenizer().encode(q.prompt()) for q in coin_flip_eval(QUESTIONS_PER_COUNT)]
LENGTHS = [len(ids) for ids in PROMPTS]  # the questions' lengths in tokens, given to the learner


@lru_cache(maxsize=None)
def measure_reindexed(sinks: int, window: int) -> int:
    """How many of the questions' answer logits differ (by more than 1e-3; a changed one moves by
    far more) when target-rope reads each in one pass through sinks and a window, positions true
    and re-indexed by slot (window_attention, tested equal to SinkWindowCache's numberings)."""
    model, _ = load_course_model("target-rope", "cpu")
    changed = 0
    with torch.inference_mode():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            true, slot = (model(x, last_only=True, attention=window_attention(sinks, window, r))
                          [0, -1] for r in (None, model.config.rope_theta))
            changed += bool((true - slot).abs().max() > 1e-3)
    return changed


def predict_by_hand(lengths: list[int], sinks: int, window: int, last: int = 1,
                    sinkless: bool = False) -> int:
    """The solution: the answer is read at position L - 1, which sits at slot
    min(L - 1, sinks + window); the sinks are seen from that slot, so nothing moves until the
    text is longer than sinks + window + 1 tokens, and with no sinks nothing at all. (`last` and
    `sinkless` give the usual mistakes: the answer read at L - last, a change without sinks.)"""
    return sum(L - last > sinks + window for L in lengths) if sinks or sinkless else 0


P = H["predict_reindexed"]
PREDICT = Exercise(
    "predict_reindexed",
    cases=[(LENGTHS, sinks, window) for sinks, window in [(4, 19), (4, 47), (0, 16), (2, 62),
                                                          (4, 120)]],
    describe=lambda lengths, sinks, window: (f"the {len(lengths)} questions through {sinks} "
                                             f"sinks and a window of {window}"),
    reference=lambda lengths, sinks, window: measure_reindexed(sinks, window),
    returns=integer(P["returns"]),
    explain=lambda lengths, sinks, window: (
        f"measured: the answer logits of {measure_reindexed(sinks, window)} of the "
        f"{len(lengths)} questions change"),
    mistakes=named(P, off_by_one=lambda lengths, s, w: predict_by_hand(lengths, s, w, last=0),
                   other_way=lambda lengths, s, w: predict_by_hand(lengths, s, w, last=2),
                   sinks_count=lambda lengths, s, w: predict_by_hand(lengths, s, w - s),
                   no_sinks=lambda lengths, s, w: predict_by_hand(lengths, s, w, sinkless=True)),
    otherwise=P["otherwise"], forbid=(GPT.forward, feed), solution=predict_by_hand)
check_predict_reindexed = PREDICT.check

# --- exercise 5 (design): a window for a text 4x the trained length, under a memory budget --------
# target-rope, trained on 256 positions, must read texts of CONTEXT tokens with at most `budget`
# bytes of fp32 K/V per sequence: the learner picks sinks, a window, a numbering and a rope_theta.
# Graded against the engine: the bytes by kv_cache_bytes, the distances a query meets by driving a
# SinkWindowCache of that numbering through CONTEXT tokens.
CONTEXT, TRAINED = 1024, 256
LONG_BUDGETS = (1_000_000, 3_000_000, 8_000_000, 15_000_000)


@lru_cache(maxsize=None)
def _rope_config():
    model, _ = load_course_model("target-rope", "cpu")
    return model.config


def window_bytes(sinks: int, window: int) -> int:
    """Bytes of fp32 K/V the cache holds once full: sinks + window positions of target-rope."""
    return kv_cache_bytes(_rope_config(), sinks + window, dtype=torch.float32)


@lru_cache(maxsize=None)
def farthest_distance(sinks: int, window: int, rope: str) -> int:
    """The largest distance from a new token to a key it reads, over CONTEXT tokens through a
    SinkWindowCache(sinks, window, rope=...), measured by driving the engine's cache (its
    positions, or its slots when it numbers by slot) a token at a time."""
    cfg = _rope_config()
    cache = SinkWindowCache(1, 1, 2, sinks, window, block_size=CONTEXT, rope=rope,
                            rope_theta=cfg.rope_theta)
    x, farthest = torch.zeros(1, 1, 1, 2), 0
    for _ in range(CONTEXT):
        at = cache.get_seq_length()                # the new token's position, as numbered
        held = cache.positions if rope == "true" else range(len(cache.positions))
        farthest = max([farthest, *(at - p for p in held)])
        cache.update(x, x, 0)
    return farthest


def choose_long_window_by_hand(budget: int) -> dict:
    """The solution: number by slot, so no distance exceeds sinks + window; hold what the budget
    pays for, but no more than the trained distances allow; keep θ (the distances are trained)."""
    per = 12 * 2 * 8 * 24 * 4
    held = min(budget // per, TRAINED - 1)
    return {"sinks": 4, "window": held - 4, "rope": "reindex", "rope_theta": 10000.0}


LW = H["choose_long_window"]


@guarded
def check_choose_long_window(choose_long_window) -> None:
    """choose_long_window(budget) -> {sinks, window, rope, rope_theta}: fits the budget, meets
    no distance beyond the trained ones, keeps θ, holds what budget and training allow."""
    name, cfg = "choose_long_window", _rope_config()
    per, top = window_bytes(0, 1), TRAINED - 1
    for budget in LONG_BUDGETS:
        case = (f"target-rope (trained on {TRAINED} positions) reading {CONTEXT}-token texts, "
                f"{budget:,} bytes of fp32 K/V per sequence")
        got = call(name, case, choose_long_window, budget)
        keys = ("sinks", "window", "rope", "rope_theta")
        ok = isinstance(got, dict) and sorted(got) == sorted(keys)
        sinks, window = (as_int(got.get(k)) if ok else None for k in ("sinks", "window"))
        theta = got.get("rope_theta") if ok else None
        expect(ok and sinks is not None and window is not None and sinks >= 0 and window >= 1
               and got["rope"] in ("true", "reindex", "rerotate")
               and isinstance(theta, (int, float)) and not isinstance(theta, bool), name, case,
               "{'sinks': int, 'window': int, 'rope': 'reindex', 'rope_theta': float}", got,
               LW["dict"])
        slots = budget // per
        held = window_bytes(sinks, window)
        expect(held <= budget, name, case, f"at most {budget:,} bytes", f"{held:,} bytes for "
               f"{sinks} + {window} positions", LW["too_big"].format(per=per, slots=slots))
        expect(sinks >= 1, name, case, "a few sinks", sinks, LW["no_sinks"])
        far = farthest_distance(sinks, window, got["rope"])
        if far > top:
            fail(name, case, f"no distance beyond {top}", f"distances up to {far:,}",
                 LW["true" if got["rope"] == "true" else "too_wide"].format(
                     far=far, trained=TRAINED, top=top))
        expect(float(theta) == cfg.rope_theta, name, case, f"rope_theta={cfg.rope_theta:g}",
               theta, LW["theta"].format(theta=cfg.rope_theta))
        want = min(slots, top)
        expect(sinks + window >= want, name, case, f"sinks + window = {want}",
               f"{sinks} + {window} = {sinks + window}",
               LW["wasted"].format(slots=slots, top=top, want=want))
    passed(name, len(LONG_BUDGETS))


EXERCISES = (ROPE_KEY, MOVE_KEY, DECODE, PREDICT)
