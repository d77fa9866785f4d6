"""Speculative decoding (seed 004): a cheap draft proposes γ tokens, the target verifies them
in one pass. Greedy output is exactly the target's own; with temperature > 0 the rejection rule
keeps the target's distribution. It pays when scoring γ + 1 positions costs the target about one
decode step and the draft is cheap and usually right."""
from __future__ import annotations

from functools import partial

import torch

from . import validate
from .cache import KVCache
from .records import GenerationOutput, SpeculativeStats, TraceEvent
from .sampling import SamplingParams
from .verify import accept_by_rejection_sampling, accept_matching, round_events, verify_and_commit


def speculative_generate(target, draft, ids, max_new_tokens: int, gamma: int = 4,
                         temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                         eos_id: int | None = None, *, adaptive_gamma: bool = False,
                         max_gamma: int = 16, trace: bool = False) -> GenerationOutput:
    """Generate with `draft` proposing `gamma` tokens per round and `target` verifying them.
    `adaptive_gamma` grows γ by one after a fully accepted round, shrinks it by one after a
    rejection (between 1 and `max_gamma`)."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    prompt = validate.token_ids(ids, target.config.vocab_size)
    needed = validate.speculative_call(target, draft, prompt, max_new_tokens, gamma, sp,
                                       adaptive_gamma, max_gamma)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(sp.seed)
    stats = SpeculativeStats(prompt_len=len(prompt))
    events: list[TraceEvent] = []
    seq = list(prompt)
    if max_new_tokens == 0:
        return GenerationOutput(prompt, [], stats, events if trace else None, None)
    t_cache = KVCache.for_model(target, max_len=needed)
    d_cache = KVCache.for_model(draft, max_len=needed)

    def verifier(rows: list[int], cache: KVCache) -> torch.Tensor:
        return target(torch.tensor([rows], device=device), cache=cache)[0]  # (rows, vocab)

    def run(model, cache, tokens: list[int]) -> torch.Tensor:
        return model(torch.tensor([tokens], device=device), cache=cache, last_only=True)[0, -1]

    with torch.inference_mode():
        # 0. Prefill the target with the prompt: its last logits give the first new token.
        seq.append(int(sp.sample(run(target, t_cache, prompt), generator)))
        stats.target_passes += 1
        events.append(TraceEvent(kind="prefill", step=0, input_ids=tuple(prompt),
                                 positions=tuple(range(len(prompt))), cache_len_after=len(prompt),
                                 kv_computed=len(prompt), token=seq[-1]))
        step = 1
        while len(seq) - len(prompt) < max_new_tokens and seq[-1] != sp.eos_id:
            g = min(gamma, max_new_tokens - (len(seq) - len(prompt)) - 1)  # stay in the budget
            # 1. Draft: one pass per proposal. Each feeds whatever the draft's cache has not
            #    seen yet: the last committed token(s), then its own previous proposal.
            proposals, draft_probs = [], []
            for _ in range(g):
                pending = (seq + proposals)[d_cache.get_seq_length():]
                before = d_cache.get_seq_length()
                d_logits = run(draft, d_cache, pending)
                proposals.append(int(sp.sample(d_logits, generator)))
                if not sp.greedy:
                    draft_probs.append(sp.probabilities(d_logits))
                stats.draft_passes += 1
                events.append(TraceEvent(
                    kind="draft", step=step, input_ids=tuple(pending), kv_computed=len(pending),
                    positions=tuple(range(before, before + len(pending))), token=proposals[-1],
                    cache_len_before=before, cache_len_after=d_cache.get_seq_length()))
            # 2. Verify: the target scores every proposal in ONE pass; the accepted prefix and
            #    the target's own token are committed; both caches roll back behind them.
            if sp.greedy:
                accept = partial(accept_matching, sampling=sp, first_position=len(seq))
            else:
                accept = partial(accept_by_rejection_sampling, sampling=sp, generator=generator,
                                 draft_probs=torch.stack(draft_probs) if draft_probs else None)
            rnd = verify_and_commit(seq, proposals, t_cache, verifier, accept,
                                    other_caches={"draft": d_cache})
            # 3. Record the round; adapt γ; stop after EOS.
            stats.target_passes += 1
            stats.record(rnd)
            events.extend(round_events(step, rnd, len(seq)))
            if adaptive_gamma:
                all_ok = rnd.verdict.accepted == g
                gamma = min(gamma + 1, max_gamma) if all_ok else max(gamma - 1, 1)
            if sp.eos_id in seq[len(prompt):]:
                del seq[seq.index(sp.eos_id, len(prompt)) + 1:]
            step += 1
    stats.new_tokens = len(seq) - len(prompt)
    return GenerationOutput(prompt=prompt, tokens=seq[len(prompt):], stats=stats,
                            trace=events if trace else None, logits=None)
