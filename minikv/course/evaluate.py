"""Measure the shipped course models and write docs/course-models.md.

    python -m minikv evaluate                                # prints the report
    python -m minikv evaluate --out docs/course-models.md    # rewrites the course's own

Coin flips: the held-out questions of corpus.coin_flip_eval (test split), in the plain form the
course asks them ("A coin's state is heads. Alice flips, then Bob doesn't flip. What's the
state? A:"), answered by the greedy next token after "A:" (right when it is " heads" or " tails"
as it should be). Losses: mean next-token cross-entropy (nats) over the test split of each
corpus, each document read from its start. Step time: cached decode, batch 1, through
minikv.generate, median over repeats.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from ..engine import generate, kv_cache_bytes
from . import arguments, corpus
from .checkpoint import COURSE_MODELS, MODELS_DIR, WEIGHTS_FILE, load_course_model, read_metadata
from .device import describe_device, resolve_device
from .files import check_writable, write_atomically
from .train import CACHE_VARIANTS, VARIANTS, corpus_loss, load_corpora
from .variants import mean_pool_kv_heads

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "course-models.md"
PROMPTS = ("The color of dog", "Once upon a time")
AGREEMENT_PROMPTS = ("Once upon a time", "The color of dog", "A coin's state is heads. Alice flips")


@torch.no_grad()
def coin_flip_accuracy(model, tok, n_per_count: int = 200, seed: int = 0, split: str = "test",
                       cot: bool = False, cache=None, attention=None,
                       questions: list[corpus.CoinFlip] | None = None,
                       prefix: list[int] = ()) -> dict[int, float]:
    """Fraction answered correctly (greedy token after "A:") for each number of people 1..8.
    `cot`: the questions state the coin after every person (seed 000's intermediate answers).
    `cache(model, batch_size)`, if given, makes the cache each batch is answered through (a
    quantized one, say); `attention` swaps the attention kernel (a window's mask, say).
    `questions`, if given, replaces the held-out questions (corpus.unseen_coin_flips, say).
    `prefix`: token ids read before every question (other documents, to start it later)."""
    if questions is None:
        questions = corpus.coin_flip_eval(n_per_count, seed=seed, split=split)
    by_length = defaultdict(list)  # same-length prompts go through the model as one batch
    for q in questions:
        by_length[len(tok.encode(q.prompt(cot)))].append(q)
    correct, total = defaultdict(int), defaultdict(int)
    kwargs = {} if attention is None else {"attention": attention}
    for length, qs in by_length.items():
        ids = torch.tensor([[*prefix, *tok.encode(q.prompt(cot))] for q in qs],
                           device=model.device)
        if cache is not None:
            kwargs["cache"] = cache(model, len(qs))
        guesses = model(ids, last_only=True, **kwargs)[:, -1].argmax(-1).tolist()
        for q, guess in zip(qs, guesses):
            correct[len(q.steps)] += guess == tok.encode(" " + q.answer)[0]
            total[len(q.steps)] += 1
    return {n: correct[n] / total[n] for n in sorted(total)}


def heldout_losses(model, tok, cache=None, attention=None,
                   corpora: tuple[str, ...] = corpus.CORPORA,
                   n_docs: int = 200) -> dict[str, float]:
    """Held-out loss on the first `n_docs` documents of each corpus's test split (corpus.splits
    defaults, seed 0); `cache` and `attention` as in coin_flip_accuracy."""
    data = load_corpora(tok, {name: n_docs for name in corpora}, split="test")
    return {name: corpus_loss(model, tokens, tok.eot_token, cache=cache, attention=attention)
            for name, tokens in data.items()}


def decode_step_seconds(models: dict, repeats: int = 9, new_tokens: int = 64) -> dict[str, float]:
    """Median seconds per cached decode step, batch 1; models alternate so machine load hits both
    alike."""
    prompt = [0] * 8  # content does not change the cost of a step
    times = defaultdict(list)
    for _ in range(repeats):
        for name, model in models.items():
            t0 = time.perf_counter()
            generate(model, prompt, 1)  # prefill only
            t1 = time.perf_counter()
            generate(model, prompt, new_tokens + 1)  # the same prefill and new_tokens decode steps
            t2 = time.perf_counter()
            times[name].append(((t2 - t1) - (t1 - t0)) / new_tokens)
    return {name: statistics.median(t) for name, t in times.items()}


def multi_token(tok):
    """Whether a name is several tokens where it stands in a question (after a space)."""
    return lambda name: len(tok.encode(" " + name)) > 1


@torch.no_grad()
def draft_agreement(target, draft, tok, prompts=AGREEMENT_PROMPTS,
                    new_tokens: int = 100) -> dict[str, float]:
    """How often the draft's greedy token equals the target's, both reading the same tokens: along
    the target's own greedy continuation of each prompt ("continuation": the acceptance rate greedy
    speculative decoding will see) and over the prompt's own positions ("prompt")."""
    agree, total = defaultdict(int), defaultdict(int)
    for prompt in prompts:
        out = generate(target, tok.encode(prompt), new_tokens)
        ids = torch.tensor([out.sequence[:-1]], device=target.device)
        p, guesses = len(out.prompt), draft(ids)[0].argmax(-1)
        wanted = {"prompt": target(ids)[0, :p - 1].argmax(-1),
                  "continuation": torch.tensor(out.tokens, device=target.device)}
        for part, rows in (("prompt", slice(0, p - 1)), ("continuation", slice(p - 1, None))):
            agree[part] += int((guesses[rows] == wanted[part]).sum())
            total[part] += len(wanted[part])
    return {part: agree[part] / total[part] for part in total}


NEXT_KINDS = ("a name's token", "flips or doesn't", "the rest")


def next_token_kinds(question: corpus.CoinFlip, tok) -> list[str]:
    """For each position of the question's prompt but the last, what the token after it is: part
    of a person's name, the first token of the clause's verb (the coin's flip or not), or
    something else. Works on bytes, since one character of a name can span several tokens."""
    text = question.prompt().encode()
    spans, at = [], 0
    for k, (name, _) in enumerate(question.steps):  # the first name opens a sentence: capitalized
        shown = (name[:1].upper() + name[1:] if k == 0 else name).encode()
        start = text.index(shown, at)
        spans.append((start, start + len(shown)))
        at = start + len(shown)
    kinds, offset = [], 0
    for t in tok.encode(question.prompt()):
        piece = tok.decode_bytes([t])
        first = offset + (piece[:1] == b" ")  # where its text starts, past a leading space
        kinds.append(NEXT_KINDS[0] if any(a <= first < e for a, e in spans) else
                     NEXT_KINDS[1] if any(first == e + 1 for _, e in spans) else NEXT_KINDS[2])
        offset += len(piece)
    return kinds[1:]


@torch.no_grad()
def prompt_agreement_by_kind(target, proposers: dict, tok, questions) -> dict:
    """Over the prompts' positions, by what the next token is (next_token_kinds): how many
    positions, how often the target's greedy token is that real next token, and how often each
    proposer's greedy token equals the target's."""
    counts = {kind: defaultdict(int) for kind in NEXT_KINDS}
    for q in questions:
        ids = tok.encode(q.prompt())
        x = torch.tensor([ids[:-1]], device=target.device)
        wanted = target(x)[0].argmax(-1).tolist()
        guesses = {name: m(x)[0].argmax(-1).tolist() for name, m in proposers.items()}
        for i, kind in enumerate(next_token_kinds(q, tok)):
            counts[kind]["positions"] += 1
            counts[kind]["target"] += wanted[i] == ids[i + 1]
            for name, g in guesses.items():
                counts[kind][name] += g[i] == wanted[i]
    return {kind: {key: c[key] if key == "positions" else c[key] / c["positions"] for key in c}
            for kind, c in counts.items()}


def cached(c) -> str:
    """What one layer of a config's cache holds per position, in words."""
    what = (f"latent {c.kv_lora_rank}" if c.kv_lora_rank is not None else
            f"{c.kv_heads} K/V" if c.kv_heads != c.n_head else "K/V")
    return what + (f", one per {c.layers_per_kv} layers" if c.layers_per_kv > 1 else "")


def complete(model, tok, prompt: str, max_new_tokens: int = 48) -> str:
    out = generate(model, tok.encode(prompt), max_new_tokens, eos_id=tok.eot_token)
    return tok.decode(out.tokens)


def report(device=None) -> str:
    device = resolve_device(device)
    loaded = {name: load_course_model(name, device) for name in COURSE_MODELS}
    tok = loaded["target"][1]
    models = {name: m for name, (m, _) in loaded.items()}
    # the grouped-query variants before uptraining: the target's K/V heads mean-pooled, no training
    pooled = {f"{name}, pooled only": mean_pool_kv_heads(models["target"], k)
              for name, k in VARIANTS.items()}
    # chapter 12's before uptraining: the target converted (a truncated SVD; layers paired)
    pooled |= {f"{name}, converted only": make(models["target"])
               for name, (_, make) in CACHE_VARIANTS.items()}
    measured = {**models, **pooled}
    acc = {name: coin_flip_accuracy(m, tok) for name, m in measured.items()}
    losses = {name: heldout_losses(m, tok) for name, m in measured.items()}
    step = decode_step_seconds({name: models[name] for name in ("target", "draft")})
    unseen = {"unseen names": corpus.unseen_coin_flips(200),
              "unseen names of several tokens": corpus.unseen_coin_flips(200,
                                                                         keep=multi_token(tok))}
    unseen_acc = {(name, which): coin_flip_accuracy(models[name], tok, questions=qs)
                  for name in ("target", "target-rope", "draft") for which, qs in unseen.items()}
    unseen_acc |= {(name, "unseen names"): coin_flip_accuracy(models[name], tok,
                                                              questions=unseen["unseen names"])
                   for name in (*VARIANTS, *CACHE_VARIANTS)}  # the caches' frontier (ch. 12)
    people = [p for q in unseen["unseen names"] for p, _ in q.steps]
    several = statistics.mean(map(multi_token(tok), people))
    # the draft, and for scale two proposers of the target's own size made from it (the variants)
    questions = corpus.unseen_coin_flips(5, seed=1)
    proposers = {name: models[name] for name in ("draft", *VARIANTS)}
    agreement = {name: draft_agreement(models["target"], m, tok, [q.prompt() for q in questions],
                                       32) for name, m in proposers.items()}
    by_kind = prompt_agreement_by_kind(models["target"], proposers, tok, questions)
    alpha = draft_agreement(models["target"], models["draft"], tok)["continuation"]
    meta = {name: read_metadata(MODELS_DIR / name) for name in models}
    heldout = corpus.coin_flip_eval(200)
    n_q = len(heldout) // corpus.MAX_PEOPLE
    distinct = len({q.text() for q in heldout if len(q.steps) == 1})
    lines = [
        "# The shipped course models",
        "",
        "Generated by `python -m minikv evaluate` (do not edit by hand); the models are trained by",
        "`python -m minikv train --preset all --ship` and loaded with",
        "`minikv.load_course_model(name)`.",
        "",
        f"Measured on {describe_device(device)}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}.",
        "",
        "## Models",
        "",
        "| model | layers | heads (what a layer caches) | width | block | parameters | K/V bytes "
        "per token (fp32) | file size (stored as) | training wall time | training device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in models.items():
        c, md = m.config, meta[name]
        size = (MODELS_DIR / name / WEIGHTS_FILE).stat().st_size
        how = "uptrained, " if "uptrained_from" in md else ""
        phases = md.get("phases") or [md]  # a second phase, if any, went on from the first
        minutes = " + ".join(f"{p.get('wall_time_s', float('nan')) / 60:.1f}" for p in phases)
        steps = " + ".join(str(p.get("train", {}).get("steps", "?")) for p in phases)
        lines.append(f"| {name} | {c.n_layer} | {c.n_head} ({cached(c)}) | {c.n_embd} | "
                     f"{c.block_size} | {m.num_params():,} | "
                     f"{kv_cache_bytes(c, 1, dtype=torch.float32):,} | {size / 1e6:.2f} MB "
                     f"({md.get('stored_dtype', 'float32')}) | "
                     f"{how}{minutes} min ({steps} steps) | {md.get('device', '?')}, "
                     f"{md.get('cpu_threads', '?')} threads |")
    lines += [
        "",
        "The grouped-query variants (chapter 07) are the target with each group's K/V heads "
        "mean-pooled",
        "(Ainslie et al. 2023), then uptrained for the steps in their row. The target and the "
        "draft",
        "were trained in two phases, the second on from the first's weights (`FINISHING` in",
        "minikv/course/train.py: the target on more of the longest questions, the draft distilled "
        "from",
        "the target). `target-rope` (chapter 08) is the target's shape with a Llama-style block",
        "(rotary positions, RMSNorm, SwiGLU), trained by the target's two phases step for step.",
        "Chapter 12's variants are the target converted, then uptrained as the grouped-query "
        "ones:",
        "`target-mla` caches a 48-wide latent per layer (multi-head latent attention; its key "
        "and value",
        "projections factored by a truncated SVD), as many numbers as `target-mqa`'s one K/V "
        "head;",
        "`target-cla2` has each pair of layers read the lower one's K/V (cross-layer attention).",
        "\"pooled only\" and \"converted only\" rows below measure a variant before any "
        "uptraining.",
        "Weights stored as float16 are rounded from the trained float32 ones (to keep every",
        "shipped file within 80 MB together) and computed in float32 once loaded; every table",
        "below measures the shipped files.",
        "",
        f"## Held-out coin flips, training names: accuracy by number of people ({n_q} questions "
        "each)",
        "",
        "Plain question form, answered directly by the greedy token after \"A:\"; the people "
        "have names the",
        "models were trained on (`corpus.random_person`), in questions of the test split. "
        f"{distinct} of the {n_q}",
        "one-person questions are distinct (a classic name's question can repeat).",
        "",
        "| model | " + " | ".join(str(n) for n in range(1, corpus.MAX_PEOPLE + 1)) + " | ≤ 6 |",
        "|---|" + "---|" * (corpus.MAX_PEOPLE + 1),
    ]
    for name, a in acc.items():
        upto6 = statistics.mean(a[n] for n in range(1, 7))
        lines.append(f"| {name} | " + " | ".join(f"{100 * a[n]:.1f}%" for n in a)
                     + f" | {100 * upto6:.1f}% |")
    lines += [
        "",
        "## Names the models never saw",
        "",
        "The same question form with people whose names come from `minikv.course.names`' test "
        "split: no",
        "word of them is in any training text (the models were trained on names of its train "
        "split and on",
        f"the 40 of `corpus.NAMES`). {100 * several:.0f}% of these names are several tokens long. "
        "200 questions for each number of people;",
        "\"training names\" is the held-out table above.",
        "",
        "| model | names | " + " | ".join(str(n) for n in range(1, corpus.MAX_PEOPLE + 1))
        + " | ≤ 6 |",
        "|---|---|" + "---|" * (corpus.MAX_PEOPLE + 1),
    ]
    for (name, which), a in unseen_acc.items():
        upto6 = statistics.mean(a[n] for n in range(1, 7))
        lines.append(f"| {name} | {which} | " + " | ".join(f"{100 * a[n]:.1f}%" for n in a)
                     + f" | {100 * upto6:.1f}% |")
    lines += [
        "",
        "How often a proposer's greedy token equals the target's, over the positions of 40 such",
        "questions (\"prompt\") and of the target's greedy continuations of them (32 tokens "
        "each). The",
        "variants are not drafts (each costs what the target costs); they are there for scale: "
        "models of",
        "the target's own size, made from its weights.",
        "",
        "| proposer | layers | prompt | continuation |",
        "|---|---|---|---|",
    ]
    for name, a in agreement.items():
        lines.append(f"| {name} | {models[name].config.n_layer} | {100 * a['prompt']:.1f}% | "
                     f"{100 * a['continuation']:.1f}% |")
    names, n_positions = by_kind[NEXT_KINDS[0]], sum(k["positions"] for k in by_kind.values())
    lines += [
        "",
        "The prompt positions, by what the next token is. Where it is part of a name neither model "
        "has seen,",
        "or the coin's flip or not, the target's greedy token is a guess (\"target right\": how "
        "often it is",
        "the real next token), and agreeing with it is one guess matching another. "
        f"{100 * names['positions'] / n_positions:.0f}% of the",
        "positions are inside names, so the prompt column above stays far from 100% for any "
        "proposer,",
        "a model of the target's own size included.",
        "",
        "| next token | positions | target right | " + " | ".join(proposers) + " |",
        "|---|---|---|" + "---|" * len(proposers),
    ]
    for kind, c in by_kind.items():
        lines.append(f"| {kind} | {c['positions']:,} | {100 * c['target']:.1f}% | "
                     + " | ".join(f"{100 * c[name]:.1f}%" for name in proposers) + " |")
    lines += [
        "",
        "## Held-out loss (test split, nats per token)",
        "",
        "| model | " + " | ".join(corpus.CORPORA) + " |",
        "|---|" + "---|" * len(corpus.CORPORA),
    ]
    for name, loss in losses.items():
        lines.append(f"| {name} | " + " | ".join(f"{loss[c]:.3f}" for c in corpus.CORPORA) + " |")
    lines += [
        "",
        "## Cost of one decode step (cached, batch 1, `minikv.generate`, median of 9)",
        "",
        "| target | draft | target / draft |",
        "|---|---|---|",
        f"| {1e3 * step['target']:.2f} ms | {1e3 * step['draft']:.2f} ms | "
        f"{step['target'] / step['draft']:.1f}× |",
        "",
        "Timings vary with machine load. Speculative decoding's speed-up depends on this ratio "
        "and on how",
        "often the draft's greedy token equals the target's: along the target's greedy "
        "continuations (100",
        f"tokens each) of {', '.join(repr(p) for p in AGREEMENT_PROMPTS)} they agree on "
        f"**{100 * alpha:.1f}%** of tokens.",
        "",
        "## Greedy completions by the target",
        "",
    ]
    for prompt in PROMPTS:
        lines.append(f"- **{prompt}**{complete(models['target'], tok, prompt)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=arguments.output_file, default="-",
                        help="where to write the Markdown (default '-': print it; the course's "
                             "own report is docs/course-models.md)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N or mps (default: best available)")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.out != "-":
            check_writable(Path(args.out).parent)
    except ValueError as e:
        parser.error(str(e))
    text = report(device)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        write_atomically(args.out, text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
