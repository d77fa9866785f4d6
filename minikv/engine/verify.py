"""Verify and roll back: the one core of speculative decoding and deterministic requests.
Someone cheap proposes tokens (a draft model, or a fast batched pass); an authority (the
target, or a batch-invariant replay) scores them all in ONE pass; an accept rule keeps a
prefix of them, then the authority's own token (a correction, or a bonus after the last
proposal); and every KV cache is cropped back to the last committed token. Proposals may
be a chain or a token tree (tree.py): a tree is verified in the same one pass, with its
positions and mask, and the accepted path is the prefix kept."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import KVCache, upload
from .records import TraceEvent
from .sampling import SamplingParams, choose_rows
from .tree import check_parents, children, is_chain, tree_attention, tree_mask, tree_positions


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading proposals the authority agrees with
    token: int     # the authority's token right after them: a correction, or the bonus
    path: tuple[int, ...] | None = None  # a tree's accepted nodes, root first (None: a chain)

    @property
    def nodes(self) -> tuple[int, ...]:
        """The accepted proposals: a chain's first `accepted`, or a tree's path."""
        return tuple(range(self.accepted)) if self.path is None else self.path


# --- accept rules: (logits of the proposed positions + 1, proposals) -> Verdict -------
def accept_matching(logits: torch.Tensor, proposals: list[int], sampling: SamplingParams,
                    first_position: int, parents: list[int] | None = None) -> Verdict:
    """Keep proposals while each equals the authority's own choice at its position: its
    argmax when greedy, or its seeded draw (`SamplingParams.choose`). Row i of `logits`
    (γ + 1, vocab) scores the position of proposal i; the last row gives the bonus. In a
    tree (`parents`), row 0 scores the root's children and row 1 + i node i's; the walk
    goes down to the child that holds the authority's choice, while there is one."""
    # Every row's choice is made and read back at once: a GPU waits once a round.
    if parents is None:
        n = len(proposals)
        mine = choose_rows([sampling] * (n + 1), logits[:n + 1],
                           range(first_position, first_position + n + 1))
        for i, proposed in enumerate(proposals):
            if mine[i] != proposed:
                return Verdict(i, mine[i])
        return Verdict(n, mine[n])
    # Row 0 is at the first position; row 1 + i at node i's depth past it.
    rows = [first_position] + tree_positions(parents, first_position)
    mine = choose_rows([sampling] * len(rows), logits[:len(rows)], rows)
    kids, path = children(parents), []
    while True:
        here = mine[1 + path[-1] if path else 0]
        match = [c for c in kids[path[-1] if path else -1] if proposals[c] == here]
        if not match:
            return Verdict(len(path), here, tuple(path))
        path.append(match[0])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still wants after the draft's proposal was refused."""
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()


def accept_by_rejection_sampling(logits: torch.Tensor, proposals: list[int],
                                 draft_probs: torch.Tensor, sampling: SamplingParams,
                                 generator: torch.Generator) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023): the committed tokens follow the
    target's distribution p exactly, whatever the draft's q. Accept proposal x with
    probability min(1, p(x) / q(x)); on the first refusal draw from norm(max(0, p - q));
    after γ acceptances draw the bonus token from p."""
    p = sampling.probabilities(logits)  # (γ + 1, vocab)
    n = len(proposals)
    u = torch.rand(n, generator=generator, device=p.device)
    refused = []  # u >= p/q without dividing by zero; all γ tests read back at once
    if n:
        x, i = upload(proposals, p.device), torch.arange(n, device=p.device)
        refused = (u * draft_probs[i, x] >= p[i, x]).tolist()
    first = refused.index(True) if True in refused else n
    left = residual_distribution(p[first], draft_probs[first]) if first < n else p[-1]
    return Verdict(first, int(torch.multinomial(left, 1, generator=generator)))


def accept_tree_by_rejection_sampling(logits: torch.Tensor, proposals: list[int],
                                      draft_probs: torch.Tensor, parents: list[int],
                                      sampling: SamplingParams,
                                      generator: torch.Generator) -> Verdict:
    """The same rule for a tree whose siblings were drawn independently from one q
    (SpecInfer, Miao et al. 2024): at each node try its children in order, each against
    what the target still wants; a refused child turns p into norm(max(0, p - q)) for
    the next sibling; when every child is refused, draw from what is left. Row 0 of
    `logits` scores the root's children, row 1 + i node i's; draft_probs[i] is the q
    node i was drawn from."""
    p = sampling.probabilities(logits)  # (1 + nodes, vocab)
    u = torch.rand(len(proposals), generator=generator, device=p.device)
    kids, path = children(parents), []
    while True:
        left = p[1 + path[-1] if path else 0]  # what the target wants here, and still wants
        for c in kids[path[-1] if path else -1]:
            x = proposals[c]
            if u[c] * draft_probs[c, x] < left[x]:  # accepted: go down to it
                path.append(c)
                break
            left = residual_distribution(left, draft_probs[c])
        else:
            token = int(torch.multinomial(left, 1, generator=generator))
            return Verdict(len(path), token, tuple(path))


# --- the core -------------------------------------------------------------------------
# (rows of token ids, cache[, positions=, attention=]) -> logits (len(rows), vocab): the
# authority's single pass (a tree's pass also gives its positions and mask).
Verifier = Callable[..., torch.Tensor]
# (logits, proposals) -> Verdict: an accept rule with its other arguments bound.
AcceptRule = Callable[[torch.Tensor, list[int]], Verdict]


@dataclass
class Round:
    """What one verification did, for stats and traces."""
    start: int                  # position of the first row the authority replayed
    replayed: int               # rows in the authority's pass (K/V vectors it computed per layer)
    proposals: list[int]
    verdict: Verdict
    cache_lens: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> before, after
    parents: list[int] | None = None  # a tree's shape (None: a chain)

    @property
    def rolled_back(self) -> bool:
        return any(before > after for before, after in self.cache_lens.values())

    @property
    def ended_in_rejection(self) -> bool:
        """A proposal was refused: the chain stopped short, or the path ended at a node
        that had children (a tree's path that reached a leaf earned its bonus)."""
        if self.parents is None:
            return self.verdict.accepted < len(self.proposals)
        last = self.verdict.path[-1] if self.verdict.path else -1
        return bool(children(self.parents)[last])


def verify_and_commit(sequence: list[int], proposals: list[int], cache: KVCache,
                      verifier: Verifier, accept: AcceptRule, *, start: int | None = None,
                      rows: int | None = None, pad_id: int = 0,
                      other_caches: dict[str, KVCache] | None = None,
                      parents: list[int] | None = None) -> Round:
    """Verify `proposals` (for the positions after `sequence`), commit into `sequence`,
    roll the caches back. The last token of `sequence` is committed but not yet in
    `cache`; the authority replays positions `start` (default: that token) to the last
    proposal in one pass, padded to `rows` rows when a fixed shape is wanted. With
    `parents` the proposals are a token tree (tree.py), fed after the committed rows
    with their tree positions and mask."""
    start = len(sequence) - 1 if start is None else start
    inputs = sequence[start:] + proposals
    if rows is not None and len(inputs) > rows:
        raise ValueError(f"{len(inputs)} rows to verify exceed the fixed window of {rows}")
    tree = parents is not None and not is_chain(parents)  # a chain goes the plain way
    if parents is not None:
        check_parents(parents, len(proposals))
        if tree and rows is not None:
            raise ValueError("a token tree is verified unpadded: pass rows=None")
    # 1. Crop the authority's cache to `start`, so every entry its pass writes is its own.
    cache.crop(min(cache.get_seq_length(), start))
    # 2. ONE pass over the replayed rows; padding rows only fix the pass's shape, then go.
    padded = inputs + [pad_id] * ((rows or len(inputs)) - len(inputs))
    first = len(sequence) - 1 - start  # the root's row: the last committed token
    if tree:
        positions = list(range(start, len(sequence))) + tree_positions(parents, len(sequence) - 1)
        logits = verifier(padded, cache, positions=positions,
                          attention=tree_attention(tree_mask(parents, prefix=first + 1)))
    else:
        logits = verifier(padded, cache)
    cache.crop(start + len(inputs))
    return commit_round(sequence, proposals, logits[first:len(inputs)], accept,
                        {"verifier": cache, **(other_caches or {})}, start=start,
                        replayed=len(padded), parents=parents)


def commit_round(sequence: list[int], proposals: list[int], logits: torch.Tensor,
                 accept: AcceptRule, caches: dict[str, KVCache], *, start: int, replayed: int,
                 parents: list[int] | None = None) -> Round:
    """Steps 3-6 of a round, once the authority's pass is done (by verify_and_commit, or
    by a server's one pass for many requests): `logits` (1 + len(proposals), vocab) are
    its rows from the last committed token on; caches["verifier"] holds what it wrote."""
    tree = parents is not None and not is_chain(parents)
    cache = caches["verifier"]
    written = cache.get_seq_length()
    # 3. Judge: row 0 is the output at the last committed token, which scores proposal 1.
    verdict = accept(logits, proposals)
    # 4. Commit the accepted proposals and the authority's own token.
    n = len(sequence)  # the first proposal's position
    sequence.extend([proposals[i] for i in verdict.nodes] + [verdict.token])
    # 5. A tree's accepted path moves into place behind the root; the other branches go.
    if tree:
        cache.compact([n + i for i in verdict.nodes], n)
    # 6. Roll back: keep K/V up to the last committed token (it is fed next round), not beyond.
    lens = {}
    for name, c in caches.items():
        before = written if c is cache else c.get_seq_length()
        c.crop(min(c.get_seq_length(), len(sequence) - 1))
        lens[name] = (before, c.get_seq_length())
    return Round(start=start, replayed=replayed, proposals=list(proposals), verdict=verdict,
                 cache_lens=lens, parents=None if parents is None else list(parents))


def round_events(step: int, rnd: Round, sequence_len: int) -> list[TraceEvent]:
    """A round as trace events: verify, rollback (when a cache shrank), commit. A tree's
    verify event gives each node's position (siblings share one); its rejected positions
    are those of the nodes off the accepted path."""
    first = sequence_len - rnd.verdict.accepted - 1  # position of the first proposal
    n_ok, n = rnd.verdict.accepted, len(rnd.proposals)
    kept = rnd.verdict.nodes
    if rnd.parents is None:
        positions = tuple(range(first, first + n))
    else:
        positions = tuple(tree_positions(rnd.parents, first - 1))
    rejected = tuple(sorted({positions[i] for i in range(n) if i not in kept}))
    lens = dict(rnd.cache_lens)
    before, after = lens["verifier"]
    events = [TraceEvent(
        kind="verify", step=step, input_ids=tuple(rnd.proposals), token=rnd.verdict.token,
        positions=positions, cache_len_before=rnd.start,
        cache_len_after=before, kv_computed=rnd.replayed,
        accepted=tuple(range(first, first + n_ok)), rejected=rejected)]
    if rnd.rolled_back:
        events.append(TraceEvent(kind="rollback", step=step, positions=rejected, caches=lens,
                                 cache_len_before=before, cache_len_after=after))
    events.append(TraceEvent(
        kind="commit", step=step,
        input_ids=tuple(rnd.proposals[i] for i in kept) + (rnd.verdict.token,),
        positions=tuple(range(first, sequence_len)), cache_len_before=after,
        cache_len_after=after, token=rnd.verdict.token, rolled_back=rnd.rolled_back,
        sequence_len=sequence_len))
    return events
