"""`python -m minikv bench-peers`: this engine next to the engines people run on a laptop, on
the course target, in one run, every configuration at the same number of CPU threads:

- llama.cpp (through llama-cpp-python) on GGUF files of F32, F16 and Q8_0 weights, made from
  the target exported to Hugging Face (`python -m minikv export`) by llama.cpp's own converter
  (convert_hf_to_gguf.py); the course tokenizer splits words as GPT-2's does, so the
  converter is told its pre-tokenizer is "gpt-2" (its check knows only published vocabularies);
- transformers' `generate` on the exported folder (GPT2LMHeadModel, float32);
- this engine (`generate`) with fp32, bf16 and int8 weights (engine/quantized.py, fused).

For each: prompt tokens a second (a prompt's pass and its first token: `prompt` / t(1 new
token)) and generated tokens a second ((new - 1) / (t(new) - t(1))), medians of `repeats`
runs, the configurations taking turns; the decode step against the time its weight bytes
take at the streaming-read bandwidth measured in the same run (chapter 01's roofline); and
whether its greedy tokens are this engine's fp32 ones. llama.cpp's loop is driven from Python
(one `eval` and an argmax a token), as llama-cpp-python's own generate does.

Optional, and not in `make test`: llama-cpp-python compiles llama.cpp (about 6 minutes on 2
cores) and its pip package does not carry the converter. benchmarks/peers/README.md says how
to get both; `--without-llama-cpp` runs the other rows. Writes results.json and README.md to
--out (default runs/bench-peers; the committed run: benchmarks/peers)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..course import arguments
from ..course.files import write_atomically
from ..engine import generate
from ..engine.quantized import quantize_weights
from . import alternate_all, claimed_out, publish, read_bandwidth, run_record
from .weights import step_bytes

GGUF_TYPES = ("f32", "f16", "q8_0")
INSTALL = ("llama-cpp-python is not installed here. It is optional (it compiles llama.cpp): "
           "`pip install llama-cpp-python diskcache`, or run with --without-llama-cpp "
           "(benchmarks/peers/README.md says how the committed run was made)")
# The converter's check of a tokenizer knows published vocabularies only; ours splits text as
# GPT-2's does (course/tokenizer.py's PAT_STR), which is what "gpt-2" tells llama.cpp.
CONVERT = """import sys
src, folder, out, kind = sys.argv[1:]
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", kind]
convert_hf_to_gguf.main()
"""


def converter(src: Path | None) -> Path:
    """The llama.cpp source folder holding convert_hf_to_gguf.py and gguf-py/."""
    if src is None:
        raise ValueError("llama.cpp's converter is needed: pass --llama-cpp-src DIR (a llama.cpp "
                         "checkout, or vendor/llama.cpp in llama-cpp-python's source archive)")
    if not (src / "convert_hf_to_gguf.py").is_file() or not (src / "gguf-py").is_dir():
        raise ValueError(f"{src} holds no convert_hf_to_gguf.py and gguf-py/: pass llama.cpp's "
                         "source folder (vendor/llama.cpp in llama-cpp-python's archive)")
    return src


def to_gguf(src: Path, folder: Path, out: Path, kind: str) -> Path:
    """The exported folder as a GGUF file of `kind` weights, by llama.cpp's converter."""
    run = subprocess.run([sys.executable, "-c", CONVERT, str(src), str(folder), str(out), kind],
                         capture_output=True, text=True)
    if run.returncode or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {kind}:\n{run.stderr[-2000:]}")
    return out


def gguf_step_bytes(path: Path, src: Path) -> int:
    """Bytes a decode step reads from a GGUF file: every tensor, but one row of each
    embedding table (token and position)."""
    sys.path.insert(0, str(src / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(src / "gguf-py"))
    total = 0
    for t in GGUFReader(path).tensors:
        rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # GGUF lists shapes innermost first
        total += t.n_bytes // rows if t.name in ("token_embd.weight", "position_embd.weight") \
            else t.n_bytes
    return total


def llama_cpp_runner(path: Path, threads: int, context: int):
    """generate(prompt, n) -> greedy tokens, by llama.cpp."""
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                          n_batch=context, verbose=False)
    vocab = llm.n_vocab()

    def run(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(n):
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            out.append(int(np.ctypeslib.as_array(logits, shape=(vocab,)).argmax()))
            if len(out) < n:
                llm.eval(out[-1:])
        return out
    return run


def transformers_runner(folder: Path, eot: int):
    """generate(prompt, n) -> greedy tokens, by transformers (n of them: no stop at EOT, as
    the other two do not stop)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=eot)
        return out[0, len(prompt):].tolist()
    return run


def engine_runner(model):
    return lambda prompt, n: generate(model, prompt, n).tokens


def bench(args) -> dict:
    from ..course.checkpoint import load_course_model
    from ..course.export import export_hf
    target, tok = load_course_model("target", "cpu")
    prompt = tok.encode("The color of dog can vary widely. " * 40)[:args.prompt]
    runners, nbytes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(target, Path(tmp) / "target-hf")
        if not args.without_llama_cpp:
            for kind in GGUF_TYPES:
                path = to_gguf(args.llama_cpp_src, folder, Path(tmp) / f"target-{kind}.gguf",
                               kind)
                runners[f"llama.cpp {kind.upper()}"] = llama_cpp_runner(
                    path, args.threads, target.config.block_size)
                nbytes[f"llama.cpp {kind.upper()}"] = gguf_step_bytes(path, args.llama_cpp_src)
        runners["transformers fp32"] = transformers_runner(folder, tok.eot_token)
        nbytes["transformers fp32"] = step_bytes(target)  # the same weights (Conv1D there)
    engines = {"minikv fp32": target, "minikv bf16": copy.deepcopy(target).to(torch.bfloat16),
               "minikv int8": quantize_weights(target, 8, fused=True)}
    for name, model in engines.items():
        runners[name], nbytes[name] = engine_runner(model), step_bytes(model)
    reference = runners["minikv fp32"](prompt, args.new)
    same = {name: run(prompt, args.new) == reference for name, run in runners.items()}
    calls = {f"{name} {n}": (lambda run=run, n=n: run(prompt, n))
             for name, run in runners.items() for n in (1, args.new)}
    bandwidth = read_bandwidth(torch.device("cpu"), 256 if not args.quick else 16, 11)
    times = alternate_all(calls, args.repeats + 1, torch.device("cpu"))  # +1: a warm-up
    rows = []
    for name in runners:
        one, many = (statistics.median(times[f"{name} {n}"][1:]) for n in (1, args.new))
        step = (many - one) / (args.new - 1)
        rows.append({"name": name, "prompt_tps": len(prompt) / one, "decode_tps": 1 / step,
                     "step_s": step, "bytes": nbytes[name],
                     "predicted_s": nbytes[name] / bandwidth, "same_tokens": same[name]})
    return {"prompt": len(prompt), "new": args.new, "repeats": args.repeats,
            "threads": args.threads, "bandwidth_GBps": bandwidth / 1e9, "rows": rows}


def write_report(results: dict, out: Path) -> None:
    m, r = results["machine"], results["peers"]
    base = {row["name"]: row for row in r["rows"]}
    peers = [p for p in ("llama.cpp F32", "transformers fp32") if p in base]
    lines = [f"# This engine next to llama.cpp and transformers ({m['date']})", "",
             f"`{m['command']}`: the course target, {m['cpus']} CPUs, {r['threads']} threads "
             f"everywhere, torch {m['torch']}, llama-cpp-python {m['llama_cpp']}, transformers "
             f"{m['transformers']}, load average {m['load']:.2f} at the start. A "
             f"{r['prompt']}-token prompt, {r['new']} greedy tokens; medians of "
             f"{r['repeats']} runs, the configurations taking turns. Prompt tokens/s: the "
             "prompt's pass and its first token; generated tokens/s: the tokens after the "
             f"first. Predicted step: its bytes at {r['bandwidth_GBps']:.1f} GB/s, the "
             "streaming-read bandwidth measured in the same run. One machine, one run.", "",
             "| configuration | bytes a step | prompt tok/s | generated tok/s | "
             + " | ".join(f"generated × {p}" for p in peers)
             + " | step ms | predicted ms | measured / predicted | greedy tokens = minikv fp32 |",
             "|---" * (8 + len(peers)) + "|"]
    for row in r["rows"]:
        ratios = " | ".join(f"{row['decode_tps'] / base[p]['decode_tps']:.2f}" for p in peers)
        lines.append(f"| {row['name']} | {row['bytes']:,} | {row['prompt_tps']:,.0f} | "
                     f"{row['decode_tps']:,.0f} | {ratios}{' | ' if peers else ''}"
                     f"{row['step_s'] * 1e3:.3f} | {row['predicted_s'] * 1e3:.3f} | "
                     f"{row['step_s'] / row['predicted_s']:.1f} | {row['same_tokens']} |")
    if "llama.cpp F32" not in base:
        lines += ["", "llama.cpp was not run (--without-llama-cpp)."]
    lines += ["", "## How to run it", "", "Optional, not in `make test`: llama-cpp-python "
              "compiles llama.cpp when installed (5 min 26 s on this project's 2-core machine), "
              "and its pip package does not carry llama.cpp's converter; its source archive "
              "does. With the package registry reachable:", "", "```",
              "pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama",
              "pip install /tmp/llama/llama_cpp_python-0.3.36.tar.gz diskcache",
              "tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama",
              "python -m minikv bench-peers --out runs/bench-peers \\",
              "    --llama-cpp-src /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp", "```"]
    write_atomically(out / "README.md", ("\n".join(lines) + "\n").encode())
    write_atomically(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench-peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few tokens: the machinery only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and README.md (default: "
                             "runs/bench-peers; the committed run: benchmarks/peers)")
    parser.add_argument("--llama-cpp-src", type=Path, default=os.environ.get("LLAMA_CPP_SRC"),
                        help="llama.cpp's source folder, for its converter (default: "
                             "$LLAMA_CPP_SRC)")
    parser.add_argument("--without-llama-cpp", action="store_true",
                        help="only transformers and this engine")
    parser.add_argument("--threads", type=arguments.positive, default=2)
    parser.add_argument("--repeats", type=arguments.positive, default=7)
    parser.add_argument("--prompt", type=arguments.integer(2, 200), default=128,
                        help="prompt tokens (2 to 200; the target's window is 256)")
    parser.add_argument("--new", type=arguments.integer(2, 56), default=48,
                        help="generated tokens (2 to 56)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.prompt, args.new = 1, 16, 4
    llama_cpp = "not run"
    if not args.without_llama_cpp:
        try:
            import llama_cpp as module
            llama_cpp = module.__version__
        except ImportError:
            parser.error(INSTALL)
        try:
            args.llama_cpp_src = converter(args.llama_cpp_src)
        except ValueError as e:
            parser.error(str(e))
    out = claimed_out(parser, args, "bench-peers")
    import transformers
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        machine = run_record("bench-peers", argv, transformers=transformers.__version__,
                             llama_cpp=llama_cpp)
        results = {"machine": machine, "peers": bench(args)}
    finally:
        torch.set_num_threads(threads)
    return publish(out, "bench-peers", results, write_report)


if __name__ == "__main__":
    raise SystemExit(main())
