"""Prompt-lookup decoding: speculative decoding with no draft model. The proposals are
the tokens that followed the most recent earlier occurrence of the sequence's last
n-gram; the target verifies them in one pass, in the same round loop (`speculate`). It
pays on text that repeats its own context (code edits, quoted documents, lists) and
costs a little where it proposes wrong."""
from __future__ import annotations

from .records import GenerationOutput
from .sampling import SamplingParams
from .speculative import Proposer, speculate
from .validate import int_at_least


def propose_by_lookup(seq: list[int], gamma: int, ngram: int) -> list[int]:
    """Up to `gamma` tokens that followed the last earlier occurrence of seq's final
    n-gram (trying n = ngram, ngram - 1, ..., 1); [] when it never occurred before."""
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # the most recent occurrence first
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + gamma]
    return []


class PromptLookup(Proposer):
    """propose_by_lookup as a Proposer: it keeps nothing, so one serves every request."""

    def __init__(self, ngram: int = 3):
        self.ngram = int_at_least("ngram", ngram, hint=" (tokens of context the lookup matches)")

    def propose(self, seq: list[int], k: int) -> list[int]:
        return propose_by_lookup(seq, k, self.ngram)


def lookup_generate(target, ids, max_new_tokens: int, gamma: int = 4, ngram: int = 3,
                    eos_id: int | None = None, *,
                    trace: bool = False) -> GenerationOutput:
    """Greedy generation with prompt-lookup proposals, verified by `target`: the output
    is exactly the target's own greedy output. A round with nothing to propose is a plain
    decode step."""
    return speculate(target, ids, max_new_tokens, SamplingParams(eos_id=eos_id),
                     PromptLookup(ngram), gamma=gamma, trace=trace)
