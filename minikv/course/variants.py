"""Course variants of the target that cache less, each made from its weights by a documented
conversion, then trained briefly ("uptraining") so the model adapts:

- fewer K/V heads (chapter 07), as the GQA paper does (Ainslie et al. 2023): mean-pool each
  group's key and value projections into one head;
- a latent instead of K and V (MLA, chapter 12): the stacked key and value projections
  factored by a truncated SVD, the factor that reads the input becoming the latent's
  down-projection and the other the heads' up-projections;
- layers that share K/V (cross-layer attention, chapter 12): the upper layer of each pair
  drops its key and value projections and reads the lower layer's."""
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


def low_rank_kv(model: GPT, rank: int) -> GPT:
    """A copy of `model` (a GPT-2 block: learned positions, every K/V head) with multi-head
    latent attention of latent width `rank`. Each layer's W = [W_K; W_V] (2C x C) is
    factored by its singular value decomposition kept to the `rank` largest values,
    W ≈ U S Vᵀ: the down-projection (the latent c = S½ Vᵀ x) and the up-projections (head
    i's key and value, from the rows of U S½) — the best rank-`rank` approximation of W.
    The key bias is dropped: it adds q · b_K to every score of a query's row, which the
    softmax ignores. The value bias moves into the output: the weights of a row sum to 1, so
    it adds b_V to every head's output, W_O b_V after the output projection."""
    cfg = model.config
    if cfg.positions != "learned" or cfg.kv_heads != cfg.n_head or cfg.kv_lora_rank:
        raise ValueError("low_rank_kv converts a GPT-2 block with every K/V head (the target)")
    C, nh, hs = cfg.n_embd, cfg.n_head, cfg.head_dim
    latent = GPT(GPTConfig(**{**cfg.to_dict(), "kv_lora_rank": rank}))
    latent = latent.to(model.device, model.dtype)
    state = {}
    for name, tensor in model.state_dict().items():
        prefix, found, leaf = name.rpartition("attn.c_attn.")
        if not found:
            state.setdefault(name, tensor)  # (a c_proj.bias already holds the value bias)
            continue
        if leaf == "bias":
            b_q, _, b_v = tensor.split(C)
            state[prefix + "attn.q_proj.bias"] = b_q
            state[prefix + "attn.kv_a_proj_with_mqa.bias"] = torch.zeros(rank)
            out = model.state_dict()[prefix + "attn.c_proj.weight"]
            state[prefix + "attn.c_proj.bias"] = (
                model.state_dict()[prefix + "attn.c_proj.bias"] + out @ b_v)
            continue
        w_q, w_kv = tensor.split([C, 2 * C])
        u, s, vh = torch.linalg.svd(w_kv.double(), full_matrices=False)
        root = s[:rank].sqrt()
        down, up = root[:, None] * vh[:rank], u[:, :rank] * root  # (rank, C), (2C, rank)
        # kv_b_proj's rows, head by head: its key's hs rows, then its value's
        up = torch.stack([up[:C].view(nh, hs, rank), up[C:].view(nh, hs, rank)], dim=1)
        state[prefix + "attn.q_proj.weight"] = w_q
        state[prefix + "attn.kv_a_proj_with_mqa.weight"] = down.to(tensor.dtype)
        state[prefix + "attn.kv_b_proj.weight"] = up.reshape(-1, rank).to(tensor.dtype)
    latent.load_state_dict(state)  # strict: every tensor has its place
    return latent.eval()


def share_kv_layers(model: GPT, layers: int = 2) -> GPT:
    """A copy of `model` in which each group of `layers` adjacent layers reads one K/V (the
    lowest layer's: it is made from that layer's input); the upper layers keep their query
    projections and drop their key and value ones. Every other tensor is copied."""
    cfg = model.config
    if cfg.layers_per_kv != 1 or cfg.kv_lora_rank:
        raise ValueError("share_kv_layers converts a model whose layers each make K/V")
    shared = GPT(GPTConfig(**{**cfg.to_dict(), "layers_per_kv": layers}))
    shared = shared.to(model.device, model.dtype)
    state = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) and int(parts[2]) % layers:
            tensor = tensor[:cfg.n_embd]  # the queries' rows only
        state[name] = tensor
    shared.load_state_dict(state)
    return shared.eval()
