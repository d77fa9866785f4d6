"""Turning a step's logits into the next token: greedy, or seeded sampling with
temperature and top-k. One validated `SamplingParams` travels with every request, as in
nano-vllm."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .validate import int_at_least, reads_are_free

# Below this, logits / temperature overflows float32 for ordinary logits, and sampling is
# greedy in all but name anyway: ask for 0.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0    # 0 = greedy (argmax)
    top_k: int | None = None    # sample among the k most likely tokens only
    seed: int = 0               # the same seed gives the same tokens on the same device
    eos_id: int | None = None   # stop after this token

    def __post_init__(self) -> None:
        t = self.temperature
        if type(t) not in (int, float) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE}")
        if self.top_k is not None:
            int_at_least("top_k", self.top_k, hint=" or None (no filtering)")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Once the model is known: eos_id must be one of its token ids (checked here)."""
        if self.eos_id is not None:
            int_at_least("eos_id", self.eos_id, 0, " (a token id) or None", vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits / temperature) over the top_k logits (the rest get 0)."""
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if reads_are_free(probs) and not torch.isfinite(probs).all():  # a GPU would wait
            raise ValueError("sampling failed: the model's logits hold inf or nan (check its "
                             "weights; float16 can overflow: try float32)")
        return probs

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token id per row of `logits` (..., vocab), drawn from `generator`."""
        if self.greedy:
            return logits.argmax(dim=-1)
        probs = self.probabilities(logits)
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        return flat.reshape(probs.shape[:-1])

    def choose(self, logits: torch.Tensor, position: int) -> int:
        """The token at `position` as a pure function of (logits, position): argmax, or a
        draw from a generator seeded by (seed, position). So "the same request" gives the
        same token wherever and with whomever it runs (deterministic requests rely on
        it)."""
        return int(self.draw(logits, position))

    def draw(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """choose()'s token left on the device, so that many are read back at once."""
        if self.greedy:
            return logits.argmax()
        seed = (self.seed * 1_000_003 + position) % 2**63
        return self.sample(logits, torch.Generator(logits.device).manual_seed(seed))


def choose_rows(params: list[SamplingParams], logits: torch.Tensor, positions) -> list[int]:
    """Row i of `logits` (n, vocab) chosen as params[i].choose at positions[i], all read back
    at once (a GPU waits once, not n times)."""
    top = logits.argmax(dim=-1)  # every greedy row's token, in one launch
    return torch.stack([top[i] if p.greedy else p.draw(logits[i], position)
                        for i, (p, position) in enumerate(zip(params, positions))]).tolist()


@dataclass
class Request:
    """What one request asks a server for (serving.serve, serving.Engine): its prompt, how
    many new tokens at most, how to choose them, whether it must be deterministic (the same
    tokens in any batch), and the engine step at which it arrives."""
    prompt: list[int]
    max_new_tokens: int
    deterministic: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0               # seeded per position: the same request, the same draws
    eos_id: int | None = None
    arrival: int = 0            # the engine step at which it arrives

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.seed, self.eos_id)
