"""Replaying a trace: the state of the tokens and the caches after each event, and a caption.

The engine records events (minikv.engine.records.TraceEvent); this folds them into one Snapshot
per event, which the pictures (draw.py) and the steppers (widgets.py) draw. Nothing here runs a
model: every picture is the trace's own story.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.records import TraceEvent

# A token's state, one colour each in every row, picture and chapter (minikv.viz.draw):
#   prompt     given by the user
#   generated  produced by the model itself (a decode step, or the verifier's own token)
#   proposed   proposed by a draft or a fast path, not verified yet
#   accepted   a proposal the verifier agreed with
#   rejected   a proposal the verifier turned down (and everything after it)
# A cache slot holds the K/V of the token at its position, so it takes that token's state;
# slots past the live length are "stale" (kept in memory, no longer part of the cache).
STATES = ("prompt", "generated", "proposed", "accepted", "rejected", "stale")


@dataclass
class Snapshot:
    event: TraceEvent
    tokens: list[int]
    status: list[str]                 # one state per token
    cache_len: int                    # live slots of the (target's or verifier's) cache
    cache_written: int                # slots ever written: those past cache_len are stale
    draft_cache_len: int = 0
    draft_written: int = 0            # 0 when the trace has no draft model (yet)
    computed: list[int] = field(default_factory=list)  # positions whose K/V this event computed
    computed_in: str = "cache"        # "cache", "draft" or "none" (naive: nothing is kept)
    newest: int | None = None         # position of the token this event produced

    @property
    def has_draft(self) -> bool:
        return self.draft_written > 0

    def slots(self, which: str = "cache") -> list[str]:
        """Each written slot's state: its token's while live, "stale" past the live length."""
        length, written = ((self.cache_len, self.cache_written) if which == "cache"
                           else (self.draft_cache_len, self.draft_written))
        return [self.status[p] if p < length else "stale" for p in range(written)]


def replay(trace: list[TraceEvent]) -> list[Snapshot]:
    """Fold a decoder's trace into one Snapshot per event."""
    tokens: list[int] = []
    status: list[str] = []
    cache_len = written = draft_len = draft_written = 0
    out = []
    for e in trace:
        computed, computed_in, newest = list(e.positions), "cache", None
        if (e.kind == "prefill" and 0 < e.cache_len_before <= len(tokens)
                and len(e.input_ids) < e.cache_len_after):
            # A prefill that continues a cache (generate(..., cache=c) on a filled or forked
            # cache): its first cache_len_before positions are this trace's, reused as they are.
            # (A server's prefill names every token it sees, a chunked one's last chunk too.)
            keep = e.cache_len_before
            tokens = tokens[:keep] + list(e.input_ids) + [e.token]
            status = status[:keep] + ["prompt"] * len(e.input_ids) + ["generated"]
            cache_len = written = e.cache_len_after
        elif e.kind in ("prefill", "recompute"):
            fresh = e.kind == "prefill" or (e.step == 0 and not status)
            tokens = list(e.input_ids) + [e.token]
            status = (["prompt"] * len(e.input_ids) if fresh
                      else status[: len(e.input_ids)]) + ["generated"]
            if e.kind == "prefill" or e.cache_len_after:  # a server's recompute refills a cache
                cache_len, written = e.cache_len_after, max(written, e.cache_len_after)
            else:  # naive decoding keeps nothing
                computed_in = "none"
        elif e.kind == "chunk":  # a server's prompt, computed so far: no token yet
            tokens = list(e.input_ids)
            status = (status + ["prompt"] * len(tokens))[:len(tokens)]
            cache_len, written = e.cache_len_after, max(written, e.cache_len_after)
        elif e.kind == "decode":
            tokens.append(e.token)
            status.append("proposed" if e.unverified else "generated")
            cache_len, written = e.cache_len_after, max(written, e.cache_len_after)
        elif e.kind == "draft":
            tokens.append(e.token)
            status.append("proposed")
            draft_len = e.cache_len_after
            draft_written, computed_in = max(draft_written, draft_len), "draft"
        elif e.kind == "verify":
            # proposals no pass has shown yet (prompt lookup proposes without a model)
            for p, t in zip(e.positions, e.input_ids):
                if p == len(tokens):
                    tokens.append(t)
                    status.append("proposed")
            computed = list(range(e.cache_len_before, e.cache_len_after))
            cache_len, written = e.cache_len_after, max(written, e.cache_len_after)
            for p in e.accepted:
                status[p] = "accepted"
            for p in e.rejected:
                status[p] = "rejected"
        elif e.kind == "preempt":  # the server took its blocks back: nothing cached is live
            computed, cache_len = [], 0
        elif e.kind == "rollback":
            computed = []
            cache_len = e.cache_len_after
            draft_len = e.caches.get("draft", (draft_len, draft_len))[1]
        elif e.kind == "commit":
            computed = []
            keep = e.positions[0]
            tokens = tokens[:keep] + list(e.input_ids)
            status = status[:keep] + ["accepted"] * (len(e.input_ids) - 1) + ["generated"]
            cache_len = e.cache_len_after
        if e.kind in ("prefill", "recompute", "decode", "draft", "commit"):
            newest = len(tokens) - 1
        out.append(Snapshot(event=e, tokens=list(tokens), status=list(status),
                            cache_len=cache_len, cache_written=written,
                            draft_cache_len=draft_len, draft_written=draft_written,
                            computed=computed, computed_in=computed_in, newest=newest))
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
    if e.kind == "chunk":
        return (f"prefill chunk: positions {_span(e.positions)} ({e.kv_computed} tokens, beside "
                f"{e.batch - 1} other row(s)) → cache length {e.cache_len_after}; no token yet")
    if e.kind == "recompute" and e.cache_len_after:
        return (f"readmitted: recompute K/V of positions {_span(e.positions)} into new blocks → "
                f"cache length {e.cache_len_after}; next {word(e.token)}")
    if e.kind == "recompute":
        return (f"naive step {e.step + 1}: recompute K/V for all {len(e.input_ids)} positions "
                f"{_span(e.positions)} → {word(e.token)}")
    if e.kind == "preempt":
        return (f"preempted: the pool is full, so its blocks go to other requests; its "
                f"{e.cache_len_before} cached positions will be recomputed when it is readmitted")
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
        marks = [f"T{p - first + 1}′ {'accepted' if p in e.accepted else 'rejected'}"
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
