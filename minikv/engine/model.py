"""A GPT-2 from scratch, in GPT-2's parameter layout. Without a cache it is the plain
GPT-2 forward pass; the cache adds three lines marked `# KV-CACHE`: append this step's
keys and values, attend over everything cached, and start the position embeddings where
the cache ends. The same model with a Llama-style block (config.LLAMA: rotary positions,
RMSNorm, a SwiGLU MLP, no biases) is a config choice, not a second model."""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention, sdpa
from .cache import Cache, check_cache
from .config import LLAMA, GPTConfig
from .rope import rope_angles, rotate
from .validate import check_flags, is_int_tensor, reads_are_free


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
    def __init__(self, cfg: GPTConfig, makes_kv: bool = True):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.share, self.makes_kv = cfg.layers_per_kv, makes_kv
        # = n_embd in GPT-2; less with grouped-query attention; none in the upper layers of a
        # cross-layer group, which read the K/V of the group's lowest layer
        kv = cfg.kv_heads * cfg.head_dim if makes_kv else 0
        # Q, K and V, every head at once (q: n_embd wide unless head_size is set)
        q = cfg.n_head * cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, q + 2 * kv, bias=cfg.qkv_biased)
        self.c_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        if cfg.qk_norm:  # Qwen3: each head's q and k scaled to one size before they turn
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.layer_norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.layer_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cache: Cache | None, layer_idx: int,
                attention: Attention, rope: tuple | None = None,
                shared: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hs, kv = self.head_dim, self.n_kv_head * self.head_dim * self.makes_kv
        C = self.n_head * hs  # = n_embd in GPT-2
        q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)  # (B, T, C), 2 x (B, T, kv)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.qk_norm:
            q = self.q_norm(q)  # over hs, each head alone
        if rope is not None:  # RoPE: turn q by its positions (k in keys_values)
            q = rotate(q, *rope)
        k, v = self.keys_values(k, v, cache, layer_idx, rope, shared)
        y = attention(q, k, v)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side: (B, T, C)

    def keys_values(self, k, v, cache, layer_idx, rope, shared) -> tuple:
        """This pass's K/V, (B, nkv, T, hs), and every cached one's: (B, nkv, past + T, hs)."""
        layer = layer_idx // self.share  # cross-layer attention: a group shares a cache layer
        if not self.makes_kv:  # an upper layer of a group: the lowest one made and cached them
            return read_shared(shared, layer)
        B, T, _ = k.shape
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2) for t in (k, v))
        if self.qk_norm:
            k = self.k_norm(k)  # cached normed and turned, as it is used
        if rope is not None:
            # K is cached turned: a key's turn depends on its own position only, so it is
            # done once, when the key is made; cached unturned, every key would be turned
            # again in every pass (window.py's "reindex").
            k = rotate(k, *rope)
        if cache is not None:
            # KV-CACHE: (B, nkv, past + T, hs); the old K/V are read back, not recomputed
            k, v = cache.update(k, v, layer)
        if shared is not None:
            shared[layer] = k, v  # for the layers above that read them
        return k, v


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): each position caches one
    latent c (kv_lora_rank wide, shared by every head) instead of keys and values; head i's
    key and value are c's up-projections W_UK[i] c and W_UV[i] c. Under RoPE a small key,
    turned and shared by the heads, is cached beside c, and each query has a part that
    turns against it. DeepSeek also compresses the queries and normalises c; not here.

    Two forms, equal up to rounding. Naive (prefill): every cached c expanded to its
    keys and values, then ordinary attention. Absorbed (decode, one new token): q[i] · W_UK[i]
    c = (q[i] W_UK[i]) · c, so the query is moved into the latent's space instead and
    attention runs over the cached latents as one K/V head (multi-query attention, V being c
    itself); W_UV[i] is applied after, to one row per head. The cache is never expanded."""

    def __init__(self, cfg: GPTConfig, makes_kv: bool = True):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.rank, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.share, self.makes_kv = cfg.layers_per_kv, makes_kv
        width = self.rank + self.rope_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * (cfg.head_dim + self.rope_dim),
                                bias=cfg.bias)
        if makes_kv:  # (DeepSeek's names) the latent, and the RoPE key beside it
            self.kv_a_proj_with_mqa = nn.Linear(cfg.n_embd, width, bias=cfg.bias)
        self.kv_b_proj = nn.Linear(self.rank, cfg.n_head * 2 * cfg.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, cache: Cache | None, layer_idx: int,
                attention: Attention, rope: tuple | None = None,
                shared: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, hs, dc = self.n_head, self.head_dim, self.rank
        q = self.q_proj(x).view(B, T, nh, hs + self.rope_dim).transpose(1, 2)  # (B, nh, T, ..)
        latent = self.latent(x, cache, layer_idx, rope, shared)  # (B, 1, past + T, dc + dr)
        if rope is not None:  # the query's RoPE part turns; the rest meets the latent
            q = torch.cat([q[..., :hs], rotate(q[..., hs:], *rope)], dim=-1)
        w_uk, w_uv = self.kv_b_proj.weight.view(nh, 2, hs, dc).unbind(1)  # (nh, hs, dc) each
        if T == 1:  # absorbed: (B, nh, 1, dc + dr) queries against the latents themselves
            q = torch.cat([q[..., :hs] @ w_uk, q[..., hs:]], dim=-1)
            # the kernel divides by √(dc + dr); the naive form's scale is 1 / √(hs + dr)
            q = q * math.sqrt((dc + self.rope_dim) / (hs + self.rope_dim))
            y = attention(q, latent, latent[..., :dc]) @ w_uv.transpose(1, 2)  # (B, nh, 1, hs)
        else:  # naive: each head's keys (B, nh, L, hs + dr) and values (B, nh, L, hs)
            c, k_rope = latent[..., :dc], latent[..., dc:]
            k = torch.cat([c @ w_uk.transpose(1, 2), k_rope.expand(-1, nh, -1, -1)], dim=-1)
            y = attention(q, k, c @ w_uv.transpose(1, 2))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, nh * hs))

    def latent(self, x, cache, layer_idx, rope, shared) -> torch.Tensor:
        """The latents this pass reads, cached ones first: (B, 1, past + T, dc + dr)."""
        layer = layer_idx // self.share
        if not self.makes_kv:  # cross-layer: the group's lowest layer made and cached them
            return read_shared(shared, layer)
        latent = self.kv_a_proj_with_mqa(x)[:, None]  # (B, 1, T, dc + dr)
        if rope is not None:  # only the RoPE key turns; c must not (see _check_mla)
            latent = torch.cat([latent[..., :self.rank],
                                rotate(latent[..., self.rank:], *rope)], dim=-1)
        if cache is not None:
            # KV-CACHE: one latent per position, as one head; no values (V is read from c)
            latent, _ = cache.update(latent, latent[..., :0], layer)
        if shared is not None:
            shared[layer] = latent
        return latent


def read_shared(shared: dict | None, layer: int):
    if shared is None or layer not in shared:
        raise ValueError("this layer reads the K/V of the layer below it (layers_per_kv > 1): "
                         "run the whole model, or pass the blocks one shared dict")
    return shared[layer]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.n_inner or 4 * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        width = 2 * hidden if self.swiglu else hidden  # SwiGLU: gate and up side by side
        self.c_fc = nn.Linear(cfg.n_embd, width, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.c_proj(F.silu(gate) * up)  # Llama: the gate decides what passes
        return self.c_proj(F.gelu(h, approximate="tanh"))  # GPT-2 uses the tanh GELU


def norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":  # x / rms(x) * weight: no mean taken, no bias
        return nn.RMSNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, makes_kv: bool = True):
        super().__init__()
        self.ln_1 = norm(cfg)
        kind = LatentAttention if cfg.kv_lora_rank is not None else CausalSelfAttention
        self.attn = kind(cfg, makes_kv)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Cache | None, layer_idx: int,
                attention: Attention, rope: tuple | None = None,
                shared: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer_idx, attention, rope, shared)  # pre-norm
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig (GPTConfig.preset('tiny')), not "
                            f"{type(config).__name__}")
        self.config = config
        layers = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))  # token embeddings
        if config.positions == "learned":  # one learned vector per position (RoPE has none)
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        layers["h"] = nn.ModuleList(Block(config, makes_kv=i % config.layers_per_kv == 0)
                                    for i in range(config.n_layer))
        layers["ln_f"] = norm(config)
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tied_head:  # tied, as in GPT-2 and the smallest Llamas and Qwens
            self.lm_head.weight = self.transformer.wte.weight
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
        return self.transformer.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:  # the embeddings' (a weight-quantized head has codes)
        return self.transformer.wte.weight.dtype

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
        check_flags(last_only=last_only)
        x = self.features(idx, cache, positions, attention)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x)  # (B, T, vocab)

    def features(self, idx: torch.Tensor, cache: Cache | None = None,
                 positions: torch.Tensor | None = None,
                 attention: Attention = causal_attention) -> torch.Tensor:
        """The last hidden states (B, T, n_embd), after the final norm: what lm_head reads,
        and what a feature-level draft head (eagle.py) learns to predict."""
        check_cache(cache)
        # One thread at a time in a cache: another's pass would interleave its positions.
        with cache.in_use() if cache is not None else nullcontext():
            _check_inputs(self, idx, cache, positions)  # once, for every layer of the pass
            if positions is None:
                past = 0 if cache is None else cache.get_seq_length()
                # KV-CACHE: go on from past
                positions = past + torch.arange(idx.shape[1], device=idx.device)
            return self.blocks(idx, cache, positions, attention)

    def blocks(self, idx: torch.Tensor, cache: Cache | None, positions: torch.Tensor,
               attention: Attention) -> torch.Tensor:
        """The pass itself, its inputs checked (by features): the embeddings, every block,
        the final norm. What static.py's compiled step traces."""
        x, rope = self.transformer.wte(idx), None  # (B, T, C)
        if self.config.positions == "learned":
            x = x + self.transformer.wpe(positions)
        else:  # RoPE: the positions turn q and k inside attention instead
            turned = self.config.qk_rope_head_dim or self.config.head_dim  # MLA: its key
            rope = rope_angles(positions, turned, self.config.rope_theta,
                               self.config.rope_scaling)
        shared = {}  # cross-layer attention: each group's K/V, for its upper layers
        for layer_idx, block in enumerate(self.transformer.h):
            x = block(x, cache, layer_idx, attention, rope, shared)
        return self.transformer.ln_f(x)

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

    @classmethod
    def from_llama_state_dict(cls, state_dict: Mapping[str, torch.Tensor],
                              config: GPTConfig) -> GPT:
        """Load weights in Hugging Face Llama layout (`model.layers.0.self_attn.q_proj.weight`,
        ...), Qwen2's and Qwen3's too, into a model of `config` (a Llama-style block:
        config.LLAMA's choices; head, q/k/v biases and q/k norms as it says). q, k and
        v are stacked into c_attn (their biases too), gate and up into c_fc."""
        if (config.positions, config.norm, config.mlp, config.bias) != tuple(LLAMA.values()):
            raise ValueError(f"a Llama needs GPTConfig(**LLAMA choices) {LLAMA}, not {config}")
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        wte = _take(sd, "embed_tokens.weight")
        ours = {"wte.weight": wte, "ln_f.weight": _take(sd, "norm.weight")}
        head = sd.pop("lm_head.weight", wte if config.tied_head else None)
        if head is None or (config.tied_head and not torch.equal(head, wte)):
            raise ValueError("lm_head.weight is missing, or it is not tied to "
                             "embed_tokens.weight: set config.tied_head as the file is")
        for i in range(config.n_layer):
            def take(*names: str, part: str = "weight") -> torch.Tensor:  # by rows
                return torch.cat([_take(sd, f"layers.{i}.{n}.{part}") for n in names])
            qkv = [f"self_attn.{x}_proj" for x in "qkv"]
            ours |= {f"h.{i}.ln_1.weight": take("input_layernorm"),
                     f"h.{i}.attn.c_attn.weight": take(*qkv),
                     f"h.{i}.attn.c_proj.weight": take("self_attn.o_proj"),
                     f"h.{i}.ln_2.weight": take("post_attention_layernorm"),
                     f"h.{i}.mlp.c_fc.weight": take("mlp.gate_proj", "mlp.up_proj"),
                     f"h.{i}.mlp.c_proj.weight": take("mlp.down_proj")}
            if config.qkv_biased:
                ours[f"h.{i}.attn.c_attn.bias"] = take(*qkv, part="bias")
            if config.qk_norm:
                ours |= {f"h.{i}.attn.{x}_norm.weight": take(f"self_attn.{x}_norm")
                         for x in "qk"}
        if sd:
            raise ValueError(f"tensors this model has no place for: {sorted(sd)[:4]}")
        model = cls(config)
        model.transformer.load_state_dict(ours)  # strict: names a misshapen tensor
        if not config.tied_head:
            model.lm_head.load_state_dict({"weight": head})
        return model


# --- checks: bad input raises before any cache slot is written -------------------------
def _check_inputs(model: GPT, idx, cache, positions) -> None:
    """Shapes, types and devices, read off the tensors; their values too, but only on a CPU:
    a GPU would stall on every read back, so the decoders check token ids once, as Python
    ints, where they come in."""
    cfg = model.config
    if not is_int_tensor(idx):
        raise TypeError(f"idx must be an integer tensor (torch.tensor([ids])), not {idx!r:.30}")
    if idx.dim() != 2 or idx.shape[1] == 0 or idx.device != model.device:
        raise ValueError(f"idx must have shape (batch, T >= 1), on {model.device}: try idx[None]")
    B, T = idx.shape
    if cache is not None:
        cache.check_fits(cfg, B, T, model.device, model.dtype)
    if positions is None:
        past = 0 if cache is None else cache.get_seq_length()
        if past + T > cfg.block_size:
            raise ValueError(f"{past + T} positions exceeds block_size={cfg.block_size}; "
                             f"shorten the prompt")
    elif not (is_int_tensor(positions) and positions.shape in ((T,), (B, T))):
        raise ValueError("positions must be an integer (T,) or (B, T) tensor in [0, block_size)")
    if reads_are_free(idx):  # on a GPU, reading ids back would wait for it
        _check_values(cfg, idx, positions)


def _check_values(cfg, idx: torch.Tensor, positions: torch.Tensor | None) -> None:
    low, high = torch.aminmax(idx)
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"token id {int(low if low < 0 else high)} is outside the vocabulary "
                         f"[0, {cfg.vocab_size}); encode with the model's own tokenizer")
    if positions is not None and positions.numel():
        low, high = torch.aminmax(positions)
        if low < 0 or high >= cfg.block_size:
            raise ValueError("positions must be an integer (T,) or (B, T) tensor in "
                             "[0, block_size)")


def _take(sd: dict, name: str) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"the state dict has no {name}: is it a Llama for this config?")
    return sd.pop(name)


def _check_gpt2_state_dict(sd: dict) -> None:
    wte = sd.get("wte.weight")
    if wte is None or not torch.equal(sd.get("lm_head.weight", wte), wte):
        raise ValueError("not a GPT-2 state dict: no wte.weight, or lm_head.weight not tied to it")
