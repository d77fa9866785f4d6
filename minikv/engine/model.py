"""A GPT-2 from scratch, in GPT-2's parameter layout. Without a cache it is the plain
GPT-2 forward pass; the cache adds three lines marked `# KV-CACHE`: append this step's
keys and values, attend over everything cached, and start the position embeddings where
the cache ends."""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention, sdpa
from .cache import Cache
from .config import GPTConfig
from .validate import is_int_tensor


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √hs) v; query i, the last T of L positions, sees keys 0..L-T+i."""
    T, L = q.size(-2), k.size(-2)
    if T == L:  # no cache, or an empty one: the usual lower triangle
        return sdpa(q, k, v, is_causal=True)
    if T == 1:  # one new token may see every cached key: a single unmasked row
        return sdpa(q, k, v)
    # KV-CACHE: T new queries after L - T cached keys: row i sees keys 0 .. L - T + i
    mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
    return sdpa(q, k, v, attn_mask=mask)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.kv_heads
        self.head_dim = cfg.head_dim
        kv = cfg.kv_heads * cfg.head_dim  # = n_embd in GPT-2; less with grouped-query attention
        self.c_attn = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * kv)  # Q, K and V, every head at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: Cache | None, layer_idx: int,
                attention: Attention) -> torch.Tensor:
        B, T, C = x.shape
        hs, kv = self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)  # (B, T, C), 2 x (B, T, kv)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv_head, hs).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hs)
        if cache is not None:
            # KV-CACHE: (B, nkv, past + T, hs); the old K/V are read back, not recomputed
            k, v = cache.update(k, v, layer_idx)
        y = attention(q, k, v)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side: (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2 uses the tanh GELU


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Cache | None, layer_idx: int,
                attention: Attention) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer_idx, attention)  # pre-LayerNorm residuals
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
            wpe=nn.Embedding(config.block_size, config.n_embd),  # learned position embeddings
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scales residual projections by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied head is counted once

    def forward(self, idx: torch.Tensor, cache: Cache | None = None,
                positions: torch.Tensor | None = None, last_only: bool = False,
                attention: Attention = causal_attention) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids `idx` (B, T); (B, 1, vocab) with
        `last_only`. With a cache, K/V of `idx` are appended to it and attention covers
        every cached position. `positions` ((T,) or (B, T)) overrides the position ids
        (`torch.arange(T)` with a cache is the classic bug); `attention` swaps the kernel
        (the batched server's split-KV decode does)."""
        _check_inputs(self, idx, cache, positions)
        T = idx.shape[1]
        if positions is None:
            past = 0 if cache is None else cache.get_seq_length()  # an int, or (B, 1) per row
            positions = past + torch.arange(T, device=idx.device)  # KV-CACHE: continue from past
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, C)
        for layer_idx, block in enumerate(self.transformer.h):
            x = block(x, cache, layer_idx, attention)
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x)  # (B, T, vocab)

    @classmethod
    def from_gpt2_state_dict(cls, state_dict: Mapping[str, torch.Tensor],
                             config: GPTConfig | None = None) -> GPT:
        """Load weights in Hugging Face GPT-2 layout
        (`transformer.h.0.attn.c_attn.weight`, ...). GPT-2's linears are Conv1D,
        (in, out), transposed here to nn.Linear's (out, in). Without `config`, shapes
        come from the tensors and n_head = n_embd / 64 (as in every GPT-2)."""
        sd = {k.removeprefix("transformer."): v for k, v in state_dict.items()
              if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers
        _check_gpt2_state_dict(sd)
        sd.pop("lm_head.weight", None)  # the same tensor as wte.weight
        if config is None:
            vocab, n_embd = sd["wte.weight"].shape
            n_layer = len({k.split(".")[1] for k in sd if k.startswith("h.")})
            config = GPTConfig(vocab_size=vocab, block_size=sd["wpe.weight"].shape[0],
                               n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd)
        model = cls(config)
        conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
        sd = {name: t.t() if name.endswith(conv1d) else t for name, t in sd.items()}
        model.transformer.load_state_dict(sd)  # strict: names a missing, extra or misshapen tensor
        return model


# --- checks: bad input raises before any cache slot is written -------------------------
def _check_inputs(model: GPT, idx, cache, positions) -> None:
    cfg = model.config
    if not is_int_tensor(idx):
        raise TypeError(f"idx must be an integer tensor (torch.tensor([ids])), not {idx!r:.30}")
    if idx.dim() != 2 or idx.shape[1] == 0 or idx.device != model.device:
        raise ValueError(f"idx must have shape (batch, T >= 1), on {model.device}: try idx[None]")
    outside = idx[(idx < 0) | (idx >= cfg.vocab_size)]
    if outside.numel():
        raise ValueError(f"token id {int(outside[0])} is outside the vocabulary "
                         f"[0, {cfg.vocab_size}); encode with the model's own tokenizer")
    B, T = idx.shape
    if not isinstance(cache, (Cache, type(None))):
        raise TypeError(f"cache must be a minikv.KVCache (or a Cache), not {type(cache)}")
    if cache is not None:
        cache.check_fits(cfg, B, T, model.device, model.dtype)
    if positions is None:
        past = 0 if cache is None else cache.get_seq_length()
        longest = int(past.max()) if isinstance(past, torch.Tensor) else past
        if longest + T > cfg.block_size:
            raise ValueError(f"{longest + T} positions exceeds block_size={cfg.block_size}; "
                             f"shorten the prompt")
    elif not (is_int_tensor(positions) and positions.shape in ((T,), (B, T))
              and 0 <= positions.min() and positions.max() < cfg.block_size):
        raise ValueError("positions must be an integer (T,) or (B, T) tensor in [0, block_size)")


def _check_gpt2_state_dict(sd: dict) -> None:
    wte = sd.get("wte.weight")
    if wte is None or not torch.equal(sd.get("lm_head.weight", wte), wte):
        raise ValueError("not a GPT-2 state dict: no wte.weight, or lm_head.weight not tied to it")
