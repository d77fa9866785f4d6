"""Course variants of the target with fewer K/V heads, made as the GQA paper does (Ainslie et
al. 2023): mean-pool each group's key and value projections into one head, then train briefly
("uptraining") so the model adapts to sharing them."""
from __future__ import annotations

import torch

from ..engine import GPT, GPTConfig


def mean_pool_kv_heads(model: GPT, n_kv_head: int) -> GPT:
    """A copy of `model` with n_kv_head K/V heads: K/V head j is the mean of the original heads
    j*g .. (j+1)*g - 1 (g = n_head / n_kv_head), the query heads that will share it; queries,
    MLPs, embeddings and LayerNorms are copied unchanged."""
    cfg = model.config
    pooled_cfg = GPTConfig(**{**cfg.to_dict(), "n_kv_head": n_kv_head})  # validates the ratio
    C, hs, H, g = cfg.n_embd, cfg.head_dim, cfg.kv_heads, cfg.kv_heads // n_kv_head
    pooled = GPT(pooled_cfg).to(model.device, model.dtype)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            q, k, v = tensor.split([C, H * hs, H * hs], dim=0)  # rows: Q, then K, then V heads
            # (H * hs, ...) -> (n_kv_head, g, hs, ...) -> mean over the group
            k, v = (t.reshape(n_kv_head, g, hs, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])
                    for t in (k, v))
            tensor = torch.cat([q, k, v], dim=0)
        state[name] = tensor
    pooled.load_state_dict(state)
    return pooled.eval()
