"""Train a course model from scratch, in the spirit of nanoGPT's train.py.

    python -m minikv train --preset all --ship   # retrain the shipped models, every phase
    python -m minikv train --preset all --phase 2 --ship   # only the second phases (FINISHING)
    python -m minikv train --preset target --steps 200 --out runs/try --device cuda

Data: the train splits of the course corpora (minikv.course.corpus), tokenized with the course
tokenizer, documents ending in <|endoftext|>. Each training row is block_size + 1 tokens of whole
documents picked at random from one corpus (drawn with the weights in `mix`) and joined, so a row
starts at a document start, as prompts do. Optimiser: AdamW, linear warmup then cosine decay,
gradient-norm clipping. Seeded: the same seed gives the same initial weights and the same batches.
The target and the draft train in two phases (TRAINING, then FINISHING from its weights); the
grouped-query variants are uptrained from the target (UPTRAINING).
"""
from __future__ import annotations

import argparse
import io
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine import GPT, PRESETS, GPTConfig
from ..engine.validate import int_at_least
from . import arguments, corpus
from .checkpoint import COURSE_MODELS, MODELS_DIR, load_checkpoint, read_metadata, save_checkpoint
from .device import describe_device, resolve_device
from .files import check_writable, claim_directory, write_atomically
from .tokenizer import load_tokenizer
from .variants import low_rank_kv, mean_pool_kv_heads, share_kv_layers


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16             # rows of block_size tokens per step
    lr: float = 1e-3                 # peak learning rate, reached after `warmup` steps
    min_lr: float = 1e-4             # cosine decay ends here at the last step
    warmup: int = 50
    weight_decay: float = 0.1        # on matrices only, not on biases and LayerNorm gains
    grad_clip: float = 1.0           # max global gradient norm
    # std of the initial weights; 0.02 is GPT-2's (see init_weights)
    init_std: float = 0.02
    # bfloat16 autocast where the hardware has it (see autocast_dtype)
    bf16: bool = True
    # weight of the answer tokens (" heads", " tails") in the loss: they are a few percent of a
    # coin flip's tokens, and what the model must learn; a name's tokens are noise to predict
    answer_weight: float = 1.0
    # a curriculum: coin-flip rows start at questions of at most 2 people, a limit that rises
    # evenly to MAX_PEOPLE over this fraction of the steps (0: every question from the start)
    curriculum: float = 0.0
    # draw each coin-flip question in proportion to (its number of people) ** people_power: 1 gives
    # each question rows in proportion to its flips to learn, 2 favours the long chains, the
    # hardest, even more; 0: every question equally often
    people_power: int = 0
    # learn the target's next-token probabilities on each row (knowledge distillation, Hinton et
    # al. 2015) instead of the text's next token: a draft is paid for agreeing with the target,
    # and where the text cannot be predicted (a name it never saw) it should guess as the target
    # guesses; train() then needs the target as `teacher`
    distill: bool = False
    mix: dict = field(default_factory=lambda: {"coinflip": 1 / 3, "facts": 1 / 3, "stories": 1 / 3})
    docs: dict = field(default_factory=lambda: {"coinflip": 4000, "facts": 4000, "stories": 4000})
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup"):
            int_at_least(f"TrainConfig.{name}", getattr(self, name))
        for name in ("lr", "min_lr", "init_std", "grad_clip", "answer_weight"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 < value < math.inf:
                raise ValueError(f"TrainConfig.{name} must be a positive number, got {value!r}")
        if type(self.people_power) is not int or self.people_power < 0:
            raise ValueError(f"TrainConfig.people_power must be an int >= 0, got "
                             f"{self.people_power!r}")
        for name in ("distill", "bf16"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"TrainConfig.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        if type(self.curriculum) not in (int, float) or not 0 <= self.curriculum <= 1:
            raise ValueError(f"TrainConfig.curriculum must be in [0, 1], got {self.curriculum!r}")
        if type(self.weight_decay) not in (int, float) or not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("mix", "docs"):
            table = getattr(self, name)
            if (not isinstance(table, dict) or not table or set(table) - set(corpus.CORPORA)
                    or not all(type(v) in (int, float) and v > 0 for v in table.values())):
                raise ValueError(f"TrainConfig.{name} must map corpora of {corpus.CORPORA} to "
                                 f"positive numbers, got {table!r}")
        if set(self.mix) - set(self.docs):
            raise ValueError(f"TrainConfig.mix draws from {sorted(self.mix)} but docs only loads "
                             f"{sorted(self.docs)}")


# The shipped models' shapes (engine/config.py's presets): the target is deep and narrow because a
# coin's state after n people is a chain of n flips: trained alike, 12 layers of 192 tracked 4
# flips of unseen names by step 1,200, 6 layers of 256 only 2; the one-layer draft is several
# times cheaper per decode step, for speculative decoding.
# The shipped models, tuned on the course's 2-core CPU (results: docs/course-models.md). Coin flips
# are the hard skill, so they get most of the target's rows, their answers weigh 10 times a name's
# token, and their questions grow from 2 people to 8 over the first 30% of the steps: measured on
# the 12-layer target, without the curriculum it still answered at chance after 600 steps, with it
# it had 1 to 4 flips of unseen names right by step 1,200. Drawing questions in proportion to their
# people (people_power=1) lifted unseen names of 5-8 people from 100/96/91/84% to 100/99/95/87%
# (100 questions each, two otherwise equal runs). Facts and stories are templates that even
# the one-layer draft learns well. Both draw from more train documents than corpus.splits' default
# (still the train split only, so no held-out question leaks), so that they see few repeats.
MANY_DOCS = {"coinflip": 60000, "facts": 20000, "stories": 20000}
TRAINING: dict[str, TrainConfig] = {
    "target": TrainConfig(steps=2200, batch_size=16, lr=2e-3, min_lr=1e-4, warmup=100, init_std=0.1,
                          mix={"coinflip": 0.9, "facts": 0.04, "stories": 0.06}, docs=MANY_DOCS,
                          answer_weight=10.0, curriculum=0.3, people_power=1),
    "draft": TrainConfig(steps=3000, batch_size=16, lr=2e-3, min_lr=1e-4, warmup=100, init_std=0.1,
                         mix={"coinflip": 0.5, "facts": 0.2, "stories": 0.3}, docs=MANY_DOCS),
}
# chapter 08's RoPE model: the target's recipe, step for step, so that the block is what differs
TRAINING["target-rope"] = TRAINING["target"]


# Each course model's second phase, run on from the first's weights (`train --phase 2` runs it
# alone, on from the shipped model). The target: 1,000 more steps at a quarter of its peak rate,
# every question from the start, drawn in proportion to its people squared. Measured from the
# first phase's weights, 500 such steps took unseen names of 8 people from 86% to 94% (people ** 1:
# 90%, ** 3: 91.5%; 200 questions of another sample than the report's, where 500 steps went from
# 85% to 90% and 1,000 to 95%). The draft: distilled from the target (TrainConfig.distill); along
# the course prompts' continuations its greedy token is the target's 92% of the time
# (docs/course-models.md); the first phase's draft and target, undistilled, agreed 86%.
FINISHING: dict[str, TrainConfig] = {
    "target": replace(TRAINING["target"], steps=1000, lr=5e-4, min_lr=5e-5, warmup=20,
                      curriculum=0.0, people_power=2, seed=2),
    "draft": replace(TRAINING["draft"], steps=400, lr=1e-3, min_lr=1e-4, warmup=20, distill=True,
                     seed=2),
}
FINISHING["target-rope"] = FINISHING["target"]
# Stored as float16 (computed in float32 once loaded), to keep every shipped weight file within
# 80 MB together: a float16 weight is within 1/2048 of the float32 one, and on the 8-person
# question of chapter 07 it moves the variants' logits by under 0.01, no greedy token.
STORED_FLOAT16 = ("target-gqa2", "target-mqa", "target-rope", "target-mla", "target-cla2")
# what a model's metadata keeps of each phase
PHASE_KEYS = ("train", "wall_time_s", "tokens_seen", "final_train_loss", "device", "cpu_threads",
              "date")

# Grouped-query variants of the target (chapter 07), made as Ainslie et al. (2023) made theirs: the
# target's K/V heads mean-pooled (minikv.course.variants), then "uptrained" at a lower learning
# rate for 5% of the steps of the target's first phase (3% of all its steps).
VARIANTS = {"target-gqa2": 2, "target-mqa": 1}  # name -> K/V heads, of the target's 8
# Chapter 12's variants, made from the target by a conversion (minikv.course.variants) and
# uptrained as the grouped-query ones are: a latent of 48 numbers per layer and position (MLA;
# target-mqa's one K/V head holds 2 x 24, the same bytes), and pairs of layers that read one
# K/V (cross-layer attention: half the target's bytes). name -> (how it was made, the maker)
CACHE_VARIANTS = {
    "target-mla": ("the target, [W_K; W_V] factored to rank 48 (truncated SVD)",
                   partial(low_rank_kv, rank=48)),
    "target-cla2": ("the target, each pair of layers reading the lower one's K/V",
                    partial(share_kv_layers, layers=2)),
}
UPTRAINING = TrainConfig(steps=TRAINING["target"].steps // 20, batch_size=16, lr=5e-4,
                         min_lr=5e-5, warmup=10, init_std=0.1, mix=TRAINING["target"].mix,
                         answer_weight=TRAINING["target"].answer_weight,
                         people_power=TRAINING["target"].people_power, docs=MANY_DOCS,
                         seed=1)


def init_weights(model: GPT, std: float) -> None:
    """GPT-2's initialisation with standard deviation `std` (residual projections scaled by
    1/sqrt(2 n_layer); biases stay zero). GPT-2's 0.02 suits big models. A coin flip's answer is an
    XOR of the start state and every flip, which gives gradient descent no signal until it finds the
    interaction: measured here, a 2-layer model trained on coin flips alone was still at chance
    after 1,500 steps from std 0.02, but from std 0.1 it solved the chain-of-thought steps within
    300 steps and answered up to 6 flips directly by step 1,500."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scale = math.sqrt(2 * model.config.n_layer) if name.endswith("c_proj.weight") else 1.0
            torch.nn.init.normal_(p, mean=0.0, std=std / scale)


def autocast_dtype(device: torch.device, enabled: bool = True) -> torch.dtype | None:
    """bfloat16 for the matmuls when the device supports it (weights and optimiser stay float32);
    on this course's 2-core AVX512-BF16 CPU it halves the time per step. None means plain
    float32."""
    if not enabled:
        return None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        try:
            return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
        except (AttributeError, RuntimeError):
            return None
    return None


def load_corpora(tok, docs: dict[str, int], split: str = "train",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """Each corpus's `split` as one 1-D tensor of token ids (documents end in EOT)."""
    out = {}
    for name, n in docs.items():
        sizes = {"train": (n, 200, 200), "val": (0, n, 0), "test": (0, 0, n)}[split]
        text = corpus.splits(name, seed=seed, sizes=sizes)[split]
        out[name] = torch.tensor(tok.encode(text, allowed_special={corpus.EOT}), dtype=torch.long)
    return out


def documents(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """(n_docs, 2): each document's start and end offsets in `tokens` (its EOT included)."""
    ends = (tokens == eot).nonzero().flatten() + 1
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # on the tokens' device (CUDA too)
    return torch.stack([starts, ends], dim=1)


def get_batch(data, docs, mix, batch_size, block_size, gen):
    """(x, y): batch_size rows of block_size tokens, y shifted by one. Each row is whole documents
    of one corpus (drawn with weights `mix`) picked at random from `docs` and joined, so each row
    starts a document, as a prompt does."""
    names = list(mix)
    which = torch.multinomial(torch.tensor([mix[n] for n in names]), batch_size, replacement=True,
                              generator=gen)
    rows = []
    for k in which.tolist():
        pool, row, length = docs[names[k]], [], 0
        while length < block_size + 1:
            start, end = pool[int(torch.randint(len(pool), (1,), generator=gen))].tolist()
            row.append(data[names[k]][start:end])
            length += end - start
        rows.append(torch.cat(row)[:block_size + 1])
    rows = torch.stack(rows)
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup to tc.lr, then cosine decay to tc.min_lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - 1 - tc.warmup)
    return tc.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (tc.lr - tc.min_lr)


def people_limit(step: int, tc: TrainConfig) -> int:
    """The most people a coin-flip row may start with at `step` (see TrainConfig.curriculum)."""
    ramp = tc.curriculum * tc.steps
    if ramp == 0:
        return corpus.MAX_PEOPLE
    return min(corpus.MAX_PEOPLE, 2 + int((corpus.MAX_PEOPLE - 1) * step / ramp))


def people_pools(docs: torch.Tensor, people: torch.Tensor, power: int) -> dict:
    """{limit: the coin-flip documents (rows of `docs`) of at most `limit` people}, for limits
    2..MAX_PEOPLE; each document is listed people ** power times, so that get_batch's uniform
    draw picks it in proportion to that."""
    times = people ** power
    return {m: docs[people <= m].repeat_interleave(times[people <= m], dim=0)
            for m in range(2, corpus.MAX_PEOPLE + 1)}


@torch.no_grad()
def corpus_loss(model: GPT, tokens: torch.Tensor, eot: int, max_rows: int = 64, cache=None,
                attention=None) -> float:
    """Mean next-token loss over whole documents, each evaluated from its start (as prompts are).
    `cache(model, batch_size)` and `attention` as in minikv.course.evaluate.coin_flip_accuracy."""
    model.eval()
    bounds = torch.cat([torch.zeros(1, dtype=torch.long),
                        (tokens == eot).nonzero().flatten() + 1]).tolist()
    total, count = 0.0, 0
    docs = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
    for k in range(0, len(docs), max_rows):
        chunk = docs[k:k + max_rows]
        T = min(max(len(d) for d in chunk), model.config.block_size + 1)
        x = torch.full((len(chunk), T), eot, dtype=torch.long)
        for r, d in enumerate(chunk):
            x[r, :len(d[:T])] = d[:T]
        kwargs = {} if attention is None else {"attention": attention}
        if cache is not None:
            kwargs["cache"] = cache(model, len(chunk))
        logits = model(x[:, :-1].to(model.device), **kwargs)
        y = x[:, 1:].clone()
        for r, d in enumerate(chunk):
            y[r, len(d[:T]) - 1:] = -100  # ignore padding
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten().to(model.device),
                               ignore_index=-100, reduction="sum")
        total, count = total + loss.item(), count + int((y != -100).sum())
    return total / count


def train(preset: str, tc: TrainConfig | None = None, device=None, progress: bool = True,
          callback=None, init: GPT | None = None, teacher: GPT | None = None,
          state: Path | None = None, save_every: int = 100) -> tuple[GPT, dict]:
    """Train a model of shape `preset` (its vocabulary set to the course tokenizer's), or go on
    training `init` (uptraining: its shape and weights are the start); return the model and its
    metadata. `callback(step, model)`, if given, runs after every step (e.g. to watch an
    experiment). `teacher`: the model whose probabilities a `distill` config learns. `state`: a
    file where the run is saved every `save_every` steps and, if it holds this run, goes on
    from (weights, optimiser, data order, step), as if never stopped; removed at the end."""
    tc = tc or TRAINING.get(preset, TrainConfig())
    if tc.distill != (teacher is not None):
        raise ValueError("a distill config needs a teacher model, and only it takes one")
    tok = load_tokenizer()
    eot = tok.eot_token
    answers = torch.tensor([tok.encode(" " + state)[0] for state in corpus.STATES])
    config = init.config if init is not None else GPTConfig.preset(preset, vocab_size=tok.n_vocab)
    device = resolve_device(device)
    data = {name: t.to(device) for name, t in load_corpora(tok, tc.docs).items()}
    docs = {name: documents(t, eot).cpu() for name, t in data.items()}
    if "coinflip" in docs:  # the coin-flip questions by number of people, for the curriculum
        text = corpus.splits("coinflip", seed=0, sizes=(tc.docs["coinflip"], 200, 200))["train"]
        people = torch.tensor([corpus.people_in(d) for d in text.split(corpus.EOT)[:-1]])
        by_limit = people_pools(docs["coinflip"], people, tc.people_power)
    torch.manual_seed(tc.seed)
    gen = torch.Generator().manual_seed(tc.seed)  # the data order
    model = GPT(config)
    if init is None:
        init_weights(model, tc.init_std)
    else:
        model.load_state_dict(init.state_dict())
    model.to(device)
    answers = answers.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    amp = autocast_dtype(device, tc.bf16)
    model.train()
    run = dict(preset=preset, train=asdict(tc), config=config.to_dict())
    first, smooth, before = resume(state, run, model, opt, gen)
    start = time.perf_counter() - before
    bar = tqdm(range(first, tc.steps), desc=f"train {preset}", disable=not progress,
               initial=first, total=tc.steps)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        if "coinflip" in docs:
            docs["coinflip"] = by_limit[people_limit(step, tc)]
        x, y = get_batch(data, docs, tc.mix, tc.batch_size, config.block_size, gen)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = model(x)
            if teacher is not None:  # soft targets: the teacher's distribution at each position
                with torch.no_grad():
                    wanted = teacher(x).float().softmax(-1).flatten(0, 1)
        if teacher is None:
            wanted = y.flatten()
        losses = F.cross_entropy(logits.float().flatten(0, 1), wanted, reduction="none")
        weights = torch.where(torch.isin(y.flatten(), answers), tc.answer_weight, 1.0)
        loss = (losses * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr_at(step, tc):.1e}")
        if state is not None and (step + 1) % save_every == 0 and step + 1 < tc.steps:
            save_state(state, run, step + 1, smooth, time.perf_counter() - start, model, opt, gen)
        if callback is not None:
            callback(step, model)
    wall = time.perf_counter() - start
    if state is not None:
        Path(state).unlink(missing_ok=True)
    val = load_corpora(tok, {name: 200 for name in tc.docs}, split="val")
    metadata = dict(
        preset=preset, config=config.to_dict(), train=asdict(tc),
        tokens_seen=tc.steps * tc.batch_size * config.block_size,
        final_train_loss=round(smooth, 4) if smooth is not None else None,
        val_loss={name: round(corpus_loss(model, t, eot), 4) for name, t in val.items()},
        wall_time_s=round(wall, 1), num_params=model.num_params(), device=describe_device(device),
        autocast=str(amp).removeprefix("torch.") if amp else None,
        cpu_threads=torch.get_num_threads(), torch=torch.__version__,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    return model.eval(), metadata


def save_state(path: Path, run: dict, step: int, smooth: float, wall: float, model: GPT,
               opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """Everything a run needs to go on from `step`, written atomically (a Ctrl-C mid-write
    leaves the last state whole)."""
    buffer = io.BytesIO()
    torch.save(dict(run=json.dumps(run, sort_keys=True), step=step, smooth=smooth, wall=wall,
                    model=model.state_dict(), opt=opt.state_dict(), gen=gen.get_state()), buffer)
    write_atomically(path, buffer.getvalue())


def resume(path: Path | None, run: dict, model: GPT, opt: torch.optim.Optimizer,
           gen: torch.Generator) -> tuple[int, float | None, float]:
    """The step, smoothed loss and seconds a saved run had reached, with model, optimiser and
    data order restored; (0, None, 0.0) when there is nothing to go on from. A state of another
    run (preset, config, TrainConfig) is refused rather than mixed in."""
    if path is None or not Path(path).exists():
        return 0, None, 0.0
    saved = torch.load(path, map_location=model.device, weights_only=True)  # no code unpickled
    if saved.get("run") != json.dumps(run, sort_keys=True):
        raise ValueError(f"{path} holds another run's state (preset, config or TrainConfig "
                         f"differ): remove it, or train with the settings it was saved with")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    gen.set_state(saved["gen"].cpu())
    return saved["step"], saved["smooth"], saved["wall"]


_positive, _seed = arguments.positive, arguments.seed  # train_head's names for them


def output_dirs(presets: list[str], out: str | None, ship: bool) -> dict[str, Path]:
    """Where each preset's checkpoint goes. The shipped course models are written over only with
    --ship; otherwise runs/<preset> (or --out). Checked for writability before any training."""
    dirs = {}
    for preset in presets:
        shipped = MODELS_DIR / preset
        if ship:
            if preset not in COURSE_MODELS or out:
                raise ValueError(f"--ship writes the shipped course models {COURSE_MODELS} into "
                                 f"{MODELS_DIR}; it takes no --out and no other preset")
            dirs[preset] = shipped
        else:
            dirs[preset] = Path(out) if out else Path("runs") / preset
            try:
                if dirs[preset].resolve() == shipped.resolve() or (
                        dirs[preset].resolve().parent == MODELS_DIR.resolve()):
                    raise ValueError(f"{dirs[preset]} holds a shipped course model: pass --ship "
                                     f"to overwrite it on purpose")
            except (OSError, RuntimeError) as e:
                raise ValueError(f"cannot resolve --out {out!r}: {e}") from None
    for directory in dirs.values():
        if ship:  # the shipped models' own places, chosen on purpose
            check_writable(directory)
        else:  # new, empty, or an earlier train's: never a folder of anyone else's files
            claim_directory(directory, "train", replace=True)
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True,
                        choices=["all", *sorted(PRESETS), *VARIANTS, *CACHE_VARIANTS],
                        help="model shape from minikv.engine.PRESETS, or a variant of the target "
                             "that caches less (fewer K/V heads, a latent, shared layers; "
                             "uptrained from it); 'all' = the course's draft, target and "
                             "variants")
    parser.add_argument("--steps", type=_positive, default=None,
                        help="override the preset's number of steps (at least 1)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N or mps (default: best available)")
    parser.add_argument("--out", default=None,
                        help="output directory (default: runs/<preset>)")
    parser.add_argument("--ship", action="store_true",
                        help=f"write the course models into {MODELS_DIR}, replacing the shipped "
                             "ones (what `python -m minikv evaluate` and the chapters load)")
    parser.add_argument("--seed", type=_seed, default=None)
    parser.add_argument("--phase", type=int, choices=[1, 2], default=None,
                        help="run one phase only: 1 = the first, from scratch; 2 = the second "
                             "(FINISHING), on from the shipped model (default: every phase)")
    parser.add_argument("--resumable", action="store_true",
                        help="save each phase every 100 steps (runs/<preset>.phase<N>.state); "
                             "run the same command again to go on from there after a stop")
    parser.add_argument("--init", type=arguments.directory, default=None, metavar="DIR",
                        help="with --phase 2: go on from this checkpoint instead of the shipped "
                             "model (a first phase saved with --phase 1 --out DIR)")
    args = parser.parse_args(argv)
    if args.init and args.phase != 2:
        parser.error("--init is the start of a second phase: give --phase 2 too")
    # the target first: the draft's second phase learns from it, the variants start from it
    every = ["target", "draft", "target-rope", *VARIANTS, *CACHE_VARIANTS]
    presets = every if args.preset == "all" else [args.preset]
    if args.out and len(presets) > 1:
        parser.error("--out needs a single --preset")
    try:
        dirs = output_dirs(presets, args.out, args.ship)
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    trained: dict[str, GPT] = {}
    for preset in presets:
        made = preset in VARIANTS or preset in CACHE_VARIANTS
        phases = [UPTRAINING] if made else [TRAINING.get(preset, TrainConfig())] + (
            [FINISHING[preset]] if preset in FINISHING else [])
        model, history = None, []
        if made:  # one phase, from the target trained just now or the shipped one
            target = trained.get("target") or load_checkpoint(MODELS_DIR / "target", device)
            model = (mean_pool_kv_heads(target, VARIANTS[preset]) if preset in VARIANTS
                     else CACHE_VARIANTS[preset][1](target))
        elif args.phase == 2:  # on from the shipped model; its metadata holds its first phase
            if preset not in FINISHING:
                parser.error(f"{preset} has one phase of training: --phase 2 is for "
                             f"{sorted(FINISHING)}")
            start_dir = Path(args.init) if args.init else MODELS_DIR / preset
            try:
                model = load_checkpoint(start_dir, device)
            except ValueError as e:
                parser.error(str(e))
            shipped = read_metadata(start_dir)
            history = shipped.get("phases", [{key: shipped.get(key) for key in PHASE_KEYS}])[:1]
            phases = phases[1:]
        elif args.phase == 1:
            phases = phases[:1]
        for tc in phases:
            number = len(history) + 1  # 1 or 2: the phase this is
            state = (Path("runs") / f"{preset}.phase{number}.state" if args.resumable
                     else None)  # never beside a shipped model
            if args.steps is not None:
                tc = replace(tc, steps=args.steps, warmup=min(tc.warmup, max(1, args.steps // 10)))
            if args.seed is not None:
                tc = replace(tc, seed=args.seed)
            teacher = None
            if tc.distill:  # the target trained just now, or the shipped one
                teacher = trained.get("target") or load_checkpoint(MODELS_DIR / "target", device)
            model, metadata = train(preset, tc, device, init=model, teacher=teacher, state=state)
            history.append({key: metadata[key] for key in PHASE_KEYS})
        if made:
            metadata["uptrained_from"] = (CACHE_VARIANTS[preset][0] if preset in CACHE_VARIANTS
                                          else "the target, K/V heads mean-pooled")
        metadata.update(phases=history,
                        wall_time_s=round(sum(h["wall_time_s"] for h in history), 1),
                        tokens_seen=sum(h["tokens_seen"] for h in history))
        trained[preset] = model
        stored = torch.float16 if preset in STORED_FLOAT16 else torch.float32
        metadata["stored_dtype"] = str(stored).removeprefix("torch.")
        save_checkpoint(model, dirs[preset], metadata, dtype=stored,
                        mark=None if args.ship else "train")
        print(f"{preset}: {metadata['num_params']:,} parameters, "
              f"{metadata['wall_time_s']:.0f} s on {metadata['device']}, "
              f"train loss {metadata['final_train_loss']}, "
              f"val loss {metadata['val_loss']} -> {dirs[preset]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
