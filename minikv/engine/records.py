"""What the engine records about its own work: typed trace events, statistics, and a
counter of the K/V vectors the model really computes. The pictures and widgets
(minikv.viz) draw only these."""
from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import torch

# --- trace events: one per forward pass or cache operation -----------------------------
# recompute: naive decoding feeds all again; prefill: the prompt; decode: one new token;
# draft: a draft pass; verify: the authority's pass; rollback: caches cropped; commit:
# tokens kept; chunk: a chunk of a server's prompt that does not end it (no token yet)
Kind = Literal["recompute", "prefill", "decode", "draft", "verify", "rollback", "commit",
               "preempt", "chunk"]


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    kind: Kind
    step: int                           # decoding step (a round, in speculative decoding)
    input_ids: tuple[int, ...] = ()     # token ids fed (verify: the proposals; commit: kept)
    positions: tuple[int, ...] = ()     # their positions (rollback: the rejected ones)
    cache_len_before: int = 0           # cached positions before the pass (0 without a cache)
    cache_len_after: int = 0
    kv_computed: int = 0                # K/V vectors computed per layer, counted by KVCounter
    token: int | None = None            # the token chosen from this pass's last logits
    batch: int = 1                      # decode in a batched server: rows in the pass,
    n_splits: int = 1                   # its split-KV attention chunks, and whether the token
    unverified: bool = False            # is a fast-path guess a verifier must still confirm
    accepted: tuple[int, ...] = ()      # verify: positions whose proposal the authority kept,
    rejected: tuple[int, ...] = ()      # then the first disagreement and every one after it
    caches: dict[str, tuple[int, int]] = field(default_factory=dict)  # rollback: (before, after)
    rolled_back: bool = False           # commit: did this round crop a cache,
    sequence_len: int = 0               # and the sequence's length after it


@dataclass(frozen=True)
class PoolStep:
    """The block pool after one engine step of the server: each request's block table
    (blocks in position order) and cached length, every block's reference count, and what
    the step did."""
    step: int
    tables: dict[int, tuple[int, ...]]   # request -> its blocks
    lengths: dict[int, int]              # request -> cached positions
    ref: tuple[int, ...]                 # per block: how many requests hold it (0: free)
    log: tuple[tuple[int, str, int, int], ...]  # (step, what, block, request) of this step


# --- statistics ------------------------------------------------------------------------
@dataclass
class Stats:
    prompt_len: int = 0
    new_tokens: int = 0
    forward_passes: int = 0
    positions_processed: int = 0  # token positions pushed through the model, summed over passes
    kv_computed: int = 0          # K/V vectors computed per layer (every layer does the same)


@dataclass
class VerifyStats:
    prompt_len: int = 0
    new_tokens: int = 0
    rounds: int = 0           # verification passes
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0         # proposals thrown away (the first mismatch and all after it)
    rejected_rounds: int = 0  # rounds that ended in a rejection
    rollbacks: int = 0        # rounds that had to crop a cache

    def record(self, rnd) -> None:
        """Count one verify-and-commit round (a verify.Round)."""
        n, ok = len(rnd.proposals), rnd.verdict.accepted
        self.rounds += 1
        self.proposed += n
        self.accepted += ok
        self.rejected += n - ok
        self.rejected_rounds += rnd.ended_in_rejection
        self.rollbacks += rnd.rolled_back

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed: counts the never-judged proposals after a rejection as
        rejected, so it understates α, the more the longer the rounds."""
        return self.accepted / max(self.proposed, 1)

    @property
    def alpha(self) -> float | None:
        """Leviathan et al.'s α, the chance that a judged proposal is accepted, estimated
        as accepted / (accepted + rejections): each round judges proposals until its
        first rejection, so only those judgements count. None when nothing was judged: no
        proposal estimates nothing (0.0 would read as "every proposal rejected")."""
        judged = self.accepted + self.rejected_rounds
        return self.accepted / judged if judged else None


@dataclass
class SpeculativeStats(VerifyStats):
    target_passes: int = 0  # the prefill plus one verification per round
    draft_passes: int = 0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / max(self.target_passes, 1)


@dataclass
class ServeStats(VerifyStats):
    fast_steps: int = 0  # batched decode steps this request took part in
    reused: int = 0      # prompt positions whose K/V came from another prompt's blocks
    preempted: int = 0   # times its blocks were taken back, to be recomputed
    prefill_chunks: int = 0  # passes its prompt was computed in, under chunked prefill


# --- counting K/V work -----------------------------------------------------------------
class KVCounter(ExitStack):
    """Counts the K/V vectors the model computes, per layer: every row out of a layer's
    `c_attn` is one position's new query, key and value (MLA: `kv_a_proj_with_mqa`, its
    latent). Hooks count only the passes of
    the thread that opened the counter, so threads sharing a model each get their own
    count. It is an ExitStack of its hooks: leaving it takes every hook off, even when
    taking one off is interrupted (a hook left on would count into every later pass)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._blocks = list(model.transformer.h)
        self.per_layer = [0] * len(self._blocks)
        self._thread = threading.get_ident()

    def _hook(self, layer_idx: int):
        def count(module, inputs, output):
            if threading.get_ident() == self._thread:
                self.per_layer[layer_idx] += output.shape[0] * output.shape[1]  # B * T rows
        return count

    def __enter__(self) -> KVCounter:
        try:  # one at a time: a Ctrl-C halfway takes off those already on
            for i, b in enumerate(self._blocks):  # (a cross-layer group's upper ones make none)
                if b.attn.makes_kv:  # MLA: its latent; otherwise Q, K and V together
                    made = getattr(b.attn, "kv_a_proj_with_mqa", None) or b.attn.c_attn
                    self.enter_context(made.register_forward_hook(self._hook(i)))
            return self
        except BaseException:
            self.close()
            raise

    @property
    def count(self) -> int:
        """K/V vectors computed per layer so far (layer 0's; every layer does the same).
        """
        return self.per_layer[0]


# --- what a decoder returns ------------------------------------------------------------
@dataclass
class GenerationOutput:
    prompt: list[int]
    tokens: list[int]                # the new tokens, including the EOS that stopped generation
    stats: Stats
    trace: list[TraceEvent] | None   # one event per forward pass, when asked for
    logits: torch.Tensor | None      # (new tokens, vocab): what each token was chosen from

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


@dataclass
class RequestOutput:
    """What the server returns for one request (serving.serve)."""
    request: object                  # the minikv.Request it answers
    tokens: list[int]                # committed new tokens
    stats: ServeStats
    trace: list[TraceEvent] | None   # with trace=True
    fast_logits: list[torch.Tensor] = field(default_factory=list)  # with record_logits=True


class ServeOutputs(list):
    """The list of RequestOutputs, one per request in order, with the block pool they
    were served from (its `log` holds (what, block, request) for every block allocated,
    shared, copied, freed or unshared, and every preemption) and, when traced, the pool
    after every engine step."""

    def __init__(self, outputs: list[RequestOutput], pool, pool_steps: list[PoolStep]):
        super().__init__(outputs)
        self.pool = pool
        self.pool_steps = pool_steps
