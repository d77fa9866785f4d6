"""A quantized KV cache: keys and values stored as 8- or 4-bit integers, quantized when
written and dequantized when read, so the cache holds 4x (int8) or 8x (int4) fewer bytes
than fp32.

Each position's vector, per head, gets one scale (per-token quantization): x ≈ scale *
code, scale = max|x| / (2^(bits-1) - 1), so no element is off by more than scale / 2. A
position is quantized the moment it is written, with nothing else in hand. KIVI
(Liu et al. 2024) quantizes keys per channel instead, because a few key channels are
large at every position; but a channel's scale spans many positions, so KIVI keeps the
newest ones in full precision until a group of them is complete. Values have no such
outlier channels and are quantized per token.
"""
from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import KVCache, check_kv, zeros
from .validate import one_of


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., hs) -> codes (..., hs) uint8 (4 bits: two codes a byte, (..., ceil(hs / 2)))
    and scales (..., 1) in x's dtype."""
    qmax = 2 ** (bits - 1) - 1
    if x.shape[-1] == 0:  # MLA's values: none stored, so nothing to scale
        return x.to(torch.uint8), x
    scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / qmax
    codes = (torch.round(x / scale).clamp(-qmax, qmax) + qmax + 1).to(torch.uint8)  # 1..2qmax+1
    if bits == 4:  # pack pairs: the even element in the low nibble, the odd one in the high
        codes = torch.nn.functional.pad(codes, (0, codes.size(-1) % 2))
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """The inverse of quantize, up to rounding: (..., head_dim) in the scales' dtype."""
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)[..., :head_dim]
    return (codes.to(scale.dtype) - 2 ** (bits - 1)) * scale


class QuantizedKVCache(KVCache):
    """A KVCache whose slots hold integer codes and per-token scales
    (see the module docstring). It appends, crops and forks like a KVCache; `update`
    returns the dequantized K/V, in `dtype`."""

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 *, bits: int = 8, value_dim: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.bits = one_of("bits", bits, (8, 4))  # int8 or int4 codes
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, value_dim=value_dim,
                         device=device, dtype=dtype)

    def _allocate(self, n_layer: int, batch_size: int, n_head: int, max_len: int,
                  device) -> None:
        def codes(width):  # 2 codes a byte at 4 bits; no scale where there is nothing (MLA's V)
            return (batch_size, n_head, max_len, width if self.bits == 8 else -(-width // 2))
        scales = (batch_size, n_head, max_len)
        self.keys = zeros(n_layer, codes(self.head_dim), device, torch.uint8)
        self.values = zeros(n_layer, codes(self.value_dim), device, torch.uint8)
        self.key_scales = zeros(n_layer, (*scales, 1), device, self.dtype)
        self.value_scales = zeros(n_layer, (*scales, min(1, self.value_dim)), device, self.dtype)

    def _buffers(self) -> list[torch.Tensor]:
        return self.keys + self.values + self.key_scales + self.value_scales

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store (B, n_head, T, head_dim) keys and values; return every live
        position dequantized, (B, n_head, past + T, head_dim)."""
        if not self.checked:  # a call of one's own; a model's pass was checked up front
            check_kv(self, key, value, layer_idx)
            self._check_room(key.shape[2])
        start = self._length
        end = start + key.shape[2]
        stores = ((key, self.keys, self.key_scales), (value, self.values, self.value_scales))
        with torch.no_grad():
            for x, codes, scales in stores:
                codes[layer_idx][:, :, start:end], scales[layer_idx][:, :, start:end] = (
                    quantize(x, self.bits))
        if layer_idx == self.n_layer - 1:
            self._length = end
        return tuple(dequantize(codes[layer_idx][:, :, :end], scales[layer_idx][:, :, :end],
                                self.bits, width)
                     for (_, codes, scales), width in zip(stores, (self.head_dim,
                                                                   self.value_dim)))


# --- the weights too (chapter 01: a decode step reads every weight once) ----------------
class WeightOnlyLinear(nn.Module):
    """nn.Linear's y = x Wᵀ + b with W kept as the codes `quantize` makes: int8 with one
    scale per output row, or int4 with one per `group` inputs of a row (a row's range is
    set by its largest weight; a group's by the largest of its 32). Weight-only: the
    activations stay in their dtype. `fused` runs torch's own kernels for this layout
    (CPU: int8 and int4; elsewhere int8), which read the codes as they multiply and take
    the activations in bfloat16; unfused, W is dequantized first (the reference: exact up
    to the codes' rounding, but it reads more bytes than it saves)."""

    def __init__(self, linear: nn.Linear, bits: int = 8, group: int = 32,
                 fused: bool = False):
        super().__init__()
        self.bits, self.group, self.fused = one_of("bits", bits, (8, 4)), group, fused
        w, (n, k) = linear.weight.detach(), linear.weight.shape
        if bits == 4 and k % group:
            raise ValueError(f"int4 groups of {group} must divide the {k} inputs")
        codes, scale = quantize(w if bits == 8 else w.view(n, k // group, group), bits)
        self.register_buffer("codes", codes)  # (n, k) bytes; int4: (n, k / group, group / 2)
        self.register_buffer("scale", scale)  # (n, 1); int4: (n, k / group, 1)
        self.bias, self.in_features = linear.bias, k
        if fused:
            self._pack()

    def dequantized(self) -> torch.Tensor:
        """W, dequantized: (out, in) in the scales' dtype."""
        w = dequantize(self.codes, self.scale, self.bits, self.group if self.bits == 4 else
                       self.in_features)
        return w.reshape(-1, self.in_features)

    def _pack(self) -> None:
        """The layouts torch's kernels read: signed int8 and a scale a row; int4 packed for
        the CPU kernel, each group's scale and zero (our codes are symmetric: zero 0)."""
        if self.bits == 8:
            self.packed = (self.codes.view(torch.int8) ^ -128, self.scale[:, 0].bfloat16())
            return
        if self.codes.device.type != "cpu":
            raise ValueError("the fused int4 kernel here is the CPU's: fused=False elsewhere")
        q = torch.stack((self.codes & 15, self.codes >> 4), -1).flatten(-2)  # 1..15, 8 = 0
        pad = -q.shape[0] % 16  # the kernel takes rows 16 at a time: zero rows past the end
        q = F.pad(q.reshape(-1, self.in_features).to(torch.int32), (0, 0, 0, pad), value=8)
        scale = F.pad(self.scale[..., 0].T.bfloat16(), (0, pad))  # (k / group, n + pad)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.packed = (packed, torch.stack((scale, torch.zeros_like(scale)), -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return F.linear(x, self.dequantized(), self.bias)
        shape, x2 = x.shape, x.reshape(-1, self.in_features).bfloat16()
        if self.bits == 8:
            y = torch._weight_int8pack_mm(x2, *self.packed)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed[0], self.group,
                                                  self.packed[1])[:, :self.codes.shape[0]]
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_weights(model: nn.Module, bits: int = 8, group: int = 32,
                     fused: bool = False) -> nn.Module:
    """A copy of `model` with every linear layer's weight kept as int8 or int4 codes
    (WeightOnlyLinear), the head's too (its tie to the embeddings cut: the embeddings stay
    as they are, a step reads one row of them); `model` is left as it was."""
    copy = deepcopy(model)
    for module in list(copy.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, WeightOnlyLinear(child, bits, group, fused))
    return copy
