"""Prompt-lookup decoding: speculative decoding with no draft model. The proposals are the tokens
that followed the most recent earlier occurrence of the sequence's last n-gram; the target
verifies them in one pass through the same verify-and-rollback core. It pays on text that repeats
its own context (code edits, quoted documents, lists) and costs a little where it proposes wrong."""
from __future__ import annotations

from functools import partial

import torch

from . import validate
from .cache import KVCache
from .records import GenerationOutput, SpeculativeStats, TraceEvent
from .sampling import SamplingParams
from .verify import accept_matching, round_events, verify_and_commit


def propose_by_lookup(seq: list[int], gamma: int, ngram: int) -> list[int]:
    """Up to `gamma` tokens that followed the last earlier occurrence of seq's final n-gram
    (trying n = ngram, ngram - 1, ..., 1); [] when it never occurred before."""
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # the most recent occurrence first
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + gamma]
    return []


def lookup_generate(target, ids, max_new_tokens: int, gamma: int = 4, ngram: int = 3,
                    eos_id: int | None = None, *, trace: bool = False) -> GenerationOutput:
    """Greedy generation with prompt-lookup proposals, verified by `target`: the output is
    exactly the target's own greedy output."""
    sp = SamplingParams(eos_id=eos_id)
    prompt = validate.token_ids(ids, target.config.vocab_size)
    needed = validate.lookup_call(target, prompt, max_new_tokens, gamma, ngram, sp)
    device, stats, events = target.device, SpeculativeStats(prompt_len=len(prompt)), []
    seq = list(prompt)
    if max_new_tokens == 0:
        return GenerationOutput(prompt, [], stats, events if trace else None, None)
    cache = KVCache.for_model(target, max_len=needed)

    def verifier(rows: list[int], c: KVCache) -> torch.Tensor:
        return target(torch.tensor([rows], device=device), cache=c)[0]  # (rows, vocab)

    with torch.inference_mode():
        # 0. Prefill the target with the prompt: its last logits give the first new token.
        seq.append(int(verifier(prompt, cache)[-1].argmax()))
        stats.target_passes += 1
        events.append(TraceEvent(kind="prefill", step=0, input_ids=tuple(prompt), token=seq[-1],
                                 positions=tuple(range(len(prompt))), cache_len_after=len(prompt),
                                 kv_computed=len(prompt)))
        step = 1
        while len(seq) - len(prompt) < max_new_tokens and seq[-1] != eos_id:
            # 1. Propose what followed the last n-gram before (no model; maybe nothing).
            budget = max_new_tokens - (len(seq) - len(prompt)) - 1
            proposals = propose_by_lookup(seq, min(gamma, budget), ngram)
            # 2. Verify in ONE target pass (with no proposal, a plain decode step), commit, and
            #    roll the cache back behind the last committed token.
            accept = partial(accept_matching, sampling=sp, first_position=len(seq))
            rnd = verify_and_commit(seq, proposals, cache, verifier, accept)
            stats.target_passes += 1
            stats.record(rnd)
            events.extend(round_events(step, rnd, len(seq)))
            if eos_id in seq[len(prompt):]:
                del seq[seq.index(eos_id, len(prompt)) + 1:]
            step += 1
    stats.new_tokens = len(seq) - len(prompt)
    return GenerationOutput(prompt=prompt, tokens=seq[len(prompt):], stats=stats,
                            trace=events if trace else None, logits=None)
