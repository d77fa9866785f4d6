"""What the engine records about its own work: trace events for the widgets, counters for stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TraceEvent:
    """One forward pass (or cache operation) of a decoder, as the widgets and figures draw it."""
    step: int
    kind: str                    # "recompute" (naive), "prefill", "decode", ...
    input_ids: tuple[int, ...]   # token ids fed to the model in this pass
    positions: tuple[int, ...]   # position ids they were given
    cache_len_before: int        # cached positions before the pass (0 without a cache)
    cache_len_after: int
    kv_computed: int             # K/V vectors computed per layer in this pass, as counted by KVCounter
    token: int | None = None     # token chosen from this pass's last logits
    detail: dict = field(default_factory=dict)


@dataclass
class Stats:
    prompt_len: int = 0
    new_tokens: int = 0
    forward_passes: int = 0
    positions_processed: int = 0  # token positions pushed through the model, summed over passes
    kv_computed: int = 0          # K/V vectors computed per layer (every layer computes the same number)

    @property
    def kv_per_new_token(self) -> float:
        return self.kv_computed / max(self.new_tokens, 1)


class KVCounter:
    """Counts K/V vectors the model actually computes, per layer, with hooks on each Q/K/V projection.

    Every row out of a layer's `c_attn` is one position's new query, key and value, so the rows
    counted are exactly the K/V work done, with or without a cache.
    """

    def __init__(self, model: torch.nn.Module):
        self._blocks = list(model.transformer.h)
        self.per_layer = [0] * len(self._blocks)
        self._handles: list = []

    def _hook(self, layer_idx: int):
        def count(module, inputs, output):
            self.per_layer[layer_idx] += output.shape[0] * output.shape[1]  # B * T rows
        return count

    def __enter__(self) -> "KVCounter":
        self._handles = [b.attn.c_attn.register_forward_hook(self._hook(i)) for i, b in enumerate(self._blocks)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    @property
    def count(self) -> int:
        """K/V vectors computed per layer so far (layer 0's count; all layers do the same work)."""
        return self.per_layer[0]


# --- replaying a trace: the state after each event, as the figures and widgets draw it ---------------

# Token status: prompt, generated (committed earlier), new (committed this step), proposed (unverified),
# accepted, rejected. Cache slot status: prefill, cached, unverified, verified, stale (after a rollback).
@dataclass
class Snapshot:
    event: TraceEvent
    tokens: list[int]
    status: list[str]
    cache: list[str]                 # one entry per slot written so far; only the first cache_len are live
    cache_len: int
    draft_cache: list[str] = field(default_factory=list)
    draft_cache_len: int = 0
    computed: list[int] = field(default_factory=list)  # positions whose K/V this event computed

    def live(self, slots: list[str], length: int) -> list[str]:
        return [s if i < length else "stale" for i, s in enumerate(slots)]


def _write(slots: list[str], positions, status: str) -> None:
    for p in positions:
        slots.extend(["empty"] * (p + 1 - len(slots)))
        slots[p] = status


def replay(trace: list[TraceEvent]) -> list[Snapshot]:
    """Fold a decoder's trace into one Snapshot per event."""
    tokens: list[int] = []
    status: list[str] = []
    cache: list[str] = []
    draft: list[str] = []
    cache_len = draft_len = 0
    out = []
    for e in trace:
        status = ["generated" if s == "new" else s for s in status]
        computed = list(e.positions)
        if e.kind == "prefill" and 0 < e.cache_len_before <= len(tokens):
            # A prefill that continues a cache (generate(..., cache=c) on a filled or forked cache): the first
            # cache_len_before positions are the ones this trace already holds, reused as they are.
            keep = e.cache_len_before
            tokens = tokens[:keep] + list(e.input_ids) + [e.token]
            status = status[:keep] + ["prompt"] * len(e.input_ids) + ["new"]
            cache, cache_len = ["cached"] * keep + ["prefill"] * len(e.input_ids), e.cache_len_after
        elif e.kind in ("prefill", "recompute"):
            tokens, status = list(e.input_ids), (["prompt"] * len(e.input_ids) if e.step == 0 or e.kind == "prefill"
                                                 else status[: len(e.input_ids)])
            if e.kind == "prefill":
                cache, cache_len = ["prefill"] * len(e.input_ids), e.cache_len_after
            tokens.append(e.token)
            status.append("new")
        elif e.kind == "decode":
            unverified = e.detail.get("unverified", False)
            _write(cache, e.positions, "unverified" if unverified else "cached")
            cache_len = e.cache_len_after
            tokens.append(e.token)
            status.append("proposed" if unverified else "new")
        elif e.kind == "draft":
            for p in e.positions:  # catch-up positions hold committed tokens; the newest are proposals
                _write(draft, [p], "unverified" if p < len(status) and status[p] == "proposed" else "cached")
            draft_len = e.cache_len_after
            tokens.append(e.token)
            status.append("proposed")
        elif e.kind == "verify":
            computed = list(range(e.cache_len_before, e.cache_len_after))
            _write(cache, computed, "unverified")
            cache_len = e.cache_len_after
            for p in e.detail["accepted"]:
                status[p] = "accepted"
            for p in e.detail["rejected"]:
                status[p] = "rejected"
        elif e.kind == "rollback":
            computed = []
            cache_len = e.cache_len_after
            if "draft" in e.detail.get("caches", {}):
                draft_len = e.detail["caches"]["draft"][1]
        elif e.kind == "commit":
            computed = []
            keep = e.positions[0]
            tokens = tokens[:keep] + list(e.input_ids)
            status = status[:keep] + ["accepted"] * (len(e.input_ids) - 1) + ["new"]
            cache_len = e.cache_len_after
            _write(cache, [i for i in range(cache_len) if cache[i] == "unverified"], "verified")
            _write(draft, [i for i in range(min(draft_len, len(draft))) if draft[i] == "unverified"], "verified")
        out.append(Snapshot(event=e, tokens=list(tokens), status=list(status), cache=list(cache), cache_len=cache_len,
                            draft_cache=list(draft), draft_cache_len=draft_len, computed=computed))
    return out


def caption(snap: Snapshot, decode=None) -> str:
    """One line saying what happens in this step; `decode` maps a token id to text."""
    e = snap.event
    word = (lambda t: repr(decode([t]))) if decode else str
    span = lambda ps: "none" if not ps else f"{ps[0]}" if len(ps) == 1 else f"{ps[0]}–{ps[-1]}"  # noqa: E731
    if e.kind == "prefill":
        return (f"prefill: {len(e.input_ids)} prompt tokens at positions {span(e.positions)} → cache length "
                f"{e.cache_len_after}; first new token {word(e.token)}")
    if e.kind == "recompute":
        return (f"naive step {e.step + 1}: recompute K/V for all {len(e.input_ids)} positions "
                f"{span(e.positions)} → {word(e.token)}")
    if e.kind == "decode":
        where = f"batch of {e.detail['batch']}, {e.detail['n_splits']} KV splits, unverified" if "batch" in e.detail else ""
        return (f"decode: feed {word(e.input_ids[0])} at position {e.positions[0]} → cache length {e.cache_len_after}; "
                f"next {word(e.token)}" + (f" ({where})" if where else ""))
    if e.kind == "draft":
        return (f"draft: feed {len(e.input_ids)} token(s) at {span(e.positions)} → proposes {word(e.token)} "
                f"(draft cache {e.cache_len_after})")
    if e.kind == "verify":
        first = e.positions[0] if e.positions else e.cache_len_after
        marks = [f"T{p - first + 1} {'accepted' if p in e.detail['accepted'] else 'rejected'}" for p in e.positions]
        after = first + len(e.detail["accepted"])
        outcome = (f"roll back to length {after}" if e.detail["rejected"] else "all match: no rollback")
        return f"verify in one pass of {e.kv_computed} rows: {', '.join(marks) or 'no proposals'} → {outcome}"
    if e.kind == "rollback":
        return (f"rollback: cache {e.cache_len_before} → {e.cache_len_after}; rejected positions "
                f"{span(e.positions)} forgotten (their slots are stale until overwritten)")
    if e.kind == "commit":
        n = len(e.input_ids)
        return (f"commit {n - 1} accepted + the verifier's own token {word(e.token)} → sequence length "
                f"{e.detail['sequence_len']}" + ("" if e.detail["rollback"] else " (no rollback)"))
    return e.kind
