"""Column-parallel linear layers: tensor parallelism across CPU cores, for batch-1 decoding.

A decode step at batch size 1 is a chain of matrix-vector products, so its cost is reading the
weights from memory. PyTorch computes an fp32 matrix-vector product on ONE core, which streams far
less than the memory system can deliver. Splitting each weight by output columns into one slice
per core (what Megatron and vLLM call a column-parallel linear, there across GPUs) turns it into
one batched matmul whose slices run on different cores: about 2x faster decoding on the course's
2-core machine (benchmarks/).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..engine import validate


class ColumnParallelLinear(nn.Module):
    """`nn.Linear`'s y = x Wᵀ + b, with W's output columns split into `parts` slices, each stored
    (in, out / parts) and contiguous, so `torch.bmm` streams every slice on its own core."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        out_features, in_features = linear.weight.shape
        width = -(-out_features // parts)  # ceil: the last slice is padded with zero columns
        weight = linear.weight.detach().new_zeros(parts * width, in_features)
        weight[:out_features] = linear.weight.detach()
        weight = weight.view(parts, width, in_features).transpose(1, 2)  # (parts, in, width)
        # parameters (frozen), so that num_params() of a copy counts its weights
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            bias = linear.bias.detach().new_zeros(parts * width)
            bias[:out_features] = linear.bias.detach()
            self.bias = nn.Parameter(bias.view(parts, 1, width), requires_grad=False)
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, in_features = x.shape
        parts, _, width = self.weight.shape
        xs = x.reshape(1, -1, in_features).expand(parts, -1, -1)  # (parts, rows, in): all rows
        y = (torch.bmm(xs, self.weight) if self.bias is None
             else torch.baddbmm(self.bias, xs, self.weight))  # (parts, rows, width)
        y = y.transpose(0, 1).reshape(-1, parts * width)[:, :self.out_features]  # drop padding
        return y.reshape(*lead, self.out_features)


def column_parallel(model: nn.Module, parts: int | None = None) -> nn.Module:
    """An inference-only copy of `model` with every `nn.Linear` split into `parts` column slices
    (default: one per PyTorch CPU thread). Same greedy tokens; logits differ in the last bits (the
    matmul kernels differ). The copy's LM head is a copy of `wte` (the tie is broken), so keep
    `model` to train or save. On a GPU one matrix-vector product already uses the whole device:
    use the model as it is.
    """
    parts = torch.get_num_threads() if parts is None else parts
    validate.int_at_least("parts", parts, hint=" (slices per linear layer, usually the core count)")
    fast = copy.deepcopy(model).eval()
    for module in list(fast.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, ColumnParallelLinear(child, parts))
    return fast
