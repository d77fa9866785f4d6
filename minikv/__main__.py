"""Command line.

    python -m minikv generate --prompt "The color of dog" --mode cached --max-new-tokens 20   # the course target
    python -m minikv generate --prompt "Once upon a" --preset gpt2 --mode naive --trace     # random weights
    python -m minikv tokenizer --check      # retrain the course BPE in memory, compare with the shipped ranks
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch

from .checkpoint import COURSE_MODELS, load_course_model
from .config import PRESETS, GPTConfig
from .device import describe_device, resolve_device
from .generate import MODES, generate
from .model import GPT
from . import tokenizer
from .tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate tokens and print them with the engine's stats")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--mode", choices=MODES, default="cached")
    gen.add_argument("--max-new-tokens", type=int, default=20)
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--model", choices=COURSE_MODELS, default=None,
                       help="a shipped, trained course model (the default: target)")
    which.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="a randomly initialised model of this shape instead (its vocabulary is the course tokenizer's)")
    gen.add_argument("--init-seed", type=int, default=0, help="seed for the random weights")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: best available)")
    gen.add_argument("--trace", action="store_true", help="print one line per forward pass")
    bpe = commands.add_parser("tokenizer", help="regenerate or check the shipped course tokenizer")
    action = bpe.add_mutually_exclusive_group(required=True)
    action.add_argument("--train", action="store_true", help=f"retrain and rewrite {tokenizer.RANKS_PATH.name}")
    action.add_argument("--check", action="store_true", help="retrain in memory and compare with the shipped file")
    args = parser.parse_args(argv)
    return run_generate(args) if args.command == "generate" else run_tokenizer(args)


def run_tokenizer(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    data = tokenizer.dump_ranks(tokenizer.course_ranks())
    sha256 = hashlib.sha256(data).hexdigest()
    print(f"trained {tokenizer.VOCAB_SIZE - 1} ranks in {time.perf_counter() - start:.1f} s, sha256 {sha256}")
    path = tokenizer.RANKS_PATH
    if args.train:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path}; set RANKS_SHA256 = {sha256!r} in {tokenizer.__file__}")
        return 0
    ok = path.is_file() and data == path.read_bytes() and sha256 == tokenizer.RANKS_SHA256
    print("OK: matches the shipped file" if ok else f"MISMATCH with {path} or RANKS_SHA256")
    return 0 if ok else 1


def run_generate(args: argparse.Namespace) -> int:

    try:
        device = resolve_device(args.device)
        tok = load_tokenizer()
        if args.preset is None:
            model, _ = load_course_model(args.model or "target", device)
            name = f"course {args.model or 'target'}"
        else:
            torch.manual_seed(args.init_seed)
            model = GPT(GPTConfig.preset(args.preset, vocab_size=tok.n_vocab)).to(device).eval()
            name = f"random {args.preset}"
        ids = tok.encode(args.prompt, allowed_special="all")
        start = time.perf_counter()
        out = generate(model, ids, args.max_new_tokens, mode=args.mode, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, eos_id=tok.eot_token, trace=args.trace)
        seconds = time.perf_counter() - start
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(f"model: {name} ({model.num_params():,} parameters) on {describe_device(device)}")
    print(f"prompt tokens: {out.prompt}")
    print(f"new tokens:    {out.tokens}")
    print(f"new pieces:    {[tok.decode([t]) for t in out.tokens]}")
    print(f"text:          {tok.decode(out.sequence)!r}")
    s = out.stats
    print(f"stats: mode={args.mode} forward_passes={s.forward_passes} positions_processed={s.positions_processed} "
          f"kv_computed_per_layer={s.kv_computed} new_tokens={s.new_tokens} time={seconds:.3f}s")
    for e in out.trace or []:
        print(f"  step {e.step:>3} {e.kind:<9} inputs={len(e.input_ids):>4} positions={e.positions[0]}..{e.positions[-1]} "
              f"cache {e.cache_len_before}->{e.cache_len_after} kv={e.kv_computed} token={e.token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
