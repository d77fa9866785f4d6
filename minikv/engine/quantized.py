"""A quantized KV cache: keys and values stored as 8- or 4-bit integers, quantized when written
and dequantized when read, so the cache holds 4x (int8) or 8x (int4) fewer bytes than fp32.

Each position's vector, per head, gets one scale (per-token quantization): x ≈ scale * code,
scale = max|x| / (2^(bits-1) - 1), so no element is off by more than scale / 2. A position is
quantized the moment it is written, with nothing else in hand. KIVI (Liu et al. 2024) quantizes
keys per channel instead, because a few key channels are large at every position; but a
channel's scale spans many positions, so KIVI keeps the newest ones in full precision until a
group of them is complete. Values have no such outlier channels and are quantized per token.
"""
from __future__ import annotations

import torch

from . import validate
from .cache import KVCache


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., hs) -> codes (..., hs) uint8 (4 bits: two codes a byte, (..., ceil(hs / 2))) and
    scales (..., 1) in x's dtype."""
    qmax = 2 ** (bits - 1) - 1
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
    """A KVCache whose slots hold integer codes and per-token scales (see the module docstring).
    It appends, crops and forks like a KVCache; `update` returns the dequantized K/V."""

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 *, bits: int = 8, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        validate.quant_bits(bits)
        super().__init__(n_layer, batch_size, n_head, 1, max_len, device=device, dtype=dtype)
        self.bits, self._head_dim, self._dtype = bits, head_dim, dtype
        width = head_dim if bits == 8 else -(-head_dim // 2)
        codes = (batch_size, n_head, max_len, width)
        self.keys = [torch.zeros(codes, device=device, dtype=torch.uint8) for _ in range(n_layer)]
        self.values = [torch.zeros(codes, device=device, dtype=torch.uint8) for _ in range(n_layer)]
        scales = (batch_size, n_head, max_len, 1)
        self.key_scales = [torch.zeros(scales, device=device, dtype=dtype) for _ in range(n_layer)]
        self.value_scales = [torch.zeros_like(s) for s in self.key_scales]

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_len: int | None = None,
                  bits: int = 8) -> QuantizedKVCache:
        cfg = model.config
        max_len = cfg.block_size if max_len is None else max_len
        validate.max_len_for(cfg, max_len)
        return cls(cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_dim, max_len, bits=bits,
                   device=model.device, dtype=model.dtype)

    head_dim = property(lambda self: self._head_dim)
    dtype = property(lambda self: self._dtype)  # what it takes and gives back; codes are uint8

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store (B, n_head, T, head_dim) keys and values; return every live
        position dequantized, (B, n_head, past + T, head_dim)."""
        validate.cache_update(self, key, value, layer_idx)
        start, end = self._length, self._length + key.shape[2]
        with torch.no_grad():
            for x, codes, scales in ((key, self.keys, self.key_scales),
                                     (value, self.values, self.value_scales)):
                codes[layer_idx][:, :, start:end], scales[layer_idx][:, :, start:end] = (
                    quantize(x, self.bits))
        if layer_idx == self.n_layer - 1:
            self._length = end
        return tuple(dequantize(codes[layer_idx][:, :, :end], scales[layer_idx][:, :, :end],
                                self.bits, self._head_dim)
                     for codes, scales in ((self.keys, self.key_scales),
                                           (self.values, self.value_scales)))

    def fork(self) -> QuantizedKVCache:
        twin = QuantizedKVCache(self.n_layer, self.batch_size, self.n_head, self._head_dim,
                                self.max_len, bits=self.bits, device=self.device,
                                dtype=self._dtype)
        mine = self.keys + self.values + self.key_scales + self.value_scales
        theirs = twin.keys + twin.values + twin.key_scales + twin.value_scales
        for src, dst in zip(mine, theirs):
            dst[:, :, :self._length] = src[:, :, :self._length]
        twin._length = self._length
        return twin

    @property
    def nbytes(self) -> int:
        """Bytes of the live codes and scales."""
        per_position = sum(t[:, :, :1].nbytes for t in (self.keys[0], self.values[0],
                                                         self.key_scales[0], self.value_scales[0]))
        return per_position * self._length * self.n_layer

    @property
    def allocated_nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values + self.key_scales + self.value_scales)
