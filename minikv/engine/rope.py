"""Rotary position embedding (RoPE, Su et al. 2021), as Llama and Qwen use it. A head's
query and key vectors are cut into hs/2 pairs of numbers, and pair i is turned, like a
clock hand, by the angle position x theta^(-2i/hs): the first pairs turn fast and tell
near positions apart, the last turn slowly and tell far ones apart. Turning q by its
position m and k by its position n makes q.k depend on n - m only, so the model has no
table of positions, and a key turned once, when it is made, never needs turning again
while its position stays what it was (why the cache holds K turned: model.py)."""
from __future__ import annotations

import math

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float,
                scaling: tuple | None = None) -> tuple:
    """cos and sin of each position's turn, (T, hs) or (B, 1, T, hs) for (B, T) positions.
    Pair (i, i + hs/2) turns by position * theta^(-2i/hs) (Llama's layout, as in Hugging
    Face: the pair is a number of the first half and its twin in the second)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, *scaling[1:])
    angles = positions[..., None].float() * inv_freq  # (..., T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hs)
    if angles.dim() == 3:
        angles = angles[:, None]  # a row of positions per sequence: (B, 1, T, hs)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low: float, high: float,
                       context: int) -> torch.Tensor:
    """Llama 3's stretch for long contexts: a pair whose wavelength (2π / its speed) is
    short next to the trained context (under context / high turns) already told positions
    apart in training and keeps its speed; one longer than context / low never finished a
    turn in training, so it turns `factor` times slower, and the pairs between blend the
    two by where their wavelength falls."""
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0, 1)  # 0: slow, 1: fast
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hs) with each pair (x_i, x_{i + hs/2}) turned by its angle."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # each pair, a quarter turn
    return (x * cos + turned * sin).to(x.dtype)


def turn(x: torch.Tensor, by: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, heads, T, hs) turned on by `by` positions ((T,) ints, negative turns back):
    turning by n, then by d, is turning by n + d, so a key made at position n is moved to
    n + d without its input."""
    return rotate(x, *rope_angles(by, x.shape[-1], theta))
