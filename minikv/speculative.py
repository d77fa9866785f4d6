"""Speculative decoding (seed 004): a cheap draft proposes γ tokens, the target verifies them in one pass.

Greedy output is exactly the target's own greedy output; with temperature > 0 the rejection rule keeps
the target's distribution. The speed-up comes from the target scoring γ + 1 positions for about the
price of one decode step, and is worth it when the draft is cheap and usually right.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import KVCache
from .generate import GenerationOutput, as_token_list
from .sampling import check_sampling_args, probabilities, sample
from .trace import TraceEvent
from .verify import VerifyStats, greedy_or_sampled, judge_by_match, judge_by_rejection, round_events, verify_and_commit


@dataclass
class SpeculativeStats(VerifyStats):
    prompt_len: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # the prefill plus one verification per round
    draft_passes: int = 0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / max(self.target_passes, 1)


def check_pair(target, draft) -> None:
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}): both must use the same tokenizer")
    if target.device != draft.device:
        raise ValueError(f"draft is on {draft.device} but the target is on {target.device}; move both to one device")


def speculative_generate(target, draft, ids, max_new_tokens: int, gamma: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, seed: int = 0, eos_id: int | None = None, *,
                         adaptive_gamma: bool = False, max_gamma: int = 16, trace: bool = False) -> GenerationOutput:
    """Generate with `draft` proposing `gamma` tokens per round and `target` verifying them.

    `adaptive_gamma` grows γ by one after a fully accepted round and shrinks it by one after a rejection
    (between 1 and `max_gamma`).
    """
    check_pair(target, draft)
    prompt = as_token_list(ids, target.config.vocab_size)
    for name, value, low in (("gamma", gamma, 1), ("max_gamma", max_gamma, gamma), ("max_new_tokens", max_new_tokens, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    check_sampling_args(temperature, top_k)
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < target.config.vocab_size):
        raise ValueError(f"eos_id must be a token id in [0, {target.config.vocab_size}) or None, got {eos_id!r}")
    needed = len(prompt) + max_new_tokens + (max_gamma if adaptive_gamma else gamma)
    limit = min(target.config.block_size, draft.config.block_size)
    if needed > limit:
        raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens + γ lookahead needs {needed} positions "
                         f"> block_size={limit}; lower max_new_tokens or gamma")

    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    greedy = greedy_or_sampled(0.0, None, 0, device)
    stats = SpeculativeStats(prompt_len=len(prompt))
    events: list[TraceEvent] = []
    seq = list(prompt)
    if max_new_tokens == 0:
        return GenerationOutput(prompt, [], stats, events if trace else None, None)
    t_cache = KVCache.for_model(target, max_len=needed)
    d_cache = KVCache.for_model(draft, max_len=needed)

    def verifier(rows: list[int], cache: KVCache) -> torch.Tensor:
        return target(torch.tensor([rows], device=device), cache=cache)[0]  # (rows, vocab): ONE target pass

    with torch.inference_mode():
        logits = target(torch.tensor([prompt], device=device), cache=t_cache, last_only=True)[0, -1]
        seq.append(int(sample(logits, temperature, top_k, generator)))
        stats.target_passes += 1
        events.append(TraceEvent(step=0, kind="prefill", input_ids=tuple(prompt), positions=tuple(range(len(prompt))),
                                 cache_len_before=0, cache_len_after=len(prompt), kv_computed=len(prompt),
                                 token=seq[-1], detail={"model": "target"}))
        step = 1
        while len(seq) - len(prompt) < max_new_tokens and seq[-1] != eos_id:
            g = min(gamma, max_new_tokens - (len(seq) - len(prompt)) - 1)  # never propose past the budget
            proposals, draft_probs = [], []
            for _ in range(g):
                pending = (seq + proposals)[d_cache.get_seq_length():]  # catch up on whatever it has not seen
                before = d_cache.get_seq_length()
                d_logits = draft(torch.tensor([pending], device=device), cache=d_cache, last_only=True)[0, -1]
                proposals.append(int(sample(d_logits, temperature, top_k, generator)))
                if temperature > 0:
                    draft_probs.append(probabilities(d_logits, temperature, top_k))
                stats.draft_passes += 1
                events.append(TraceEvent(step=step, kind="draft", input_ids=tuple(pending),
                                         positions=tuple(range(before, before + len(pending))), cache_len_before=before,
                                         cache_len_after=d_cache.get_seq_length(), kv_computed=len(pending),
                                         token=proposals[-1], detail={"model": "draft"}))
            judge = (judge_by_match(greedy, len(seq)) if temperature == 0 else
                     judge_by_rejection(torch.stack(draft_probs) if draft_probs else None, temperature, top_k, generator))
            rnd = verify_and_commit(seq, proposals, t_cache, verifier, judge, other_caches={"draft": d_cache})
            stats.target_passes += 1
            stats.rounds += 1
            stats.proposed += g
            stats.accepted += rnd.verdict.accepted
            stats.rejected += g - rnd.verdict.accepted
            stats.rollbacks += rnd.rolled_back
            events.extend(round_events(step, rnd, len(seq)))
            if adaptive_gamma:
                gamma = min(gamma + 1, max_gamma) if rnd.verdict.accepted == g else max(gamma - 1, 1)
            if eos_id in seq[len(prompt):]:
                del seq[seq.index(eos_id, len(prompt)) + 1:]
            step += 1
    stats.new_tokens = len(seq) - len(prompt)
    return GenerationOutput(prompt=prompt, tokens=seq[len(prompt):], stats=stats,
                            trace=events if trace else None, logits=None)
