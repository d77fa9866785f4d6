"""Replaying a trace: the state of the tokens and the caches after each event, and a caption.

The engine records events (minikv.engine.records.TraceEvent); this folds them into one Snapshot
per event, which the pictures (draw.py) and the steppers (widgets.py) draw. Nothing here runs a
model: every picture is the trace's own story.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.records import TraceEvent

# Token status: prompt, generated (committed earlier), new (committed this step), proposed
# (unverified), accepted, rejected. Cache slot status: prefill, cached, unverified, verified,
# stale (after a rollback), empty.


@dataclass
class Snapshot:
    event: TraceEvent
    tokens: list[int]
    status: list[str]
    cache: list[str]          # one entry per slot written so far; only the first cache_len live
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
            # A prefill that continues a cache (generate(..., cache=c) on a filled or forked
            # cache): its first cache_len_before positions are this trace's, reused as they are.
            keep = e.cache_len_before
            tokens = tokens[:keep] + list(e.input_ids) + [e.token]
            status = status[:keep] + ["prompt"] * len(e.input_ids) + ["new"]
            cache = ["cached"] * keep + ["prefill"] * len(e.input_ids)
            cache_len = e.cache_len_after
        elif e.kind in ("prefill", "recompute"):
            fresh = e.step == 0 or e.kind == "prefill"
            tokens = list(e.input_ids)
            status = ["prompt"] * len(e.input_ids) if fresh else status[: len(e.input_ids)]
            if e.kind == "prefill":
                cache, cache_len = ["prefill"] * len(e.input_ids), e.cache_len_after
            tokens.append(e.token)
            status.append("new")
        elif e.kind == "decode":
            _write(cache, e.positions, "unverified" if e.unverified else "cached")
            cache_len = e.cache_len_after
            tokens.append(e.token)
            status.append("proposed" if e.unverified else "new")
        elif e.kind == "draft":
            for p in e.positions:  # catch-up positions hold committed tokens; the newest proposals
                proposed = p < len(status) and status[p] == "proposed"
                _write(draft, [p], "unverified" if proposed else "cached")
            draft_len = e.cache_len_after
            tokens.append(e.token)
            status.append("proposed")
        elif e.kind == "verify":
            computed = list(range(e.cache_len_before, e.cache_len_after))
            _write(cache, computed, "unverified")
            cache_len = e.cache_len_after
            for p in e.accepted:
                status[p] = "accepted"
            for p in e.rejected:
                status[p] = "rejected"
        elif e.kind == "rollback":
            computed = []
            cache_len = e.cache_len_after
            if "draft" in e.caches:
                draft_len = e.caches["draft"][1]
        elif e.kind == "commit":
            computed = []
            keep = e.positions[0]
            tokens = tokens[:keep] + list(e.input_ids)
            status = status[:keep] + ["accepted"] * (len(e.input_ids) - 1) + ["new"]
            cache_len = e.cache_len_after
            _write(cache, [i for i in range(cache_len) if cache[i] == "unverified"], "verified")
            _write(draft, [i for i in range(min(draft_len, len(draft)))
                           if draft[i] == "unverified"], "verified")
        out.append(Snapshot(event=e, tokens=list(tokens), status=list(status), cache=list(cache),
                            cache_len=cache_len, draft_cache=list(draft),
                            draft_cache_len=draft_len, computed=computed))
    return out


def _span(ps) -> str:
    return "none" if not ps else f"{ps[0]}" if len(ps) == 1 else f"{ps[0]}–{ps[-1]}"


def caption(snap: Snapshot, decode=None) -> str:
    """One line saying what happens in this step; `decode` maps a token id to text."""
    e = snap.event
    word = (lambda t: repr(decode([t]))) if decode else str
    if e.kind == "prefill":
        return (f"prefill: {len(e.input_ids)} prompt tokens at positions {_span(e.positions)} → "
                f"cache length {e.cache_len_after}; first new token {word(e.token)}")
    if e.kind == "recompute":
        return (f"naive step {e.step + 1}: recompute K/V for all {len(e.input_ids)} positions "
                f"{_span(e.positions)} → {word(e.token)}")
    if e.kind == "decode":
        where = (f" (batch of {e.batch}, {e.n_splits} KV splits"
                 f"{', unverified' if e.unverified else ''})"
                 if e.unverified or e.batch > 1 else "")
        return (f"decode: feed {word(e.input_ids[0])} at position {e.positions[0]} → cache "
                f"length {e.cache_len_after}; next {word(e.token)}{where}")
    if e.kind == "draft":
        return (f"draft: feed {len(e.input_ids)} token(s) at {_span(e.positions)} → proposes "
                f"{word(e.token)} (draft cache {e.cache_len_after})")
    if e.kind == "verify":
        first = e.positions[0] if e.positions else e.cache_len_after
        marks = [f"T{p - first + 1} {'accepted' if p in e.accepted else 'rejected'}"
                 for p in e.positions]
        after = first + len(e.accepted)
        outcome = f"roll back to length {after}" if e.rejected else "all match: no rollback"
        return (f"verify in one pass of {e.kv_computed} rows: "
                f"{', '.join(marks) or 'no proposals'} → {outcome}")
    if e.kind == "rollback":
        return (f"rollback: cache {e.cache_len_before} → {e.cache_len_after}; rejected positions "
                f"{_span(e.positions)} forgotten (their slots are stale until overwritten)")
    if e.kind == "commit":
        return (f"commit {len(e.input_ids) - 1} accepted + the verifier's own token "
                f"{word(e.token)} → sequence length {e.sequence_len}"
                + ("" if e.rolled_back else " (no rollback)"))
    return e.kind
