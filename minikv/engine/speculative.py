"""Speculative decoding: someone cheap proposes γ tokens, the target verifies
them in one pass. Greedy output is exactly the target's own; with temperature > 0 the
rejection rule keeps the target's distribution. It pays when scoring γ + 1 positions
costs the target about one decode step and the proposer is cheap and usually right.

`speculate` is the one round loop; a `Proposer` is who proposes: a draft model
(`DraftProposer`, below), prompt lookup (lookup.py), a head on the target's own features
(eagle.py), or the next one. A proposal is a chain or a token tree (tree.py). The same
proposers serve inside the server (`Speculation`, serving.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from .cache import KVCache, upload
from .model import causal_attention
from .records import GenerationOutput, SpeculativeStats, TraceEvent
from .sampling import SamplingParams
from .tree import check_parents, depths
from .validate import check_flags, check_model, check_room, int_at_least, prompt_of_call, tightest
from .verify import (
    Verifier,
    accept_by_rejection_sampling,
    accept_matching,
    accept_tree_by_rejection_sampling,
    round_events,
    verify_and_commit,
)


# --- the seam: who proposes, and what a proposal is -----------------------------------
@dataclass
class Proposal:
    """A proposer's answer, when a plain list of token ids is not enough."""
    tokens: list[int]
    # (len(tokens), vocab): what each token was drawn from. Given, the round is judged by
    # rejection sampling; None (a sure proposer), by matching the target's own choices.
    probs: torch.Tensor | None = None
    # One "draft" event per forward pass the proposer ran; the loop stamps the round.
    events: list[TraceEvent] = field(default_factory=list)
    # A token tree: parents[i] is token i's parent (-1: the last committed token). None: a
    # chain. With probs, siblings must be independent draws from one q (the tree's rule).
    parents: list[int] | None = None


class Proposer:
    """Who proposes the tokens a round verifies. A new proposer subclasses this and writes
    `propose`; the rest have defaults. (A plain function propose(seq, k) works too.)

    - propose(seq, k): at most k tokens to follow `seq`, a list of ids or a `Proposal` (a
      tree at most k deep), leaving `seq` (the committed tokens) as it was.
    - caches: {name: cache} it keeps; every round rolls them back with the target's.
    - wants_features, take_features(start, features): a proposer that reads the target's
      last hidden states (eagle.py) is handed those of every row of every target pass,
      (rows, n_embd) for positions start, start + 1, ..., before it proposes again.
    - max_tokens(k): the most tokens a proposal k deep holds (a chain: k): the positions a
      round writes past the last committed token.
    - fresh(): one like it with nothing cached, for another request (a server gives each
      running request its own).
    """
    wants_features = False

    @property
    def caches(self) -> dict:
        return {}

    def propose(self, seq: list[int], k: int) -> Proposal | list[int]:
        raise NotImplementedError

    def __call__(self, seq: list[int], k: int) -> Proposal | list[int]:
        return self.propose(seq, k)

    def take_features(self, start: int, features: torch.Tensor) -> None:
        pass

    def max_tokens(self, k: int) -> int:
        return k

    def fresh(self) -> Proposer:
        return self  # nothing cached: one may serve every request


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding inside the server (serve(speculative=...), vLLM's
    speculative_config): every running request proposes up to `gamma` tokens a step with a
    proposer of its own: `proposer.fresh()` (any Proposer: a feature head's chains or
    trees, say), else a `draft` model's greedy tokens (one draft cache per request), else
    prompt lookup over `ngram` tokens."""
    gamma: int = 4
    draft: object = None
    ngram: int = 3
    proposer: Proposer | None = None

    def __post_init__(self) -> None:
        int_at_least("Speculation gamma", self.gamma, hint=" (tokens proposed per step)")
        int_at_least("Speculation ngram", self.ngram, hint=" (tokens the lookup matches)")
        if not isinstance(self.proposer, (Proposer, type(None))):
            raise TypeError(f"Speculation proposer must be a minikv Proposer (e.g. "
                            f"FeatureProposer(target, head)), not {self.proposer!r:.40}")


def check_speculation(model, speculative, policy) -> None:
    """serve(speculative=): a Speculation, without chunked prefill, a draft that fits."""
    if speculative is None:
        return
    if not isinstance(speculative, Speculation):
        raise TypeError(f"speculative must be a minikv.Speculation "
                        f"(Speculation(gamma=4)) or None, not {type(speculative).__name__}")
    if getattr(policy, "chunked_prefill", False):
        raise ValueError("speculative serving does not run with chunked prefill: "
                         "pick one")
    if speculative.draft is not None:
        check_draft(model, speculative.draft)  # before any request runs

# --- the round loop -------------------------------------------------------------------
def speculate(target, ids, max_new_tokens: int, sampling: SamplingParams,
              propose: Proposer | Callable, *, gamma: int = 4, max_gamma: int | None = None,
              other_caches: dict[str, KVCache] | None = None,
              generator: torch.Generator | None = None, verifier: Verifier | None = None,
              tree_size: int | None = None, trace: bool = False) -> GenerationOutput:
    """Up to `max_new_tokens` after `ids`, `propose` offering up to γ tokens a round and
    `target` verifying them in ONE pass (`verifier`: another pass). With `max_gamma`, γ
    adapts in [1, max_gamma]; the proposer's `generator` makes one seeded stream of both;
    with `tree_size`, a proposal may be a token tree of that many tokens, γ deep."""
    prompt = prompt_of_call(target, ids, max_new_tokens, sampling)
    check_flags(trace=trace)
    other_caches = {**getattr(propose, "caches", {}), **(other_caches or {})}
    needed = _check_call(target, prompt, max_new_tokens, sampling, gamma, max_gamma,
                         other_caches, tree_size)
    if verifier is None and getattr(propose, "wants_features", False):
        verifier = partial(scores, target, proposer=propose)  # it reads the target's features
    generator = generator or torch.Generator(target.device).manual_seed(sampling.seed)
    seq, out = list(prompt), GenerationOutput(prompt, [], SpeculativeStats(len(prompt)), [], None)
    if max_new_tokens == 0:
        return _finish(out, seq, trace)
    cache = KVCache.for_model(target, max_len=needed)
    with torch.inference_mode():
        # 0. Prefill the target with the prompt: its last logits give the first token.
        out.trace.append(_prefill(target, cache, seq, sampling, generator, verifier))
        verifier = verifier or partial(scores, target)
        out.stats.target_passes += 1
        while len(seq) - len(prompt) < max_new_tokens and seq[-1] != sampling.eos_id:
            # 1. Propose up to γ tokens (a tree γ deep); the round adds the target's own.
            k = min(gamma, max_new_tokens - (len(seq) - len(prompt)) - 1)
            proposal = as_proposal(propose(seq, k), k, tree_size)
            # 2. Verify in ONE target pass; commit the accepted prefix (a tree's path) and
            #    the target's token; roll every cache back behind them.
            accept = _accept_rule(sampling, proposal, len(seq), generator)
            rnd = verify_and_commit(seq, proposal.tokens, cache, verifier, accept,
                                    other_caches=other_caches, parents=proposal.parents)
            # 3. Record the round: the proposer's passes, then verify, rollback, commit.
            _record(out, proposal, rnd, len(seq))
            # 4. Adapt γ: further while the proposer is right, less far once it is wrong.
            if max_gamma is not None:
                all_ok = not rnd.ended_in_rejection and rnd.verdict.accepted == k
                gamma = min(gamma + 1, max_gamma) if all_ok else max(gamma - 1, 1)
            # 5. Stop after EOS: a round may have committed tokens past it.
            if sampling.eos_id in seq[len(prompt):]:
                del seq[seq.index(sampling.eos_id, len(prompt)) + 1:]
    return _finish(out, seq, trace)


def _prefill(target, cache, seq: list[int], sampling, generator, verifier) -> TraceEvent:
    """Feed the prompt (all of `seq`), append the first new token, return the pass."""
    n = len(seq)
    if verifier is None:
        ids = torch.tensor([seq], device=target.device)
        logits = target(ids, cache=cache, last_only=True)[0, -1]
    else:  # the caller's verifier (one that keeps the target's features, say)
        logits = verifier(seq, cache)[-1]
    seq.append(int(sampling.sample(logits, generator)))
    return TraceEvent(kind="prefill", step=0, input_ids=tuple(seq[:n]), token=seq[-1],
                      positions=tuple(range(n)), cache_len_after=n, kv_computed=n)


def scores(model, rows: list[int], cache: KVCache, positions: list[int] | None = None,
           attention=causal_attention, proposer: Proposer | None = None) -> torch.Tensor:
    """The verifier: `model`'s logits at every row, (len(rows), vocab); a tree's pass
    gives its rows' positions and mask. A proposer that reads the target's features
    (Proposer.wants_features) is handed them."""
    start = cache.get_seq_length()
    ids = upload([rows], model.device)  # behind the proposer's kernels, not waiting for them
    pos = None if positions is None else upload(positions, model.device)
    if proposer is None or not proposer.wants_features:
        return model(ids, cache=cache, positions=pos, attention=attention)[0]
    f = model.features(ids, cache=cache, positions=pos, attention=attention)[0]
    proposer.take_features(start, f)
    return model.lm_head(f)


# A proposer's answer as a Proposal, checked: at most k tokens (a tree: at most tree_size, k deep)
def as_proposal(proposed: Proposal | list[int], k: int, tree_size: int | None) -> Proposal:
    if not isinstance(proposed, Proposal):
        proposed = Proposal([int(t) for t in proposed])
    if proposed.parents is None:
        if len(proposed.tokens) > k:  # more would overrun the budget and the caches
            raise ValueError(f"propose(seq, k={k}) returned {len(proposed.tokens)}: return at "
                             f"most k")
        return proposed
    if tree_size is None:
        raise ValueError("propose returned a token tree (parents): pass speculate(tree_size=...)")
    check_parents(proposed.parents, len(proposed.tokens))
    if len(proposed.tokens) > tree_size or max(depths(proposed.parents), default=0) > k:
        raise ValueError(f"propose(seq, k={k}) returned a tree of {len(proposed.tokens)} tokens, "
                         f"{max(depths(proposed.parents))} deep: at most tree_size={tree_size} "
                         f"tokens, k deep")
    return proposed


def _accept_rule(sampling: SamplingParams, proposal: Proposal, first_position: int,
                 generator):
    """Matching when greedy, or when the proposer gives no distribution (a sure
    proposal x is then kept with probability p(x): the target's law); else speculative
    sampling (a tree's siblings each tried against what the target still wants)."""
    probs, parents = proposal.probs, proposal.parents
    if sampling.greedy or probs is None:
        return partial(accept_matching, sampling=sampling, first_position=first_position,
                       parents=parents)
    if parents is not None:
        return partial(accept_tree_by_rejection_sampling, sampling=sampling,
                       generator=generator, draft_probs=probs, parents=parents)
    return partial(accept_by_rejection_sampling, sampling=sampling, generator=generator,
                   draft_probs=probs)


def _record(out: GenerationOutput, proposal: Proposal, rnd, sequence_len: int) -> None:
    stats = out.stats
    stats.target_passes += 1
    stats.draft_passes += len(proposal.events)
    stats.record(rnd)  # now stats.rounds is this round's number: its trace step
    out.trace.extend(replace(e, step=stats.rounds) for e in proposal.events)
    out.trace.extend(round_events(stats.rounds, rnd, sequence_len))


def _finish(out: GenerationOutput, seq: list[int], trace: bool) -> GenerationOutput:
    out.tokens = seq[len(out.prompt):]
    out.stats.new_tokens = len(out.tokens)
    out.trace = out.trace if trace else None
    return out


def _check_call(target, prompt, max_new_tokens, sampling, gamma, max_gamma,
                other_caches, tree_size=None) -> int:
    """The positions the target's cache needs: prompt, new tokens, the longest lookahead
    (a tree's pass writes every one of its tokens). Every cache the loop rolls back must
    hold as many."""
    int_at_least("gamma", gamma)
    if tree_size is not None:
        int_at_least("tree_size", tree_size, hint=" (the most tokens a proposed tree holds)")
    if max_gamma is not None:
        int_at_least("max_gamma", max_gamma, gamma, " (the largest γ adaptive γ may reach)")
    lookahead = max(gamma if max_gamma is None else max_gamma, tree_size or 0)
    needed = len(prompt) + max_new_tokens + lookahead
    limit, whose = tightest(target.config.block_size,
                            {name: c.max_len for name, c in (other_caches or {}).items()})
    check_room(needed, limit, f"{len(prompt)} prompt + {max_new_tokens} new + γ",
               "max_new_tokens or gamma", whose)
    return needed


# --- proposer 1: a draft model --------------------------------------------------------
class DraftProposer(Proposer):
    """A small model of the same vocabulary proposes, one pass per token, each chosen as
    the target chooses (argmax, or a draw from the shared `generator`)."""

    def __init__(self, draft, sampling: SamplingParams | None = None,
                 generator: torch.Generator | None = None):
        self.draft = draft
        self.sampling = sampling or SamplingParams()
        self.generator = generator or torch.Generator(draft.device)
        self.cache = KVCache.for_model(draft)  # as long as the draft can see

    @property
    def caches(self) -> dict:
        return {"draft": self.cache}

    def fresh(self) -> DraftProposer:
        return DraftProposer(self.draft, self.sampling, torch.Generator(self.draft.device))

    def propose(self, seq: list[int], k: int) -> Proposal:
        chosen: list[torch.Tensor] = []  # each proposal stays on the device until the end
        probs: list[torch.Tensor] = []
        # Feed what the draft's cache has not seen yet (the last committed token(s)), then
        # each pass its own previous proposal.
        before = self.cache.get_seq_length()
        ids = torch.tensor([seq[before:]], device=self.draft.device)
        for _ in range(k):
            logits = self.draft(ids, cache=self.cache, last_only=True)[0, -1]
            chosen.append(self.sampling.sample(logits, self.generator))
            if not self.sampling.greedy:
                probs.append(self.sampling.probabilities(logits))
            ids = chosen[-1].view(1, 1)
        tokens = torch.stack(chosen).tolist() if chosen else []  # the round's one read back
        events, start = [], before
        for i, token in enumerate(tokens):
            fed = seq[before:] if i == 0 else [tokens[i - 1]]
            events.append(TraceEvent(
                kind="draft", step=0, input_ids=tuple(fed), kv_computed=len(fed),
                positions=tuple(range(start, start + len(fed))), token=token,
                cache_len_before=start, cache_len_after=start + len(fed)))
            start += len(fed)
        if self.sampling.greedy:
            return Proposal(tokens, None, events)
        # q even for no proposal, (0, vocab): a sampled round is then still judged by
        # rejection sampling, its token drawn from the shared stream.
        empty = torch.zeros(0, self.draft.config.vocab_size, device=self.draft.device)
        return Proposal(tokens, torch.stack(probs) if probs else empty, events)


def speculative_generate(target, draft, ids, max_new_tokens: int, gamma: int = 4,
                         temperature: float = 0.0, top_k: int | None = None,
                         seed: int = 0, eos_id: int | None = None, *,
                         adaptive_gamma: bool = False, max_gamma: int = 16,
                         trace: bool = False) -> GenerationOutput:
    """Generate with `draft` proposing `gamma` tokens per round and `target` verifying
    them. `adaptive_gamma` grows γ by one after a fully accepted round, shrinks it by one
    after a rejection (between 1 and `max_gamma`)."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    check_draft(target, draft)
    check_flags(adaptive_gamma=adaptive_gamma)
    int_at_least("max_gamma", max_gamma)  # checked even when unused: a typo is not ignored
    # One seeded stream for the draft's draws and the target's: same seed, same tokens.
    generator = torch.Generator(device=target.device).manual_seed(sp.seed)
    return speculate(target, ids, max_new_tokens, sp, DraftProposer(draft, sp, generator),
                     gamma=gamma, max_gamma=max_gamma if adaptive_gamma else None,
                     generator=generator, trace=trace)


def check_draft(target, draft) -> None:
    """Raise unless `draft` is a model that can propose for `target`."""
    check_model("target", target)
    check_model("draft", draft)
    if (draft.config.vocab_size, draft.device) != (target.config.vocab_size, target.device):
        raise ValueError("the draft must use the target's tokenizer (vocab_size) and device")
