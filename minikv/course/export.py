"""The way out: a course model written as a Hugging Face checkpoint, for the engines that serve on
many GPUs (transformers, vLLM, SGLang read this layout).

    python -m minikv export --model target                 # runs/export/target-hf
    python -m minikv export --model target-rope --out DIR  # a Llama, once that model ships
    python -m minikv export --checkpoint runs/mine --out DIR

A GPT-2-block model becomes a `GPT2LMHeadModel` (GPT-2's linears are Conv1D, (in, out): ours are
transposed back), a Llama-style one (config.LLAMA) a `LlamaForCausalLM` (c_attn split into q, k
and v, c_fc into gate and up), or a `Qwen2ForCausalLM` with q/k/v biases, a `Qwen3ForCausalLM`
with q/k norms; the course tokenizer becomes a `tokenizer.json` (transformers' converter of
tiktoken files) with <|endoftext|> as its end-of-text token. Other block mixes (a GPT-2 block
with fewer K/V heads, say) have no Hugging Face architecture and are refused. The
directory is written whole, in a temporary directory renamed into place, and marked as an
export's (a .minikv-output file); an existing one is replaced only with --force, and only if it
is empty or an earlier export's: a folder of anyone's files (the repository, a folder holding
the package, a home directory) is refused, --force or not, and never one in the package.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engine import GPT
from ..engine.config import LLAMA
from . import arguments
from .checkpoint import COURSE_MODELS, load_checkpoint, load_course_model
from .files import claim_directory, replace_directory
from .tokenizer import RANKS_PATH, load_tokenizer

PACKAGE = Path(__file__).resolve().parent.parent
GPT2_BLOCK = dict(positions="learned", norm="layernorm", mlp="gelu", bias=True)


def architecture(model: GPT) -> str:
    """"gpt2", "llama", "qwen2" or "qwen3": the Hugging Face family whose layout this model's
    block is (Qwen2: q/k/v biases; Qwen3: q/k norms; either may have Llama 3's RoPE scaling)."""
    cfg = model.config
    block = dict(positions=cfg.positions, norm=cfg.norm, mlp=cfg.mlp, bias=cfg.bias)
    if cfg.kv_lora_rank is not None or cfg.layers_per_kv > 1:
        raise ValueError("an MLA or cross-layer model has no GPT-2 or Llama layout to export "
                         "to: export a model of the other choices")
    plain = (cfg.tied_head, cfg.qkv_bias, cfg.qk_norm) == (True, None, False)
    if block == GPT2_BLOCK and cfg.kv_heads == cfg.n_head and cfg.head_size is None and plain:
        return "gpt2"
    if block == LLAMA and not (cfg.qkv_biased and cfg.qk_norm):
        return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_biased else "llama"
    raise ValueError(f"no Hugging Face architecture has this block ({block}, {cfg.kv_heads} K/V "
                     f"heads of {cfg.n_head}, tied_head={cfg.tied_head}, qkv_bias="
                     f"{cfg.qkv_bias}, qk_norm={cfg.qk_norm}): export a GPT-2 block with every "
                     f"K/V head and a tied head, or a Llama-style one (GPTConfig(**LLAMA)) with "
                     f"q/k/v biases (Qwen2) or q/k norms (Qwen3), not both")


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in GPT2LMHeadModel's names; the inverse of GPT.from_gpt2_state_dict."""
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    return {name: t.t() if name.endswith(conv1d) else t
            for name, t in model.state_dict().items() if name != "lm_head.weight"}


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in LlamaForCausalLM's names (Qwen2's and Qwen3's are the same, with q/k/v
    biases or q/k norms); the inverse of GPT.from_llama_state_dict."""
    cfg, sd = model.config, model.state_dict()
    width, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
           "model.norm.weight": sd["transformer.ln_f.weight"]}
    if not cfg.tied_head:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        for part in ("weight", "bias") if cfg.qkv_biased else ("weight",):
            q, k, v = sd[ours + "attn.c_attn." + part].split([width, kv, kv])
            out |= {f"{attn}{x}_proj.{part}": t for x, t in zip("qkv", (q, k, v))}
        if cfg.qk_norm:
            out |= {f"{attn}{x}_norm.weight": sd[f"{ours}attn.{x}_norm.weight"] for x in "qk"}
        gate, up = sd[ours + "mlp.c_fc.weight"].chunk(2)
        out |= {theirs + "input_layernorm.weight": sd[ours + "ln_1.weight"],
                attn + "o_proj.weight": sd[ours + "attn.c_proj.weight"],
                theirs + "post_attention_layernorm.weight": sd[ours + "ln_2.weight"],
                theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                theirs + "mlp.down_proj.weight": sd[ours + "mlp.c_proj.weight"]}
    return out


def rope_parameters(cfg) -> dict:
    """The config's RoPE in transformers' rope_parameters form."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    kind, factor, low, high, context = cfg.rope_scaling
    return {"rope_type": kind, "rope_theta": cfg.rope_theta, "factor": factor,
            "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": context}


def hf_config(model: GPT, eot: int) -> dict:
    """config.json for the model's family, as transformers' own config class writes it."""
    import transformers

    cfg, family = model.config, architecture(model)
    if family == "gpt2":
        hf = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
            n_ctx=cfg.block_size,  # as GPT-2's own config.json has it (llama.cpp's reads it)
            n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.n_inner,
            activation_function="gelu_new",  # GPT-2's tanh GELU, as model.MLP computes it
            layer_norm_epsilon=cfg.layer_norm_eps, bos_token_id=eot, eos_token_id=eot,
            architectures=["GPT2LMHeadModel"])
    else:
        kind, name = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                      "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
                      "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM")}[family]
        hf = kind(
            vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_inner
            or 4 * cfg.n_embd, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
            max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.layer_norm_eps,
            tie_word_embeddings=cfg.tied_head, bos_token_id=eot, eos_token_id=eot,
            rope_parameters=rope_parameters(cfg), architectures=[name])
    return hf.to_dict()


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the course tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = load_tokenizer()  # checks the shipped ranks file's hash first
    eot = tok.decode([tok.eot_token])
    converted = TikTokenConverter(vocab_file=str(RANKS_PATH), pattern=tok._pat_str,
                                  extra_special_tokens={eot: tok.eot_token}).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=eot, eos_token=eot,
                                   unk_token=eot, model_max_length=10**6)
    fast.save_pretrained(str(directory))


def export_hf(model: GPT, out: str | Path, force: bool = False) -> Path:
    """Write `model` and the course tokenizer as a Hugging Face checkpoint directory `out`."""
    out = Path(out)
    family = architecture(model)  # refuses a block no Hugging Face class has, before any write
    # new, empty, or an earlier export's (with force): never a folder of anyone else's files
    claim_directory(out, "export", replace=True, force=force)
    eot = load_tokenizer().eot_token
    tensors = gpt2_state_dict(model) if family == "gpt2" else llama_state_dict(model)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in tensors.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(model, eot), indent=2) + "\n")
        write_tokenizer(tmp)
    return replace_directory(out, fill, mark="export")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", choices=COURSE_MODELS, help="a shipped course model")
    which.add_argument("--checkpoint", type=arguments.directory,
                       help="a minikv checkpoint directory (train --out)")
    parser.add_argument("--format", choices=["hf"], default="hf",
                        help="hf: a Hugging Face checkpoint (config.json, model.safetensors, "
                             "tokenizer.json)")
    parser.add_argument("--out", default=None,
                        help="output directory (default: runs/export/<model>-hf)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out that an earlier export wrote (never a "
                             "folder of other files)")
    args = parser.parse_args(argv)
    name = args.model or Path(args.checkpoint).name
    out = Path(args.out) if args.out else Path("runs") / "export" / f"{name}-hf"
    try:
        model = (load_course_model(args.model, "cpu")[0] if args.model
                 else load_checkpoint(args.checkpoint, "cpu"))
        path = export_hf(model, out, force=args.force)
    except ValueError as e:
        parser.error(str(e))
    print(f"{name}: a Hugging Face {architecture(model)} checkpoint in {path}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
