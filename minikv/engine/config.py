"""Model shapes: one frozen dataclass and a few named presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .validate import check_flags, int_at_least, number_in, one_of


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence: GPT-2 learns one embedding per position
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    layer_norm_eps: float = 1e-5
    n_kv_head: int | None = None  # K/V heads (grouped-query attention); None: one per head
    head_size: int | None = None  # a head's width; None: n_embd / n_head
    # A Llama/Qwen-style block is the same model with these four choices changed:
    positions: str = "learned"    # "rope": rotate q and k by their position (no position table)
    rope_theta: float = 10000.0   # RoPE's base: pair i turns by position * theta^(-2i/head_dim)
    norm: str = "layernorm"       # "rmsnorm": scale by the root mean square (no mean, no bias)
    mlp: str = "gelu"             # "swiglu": down(silu(gate(x)) * up(x)), a gated MLP
    n_inner: int | None = None    # the MLP's hidden width; None: 4 * n_embd, as in GPT-2
    bias: bool = True             # biases in the linear layers and norms (Llama has none)
    # What the small open models add (Qwen2.5, Qwen3, Llama-3.2, SmolLM2):
    tied_head: bool = True        # False: lm_head is a matrix of its own, not wte's
    qkv_bias: bool | None = None  # q, k, v biases only (Qwen2.5); None: as `bias` says
    qk_norm: bool = False         # Qwen3: RMSNorm over each head's q and k before RoPE
    # Llama 3's long-context RoPE: ("llama3", factor, low_freq_factor, high_freq_factor,
    # original context): slow pairs turn `factor` times slower (rope.py); None: plain
    rope_scaling: tuple | None = None
    # The cache shrunk in the architecture (chapter 12):
    kv_lora_rank: int | None = None  # MLA: one latent of this width cached per token, not K, V
    qk_rope_head_dim: int = 0     # MLA under RoPE: a small key, shared by the heads, that turns
    layers_per_kv: int = 1        # cross-layer attention: adjacent layers that read one K/V

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "layers_per_kv",
                 "n_kv_head", "n_inner", "kv_lora_rank", "head_size")
        for name in sizes:
            if getattr(self, name) is not None or name in sizes[:5]:
                int_at_least(f"GPTConfig.{name}", getattr(self, name))
        int_at_least("GPTConfig.qk_rope_head_dim", self.qk_rope_head_dim, 0)
        one_of("GPTConfig.positions", self.positions, ("learned", "rope"))
        one_of("GPTConfig.norm", self.norm, ("layernorm", "rmsnorm"))
        one_of("GPTConfig.mlp", self.mlp, ("gelu", "swiglu"))
        check_flags(**{"GPTConfig.bias": self.bias, "GPTConfig.qk_norm": self.qk_norm,
                       "GPTConfig.tied_head": self.tied_head})
        if self.qkv_bias is not None:
            check_flags(**{"GPTConfig.qkv_bias": self.qkv_bias})
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        number_in("GPTConfig.rope_theta", self.rope_theta, 1)
        number_in("GPTConfig.layer_norm_eps", self.layer_norm_eps, 0, 1)
        uneven = self.head_size is None and self.n_embd % self.n_head
        if uneven or self.n_head % self.kv_heads:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head "
                             f"({self.n_head}) (or head_size set), n_head by n_kv_head: "
                             f"pick an n_head that divides it")
        if self.positions == "rope" and self.head_dim % 2:  # RoPE turns pairs of numbers
            raise ValueError(f"RoPE needs an even head_dim, not {self.head_dim}: change n_head")
        if self.kv_lora_rank is not None:
            self._check_mla()
            if self.qk_norm or self.qkv_bias is not None:
                raise ValueError("qk_norm and qkv_bias shape q, k and v, and MLA has "
                                 "no k or v: leave them at False and None")
        elif self.qk_rope_head_dim:
            raise ValueError("qk_rope_head_dim is MLA's RoPE key: set kv_lora_rank too, or 0")

    def _check_mla(self) -> None:
        """MLA's RoPE key is its own: the latent cannot turn (the up-projection absorbed
        into the query would have to turn with every position), so a rotary MLA needs an
        even qk_rope_head_dim > 0 and a learned-position one has none."""
        rotary, d_r = self.positions == "rope", self.qk_rope_head_dim
        if (rotary and (d_r == 0 or d_r % 2)) or (not rotary and d_r):
            raise ValueError(f"qk_rope_head_dim={d_r} with positions={self.positions!r}: a "
                             f"rotary MLA needs an even one > 0, a learned-position MLA 0")
        if self.n_kv_head is not None:
            raise ValueError("MLA caches one latent for every head: leave n_kv_head None")

    def _check_rope_scaling(self) -> None:
        """("llama3", factor, low_freq_factor, high_freq_factor, original context), each
        checked; a list (a config.json read back) becomes the tuple a frozen config
        hashes."""
        scaling = self.rope_scaling
        if not isinstance(scaling, (tuple, list)) or len(scaling) != 5:
            raise ValueError(f"GPTConfig.rope_scaling must be ('llama3', factor, "
                             f"low_freq_factor, high_freq_factor, original context) or "
                             f"None, not {scaling!r:.60}")
        object.__setattr__(self, "rope_scaling", tuple(scaling))
        one_of("GPTConfig.rope_scaling[0]", scaling[0], ("llama3",))
        for i, name in enumerate(("factor", "low_freq_factor", "high_freq_factor"), 1):
            number_in(f"GPTConfig.rope_scaling {name}", scaling[i], 0)
        int_at_least("GPTConfig.rope_scaling original context", scaling[4])
        if self.positions != "rope" or scaling[3] <= scaling[2]:
            raise ValueError("rope_scaling needs positions='rope' and high_freq_factor "
                             "> low_freq_factor (Llama 3.2: 32.0, 1.0, 4.0, 8192)")

    @property
    def qkv_biased(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: n_head (GPT-2), fewer with grouped-query attention
        (each K/V head serves n_head / n_kv_head query heads), 1 with multi-query
        attention."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_layers(self) -> int:
        """Layers of the cache: n_layer, or one per group of layers_per_kv (cross-layer
        attention: the lowest layer of a group makes and caches K/V, the others read it)."""
        return -(-self.n_layer // self.layers_per_kv)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """What a cache layer holds per position: (heads, key width, value width). MLA
        caches one "head", the latent and its RoPE key, and no values: V is read from the
        latent itself."""
        if self.kv_lora_rank is not None:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.kv_heads, self.head_dim, self.head_dim

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        return cls(**{**PRESETS[one_of("preset", name, tuple(PRESETS))], **overrides})

    def to_dict(self) -> dict:
        """The fields, less those a GPT-2 config does not have and this one leaves as GPT-2's
        (so a GPT-2 checkpoint's config.json stays as it was)."""
        gpt2 = GPTConfig()
        return {k: v for k, v in asdict(self).items()
                if k in GPT2_FIELDS or v != getattr(gpt2, k)}


GPT2_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "layer_norm_eps")
LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # the block's choices

PRESETS: dict[str, dict] = {
    # GPT-2 small, 124M parameters: the shapes of the course's cache arithmetic.
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # Random-weight models for tests and quick experiments on a laptop CPU.
    "tiny": dict(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64),
    "small": dict(vocab_size=2048, block_size=512, n_layer=4, n_head=4, n_embd=128),
    # The shipped course models: a target and a draft several times cheaper per step, for
    # speculative decoding (why these shapes: minikv/course/train.py).
    "target": dict(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=192),
    "draft": dict(vocab_size=1024, block_size=256, n_layer=1, n_head=4, n_embd=128),
    # Chapter 08's modern block at the target's shape, parameter for parameter: a SwiGLU MLP of
    # width 512 holds 3 x 192 x 512 weights, as many as GPT-2's 2 x 192 x 768.
    "target-rope": dict(vocab_size=1024, block_size=256, n_layer=12, n_head=8, n_embd=192,
                        n_inner=512, **LLAMA),
}
