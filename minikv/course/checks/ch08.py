"""Checkers for chapter 08 (a modern model: what rotary positions change for the cache), each
against the engine's RoPE (minikv/engine/rope.py) or target-rope, in a few CPU seconds, from data
(the recipe in __init__.py): rope_key (turn a key by hand), move_key (move a turned key to another
position without its input), decode_one_head (debug: a cache that holds keys before their turn),
predict_reindexed (predict, then measure: which answers a window's re-indexed numbering
changes, measured on target-rope) and choose_long_window (design: sinks, a window, a numbering and
θ for texts 4x the trained length under a memory budget, against the engine's SinkWindowCache).
"""
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
from . import Exercise, as_int, call, expect, fail, guarded, integer, passed, tensor

THETA = 10000.0


def _vector(seed: int, hs: int) -> torch.Tensor:
    return torch.randn(hs, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # angles of a few hundred radians carry float32 rounding of ~1e-5: far below any mistake's
    return torch.allclose(got.double(), want.double(), atol=1e-3, rtol=1e-3)


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


ROPE_KEY = Exercise(
    "rope_key",
    cases=[(_vector(1, 8), 1, THETA), (_vector(2, 16), 5, THETA), (_vector(3, 24), 37, THETA),
           (_vector(4, 16), 0, THETA), (_vector(5, 32), 250, 500.0), (_vector(6, 8), 3, 100.0)],
    describe=lambda k, position, theta: (f"a key of {k.shape[-1]} numbers at position "
                                         f"{position}, theta={theta:g}"),
    reference=_rope_reference,
    returns=tensor("return the turned key: a tensor of the key's shape",
                   shape=lambda k, position, theta: tuple(k.shape)),
    same=_close,
    mistakes={
        "you paired neighbours (k[2i], k[2i+1]), GPT-J's layout; Llama's, the engine's and "
        "Hugging Face's pairs number i with number i + hs/2 (the first half with the second)":
            _adjacent_pairs,
        "pair i turns by position × theta^(-2i/hs): the exponent has a 2 (the pairs are "
        "numbered 0 .. hs/2 - 1 and the exponent runs over the even numbers 0 .. hs - 2)":
            lambda k, position, theta: rope_key_by_hand(k, position, theta ** 0.5),
        "you turned the wrong way (a minus on the other sine): the first half is "
        "x cos - y sin and the second x sin + y cos":
            lambda k, position, theta: rope_key_by_hand(k, -position, theta),
        "you turned by position + 1: the first token is position 0, and is not turned at all":
            lambda k, position, theta: rope_key_by_hand(k, position + 1, theta),
    },
    otherwise="for each pair i < hs/2, angle = position × theta^(-2i/hs); then "
              "(x, y) = (k[i], k[i + hs/2]) becomes (x cos - y sin, x sin + y cos)",
    forbid=(rope_angles, rotate, turn),
    unchanged="turn a copy (torch.cat makes a new tensor): the key you were given is the "
              "cache's own, and others read it",
    solution=rope_key_by_hand,
)
check_rope_key = ROPE_KEY.check


# --- exercise 2: move a turned key to another position -----------------------------------------

def move_key_by_hand(k_turned: torch.Tensor, old: int, new: int, theta: float) -> torch.Tensor:
    """The solution: a turn by d after a turn by old is a turn by old + d."""
    return rope_key_by_hand(k_turned, new - old, theta)


def _move_case(seed: int, hs: int, old: int, new: int, theta: float = THETA) -> tuple:
    raw = _vector(seed, hs)
    return _rope_reference(raw, old, theta), old, new, theta


MOVE_CASES = [_move_case(1, 16, 40, 8), _move_case(2, 8, 5, 9), _move_case(3, 24, 100, 20),
              _move_case(4, 16, 7, 7), _move_case(5, 32, 30, 0, 500.0)]


def _moved_reference(k_turned, old, new, theta):
    return _rope_reference(k_turned, new - old, theta)


MOVE_KEY = Exercise(
    "move_key",
    cases=MOVE_CASES,
    describe=lambda k, old, new, theta: (f"a key of {k.shape[-1]} numbers turned for position "
                                         f"{old}, moved to {new}, theta={theta:g}"),
    reference=_moved_reference,
    returns=tensor("return the moved key: a tensor of the key's shape",
                   shape=lambda k, old, new, theta: tuple(k.shape)),
    same=_close,
    mistakes={
        "you turned it by the new position, but the key is already turned by the old one and "
        "turns add up: turn it by new - old":
            lambda k, old, new, theta: rope_key_by_hand(k, new, theta),
        "you turned it by old - new, the wrong way: to move a key from old to new, turn it by "
        "new - old (negative when it moves to an earlier position)":
            lambda k, old, new, theta: rope_key_by_hand(k, old - new, theta),
        "you turned it back to position 0 (by -old) and stopped: then turn it on to the new "
        "position, or do both at once with new - old":
            lambda k, old, new, theta: rope_key_by_hand(k, -old, theta),
    },
    otherwise="a turn by d after a turn by old is a turn by old + d: turn the key by new - old",
    forbid=(rope_angles, rotate, turn),
    unchanged="turn a copy: the key you were given is the cache's own",
    solution=move_key_by_hand,
)
check_move_key = MOVE_KEY.check


# --- exercise 3 (debug): one head decoding through a cache of unturned keys --------------------

def _decode(q_raw, k_raw, v, theta, turn_when_cached: bool, turn_when_read: bool):
    """One head decoded one token per step through a cache of lists; each key turned by its
    own position when cached, and/or every cached key by the newest position when read."""
    keys, values, out = [], [], []
    for t in range(q_raw.shape[0]):
        keys.append(_turned_by(k_raw[t], t, theta) if turn_when_cached else k_raw[t])
        values.append(v[t])
        K = torch.stack(keys)
        K = _turned_by(K, t, theta) if turn_when_read else K
        q = _turned_by(q_raw[t], t, theta)
        out.append((K @ q / math.sqrt(q.shape[-1])).softmax(-1) @ torch.stack(values))
    return torch.stack(out)


def decode_buggy(q_raw, k_raw, v, theta):
    """The notebook's broken decoder: each key cached as made, every cached key turned by the
    newest token's position."""
    return _decode(q_raw, k_raw, v, theta, turn_when_cached=False, turn_when_read=True)


def decode_fixed(q_raw, k_raw, v, theta):
    """The fix: each key is turned once, by its own position, when it is cached."""
    return _decode(q_raw, k_raw, v, theta, turn_when_cached=True, turn_when_read=False)


def _turned_by(x, position, theta):
    rows = x if x.dim() == 2 else x[None]
    by = torch.full((rows.shape[0],), position)
    return turn(rows[None, None], by, theta)[0, 0].reshape(x.shape)


def _attention_reference(q_raw, k_raw, v, theta):
    """One full causal pass with q and k turned by their positions (the engine's model)."""
    at = torch.arange(q_raw.shape[0])
    q, k = (turn(x[None, None], at, theta) for x in (q_raw, k_raw))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v[None, None],
                                                            is_causal=True)[0, 0]


def _turned_twice(q_raw, k_raw, v, theta):
    return _decode(q_raw, k_raw, v, theta, turn_when_cached=True, turn_when_read=True)


def _head_case(seed: int, T: int, hs: int, theta: float = THETA) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hs, generator=g) * 2, torch.randn(T, hs, generator=g) * 2,
            torch.randn(T, hs, generator=g), theta)


DECODE = Exercise(
    "decode_one_head",
    cases=[_head_case(1, 6, 8), _head_case(2, 12, 16), _head_case(3, 9, 24, 500.0)],
    describe=lambda q, k, v, theta: (f"{q.shape[0]} tokens of one head, head_dim "
                                     f"{q.shape[1]}, theta={theta:g}"),
    reference=_attention_reference,
    returns=tensor("return the outputs, a (T, head_dim) tensor",
                   shape=lambda q, k, v, theta: tuple(v.shape)),
    same=_close,
    mistakes={
        "this is the bug: every cached key is turned by the newest token's position, so each "
        "looks 0 positions away from the query and the scores forget where each word was; turn "
        "a key once, by its own position, when it goes into the cache":
            decode_buggy,
        "the scores depend on each key's own position, not on its distance to the query: "
        "either a cached key is turned twice (by its position, then by the newest token's), or "
        "the query is not turned (the two give the same scores); a cached key already holds its "
        "turn, so read it as it is, and turn the query by its own position":
            _turned_twice,
    },
    otherwise="turn each key by its own position once, when it is cached; turn the query by "
              "its position; then softmax(K q / sqrt(head_dim)) over every cached key",
    unchanged="leave q_raw, k_raw and v as given: build the cache in lists of your own",
    solution=decode_fixed,
)
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


def predict_by_hand(lengths: list[int], sinks: int, window: int) -> int:
    """The solution: the answer is read at position L - 1, which sits at slot
    min(L - 1, sinks + window); the sinks are seen from that slot, so nothing moves until the
    text is longer than sinks + window + 1 tokens, and with no sinks nothing at all."""
    return sum(L - 1 > sinks + window for L in lengths) if sinks else 0


REINDEX_CASES = [(4, 19), (4, 47), (0, 16), (2, 62), (4, 120)]

PREDICT = Exercise(
    "predict_reindexed",
    cases=[(LENGTHS, sinks, window) for sinks, window in REINDEX_CASES],
    describe=lambda lengths, sinks, window: (f"the {len(lengths)} questions through {sinks} "
                                             f"sinks and a window of {window}"),
    reference=lambda lengths, sinks, window: measure_reindexed(sinks, window),
    returns=integer("return one int: how many of the questions' answer logits change"),
    explain=lambda lengths, sinks, window: (
        f"measured: the answer logits of {measure_reindexed(sinks, window)} of the "
        f"{len(lengths)} questions change"),
    mistakes={
        "off by one: a query at position t sits at slot min(t, sinks + window), because the "
        "window holds `window` positions and the new token comes on top; a question of L "
        "tokens reads its answer at position L - 1":
            lambda lengths, sinks, window: (sum(L > sinks + window for L in lengths)
                                            if sinks else 0),
        "off by one the other way: the answer is read at position L - 1 (the first token is "
        "position 0), and it moves to another slot only when L - 1 > sinks + window":
            lambda lengths, sinks, window: (sum(L - 2 > sinks + window for L in lengths)
                                            if sinks else 0),
        "the sinks count: the cache holds sinks + window positions (and the new token) before "
        "anything is evicted, so a question changes only when longer than that":
            lambda lengths, sinks, window: (sum(L - 1 > window for L in lengths)
                                            if sinks else 0),
        "with no sinks, every held key is a window key, and a window key slides down its slots "
        "together with the query: each distance stays true, and nothing changes":
            lambda lengths, sinks, window: sum(L - 1 > sinks + window for L in lengths),
    },
    otherwise="a question changes when its answer's query, at position L - 1, no longer sits at "
              "its true position: that is when L - 1 > sinks + window, and only if there are "
              "sinks to see from the wrong distance",
    forbid=(GPT.forward, feed),
    solution=predict_by_hand,
)
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


LW = {
    "dict": "return a dict with the keys sinks, window, rope ('true', 'reindex' or 'rerotate') "
            "and rope_theta",
    "too_big": "over the budget: the cache holds sinks + window positions, {per:,} bytes each "
               "(12 layers × K and V × 8 heads × 24 numbers × 4 bytes): {slots} fit",
    "true": "at true positions the sinks stay at their true distance, up to {far:,} positions "
            "from the newest token, far past the {trained} the model was trained on (section 5: "
            "the loss rises from there); number by slot ('reindex' or 'rerotate')",
    "too_wide": "numbered by slot, the farthest distance is sinks + window ({far} here), past the "
                "largest distance training showed ({top}): keep sinks + window at most {top}, "
                "even when the budget pays for more",
    "theta": "the window numbered by slot shows only trained distances: keep the trained "
             "rope_theta ({theta:g}); a scaled θ (NTK) turns every pair by angles training "
             "never showed, for a full cache read past its length, not for a window",
    "no_sinks": "keep a few sinks: a trained model parks attention on the first tokens "
                "(chapter 07)",
    "wasted": "the budget pays for {slots} positions and the trained distances allow {top}: "
              "a longer window only helps, hold {want}",
}


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
