"""Command line: python -m minikv <command> [options]; `python -m minikv <command> -h` for more.

    generate   continue a prompt with a course model (or a random preset); tokens and stats
    tokenizer  retrain the course tokenizer (--train) or check the shipped one (--check)
    train      train the course models (minikv/course/models/)
    train-head train chapter 10's draft head on the target's own features
    evaluate   measure the shipped models; write docs/course-models.md
    figures    redraw figures/ from engine runs
    bench      the benchmarks: benchmarks/README.md, results.json, plots.png
    bench-load the server under load: latency percentiles, goodput, chunked prefill
    bench-spec speculation beyond a draft: draft model, feature head, token trees, in a server
    bench-sessions  the cache across turns: dialogues and an agent loop under four prefix caches
    bench-tp   tensor parallelism: the course target on 2 ranks against one process
    bench-weights  int8 and int4 weights: the decode step against its roofline, and quality
    bench-batch  a decode step against its batch size, beside the roofline's prediction
    bench-disagg  prefill on another process: a long prompt beside decodes; transfer vs recompute
    bench-peers  next to llama.cpp and transformers (optional: needs llama-cpp-python)
    bench-compile  what torch.compile removes from a decode step (engine/static.py)
    bench-syncs  what each decoder makes the host wait for on a GPU, counted on any machine
    exercises  regenerate exercises/ from solutions/ (--check: only report)
    grade      the grade report: ✓, ✗ with the checker's hint, or not started, per exercise
    run        execute notebooks in place, saving their outputs
    mutants    the checkers' mutation score: mutate each solution, count the checks that catch it
    export     write a course model as a Hugging Face checkpoint (transformers, vLLM, SGLang)
    serve-http serve a course model over HTTP, OpenAI-compatible (/v1/completions, streamed)
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

# command -> (module with a main(argv), whether that main takes the command word too)
COMMANDS = {
    "tokenizer": ("minikv.course.tokenizer", False),
    "train": ("minikv.course.train", False),
    "train-head": ("minikv.course.train_head", False),
    "evaluate": ("minikv.course.evaluate", False),
    "figures": ("minikv.viz.figures", False),
    "bench": ("minikv.bench", False),
    "exercises": ("minikv.course.notebooks", True),
    "grade": ("minikv.course.grade", False),
    "run": ("minikv.course.notebooks", True),
    "mutants": ("minikv.course.mutants", False),
    "export": ("minikv.course.export", False),
    "serve-http": ("minikv.server", False),
    "bench-load": ("minikv.bench.load", False),
    "bench-spec": ("minikv.bench.speculation", False),
    "bench-sessions": ("minikv.bench.sessions", False),
    "bench-tp": ("minikv.bench.tensor_parallel", False),
    "bench-weights": ("minikv.bench.weights", False),
    "bench-batch": ("minikv.bench.batch", False),
    "bench-disagg": ("minikv.bench.disagg", False),
    "bench-peers": ("minikv.bench.peers", False),
    "bench-compile": ("minikv.bench.compile", False),
    "bench-syncs": ("minikv.bench.syncs", False),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        module, with_command = COMMANDS[argv[0]]
        return importlib.import_module(module).main(argv if with_command else argv[1:])
    if argv[:1] != ["generate"]:
        print(__doc__, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return generate(argv[1:])


def generate(argv: list[str]) -> int:
    from .course import arguments
    from .course.checkpoint import COURSE_MODELS, load_course_model
    from .course.device import describe_device, resolve_device
    from .course.tokenizer import load_tokenizer
    from .engine import GPT, PRESETS, GPTConfig, kv_cache_bytes, tensor_parallel
    from .engine import generate as run

    parser = argparse.ArgumentParser(prog="python -m minikv generate",
                                     description="generate tokens and print them with the "
                                                 "engine's stats")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--mode", choices=("naive", "cached"), default="cached")
    parser.add_argument("--max-new-tokens", type=arguments.positive, default=20)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", choices=COURSE_MODELS, default=None,
                       help="a shipped, trained course model (the default: target)")
    which.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="a randomly initialised model of this shape instead (with the "
                            "course tokenizer's vocabulary)")
    parser.add_argument("--init-seed", type=arguments.seed, default=0,
                        help="seed for the random weights")
    parser.add_argument("--temperature", type=arguments.number(0.0, what=" (0 = greedy)"),
                        default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=arguments.positive, default=None)
    parser.add_argument("--seed", type=arguments.seed, default=0, help="sampling seed")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N or mps (default: best available)")
    parser.add_argument("--trace", action="store_true", help="print one line per forward pass")
    parser.add_argument("--tp", type=arguments.integer(1, 64, " (ranks)"), default=1,
                        help="tensor parallelism: split the model's heads over this many CPU "
                             "processes (chapter 13)")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
        tok = load_tokenizer()
        if args.preset is None:
            model, _ = load_course_model(args.model or "target", device)
            name = f"course {args.model or 'target'}"
        else:
            torch.manual_seed(args.init_seed)
            config = GPTConfig.preset(args.preset, vocab_size=tok.n_vocab)
            model, name = GPT(config).to(device).eval(), f"random {args.preset}"
        ids = tok.encode(args.prompt, allowed_special="all")
        kwargs = dict(mode=args.mode, temperature=args.temperature, top_k=args.top_k,
                      seed=args.seed, eos_id=tok.eot_token, trace=args.trace)
        start = time.perf_counter()
        if args.tp > 1:
            if device.type != "cpu":
                raise ValueError("--tp runs its ranks as CPU processes (gloo): add --device cpu")
            ranks = tensor_parallel(model, args.tp, run, ids, args.max_new_tokens, **kwargs)
            out = ranks[0]["output"]
        else:
            out = run(model, ids, args.max_new_tokens, **kwargs)
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
    print(f"stats: mode={args.mode} forward_passes={s.forward_passes} "
          f"positions_processed={s.positions_processed} kv_computed_per_layer={s.kv_computed} "
          f"new_tokens={s.new_tokens} time={seconds:.3f}s")
    if args.tp > 1:
        length = len(out.prompt) + len(out.tokens)
        for r in ranks:
            s = r["shard"]
            nbytes = kv_cache_bytes(r["config"], length, dtype=model.dtype)
            print(f"rank {s.rank}: query heads {s.q_heads.start}..{s.q_heads.stop - 1}, "
                  f"K/V heads {s.kv_heads.start}..{s.kv_heads.stop - 1}, cache {nbytes:,} "
                  f"bytes at {length} positions, {r['all_reduces']} all-reduces")
    for e in out.trace or []:
        print(f"  step {e.step:>3} {e.kind:<9} inputs={len(e.input_ids):>4} "
              f"positions={e.positions[0]}..{e.positions[-1]} cache {e.cache_len_before}->"
              f"{e.cache_len_after} kv={e.kv_computed} token={e.token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
