"""Turning a step's logits into the next token: greedy, or seeded sampling with temperature and top-k."""
from __future__ import annotations

import torch


def check_sampling_args(temperature: float, top_k: int | None) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None (no filtering), got {top_k!r}")


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None) -> torch.Tensor:
    """softmax(logits / temperature) over the top_k logits (the rest get probability 0). temperature > 0."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` (..., vocab): argmax when temperature is 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature, top_k)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1])
