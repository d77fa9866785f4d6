"""Autoregressive decoding, naive and cached.

naive:  every step feeds the WHOLE sequence again, recomputing every position's K/V (seed 003's waste).
cached: one prefill over the prompt fills the KV cache; each decode step then feeds ONE new token.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .cache import KVCache
from .sampling import check_sampling_args, sample
from .trace import KVCounter, Stats, TraceEvent

MODES = ("naive", "cached")


@dataclass
class GenerationOutput:
    prompt: list[int]
    tokens: list[int]                  # the new tokens, including the EOS that stopped generation
    stats: Stats
    trace: list[TraceEvent] | None     # one event per forward pass, when asked for
    logits: torch.Tensor | None        # (new_tokens, vocab): the logits each token was chosen from, when asked for

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def as_token_list(ids, vocab_size: int) -> list[int]:
    """Validate a prompt given as a list of ints, a 1-D tensor or a (1, T) tensor."""
    if isinstance(ids, str):
        raise TypeError("got text, not token ids: encode it first, e.g. minikv.load_tokenizer().encode(text)")
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got a {ids.dtype} tensor; use dtype=torch.long")
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"prompt must be 1-D (T,) or (1, T), got shape {tuple(ids.shape)}; "
                             f"generate one sequence at a time")
        ids = ids.tolist()
    try:
        tokens = [operator.index(t) for t in ids]  # accepts int and numpy ints, rejects floats
    except TypeError as e:
        raise TypeError(f"token ids must be ints, got {ids!r:.80}: {e}") from None
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token (e.g. the tokenizer's <|endoftext|> id)")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                         f"encode with the model's own tokenizer")
    return tokens


def generate(model, ids, max_new_tokens: int, mode: str = "cached", temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | None = None, *,
             cache: KVCache | None = None, trace: bool = False, return_logits: bool = False,
             position_offset_bug: bool = False) -> GenerationOutput:
    """Generate up to `max_new_tokens` after `ids`, stopping early after `eos_id`.

    temperature 0 is greedy; otherwise tokens are sampled from a torch.Generator seeded with `seed`,
    so the same seed gives the same tokens on the same device. In cached mode a `cache` may be passed
    to continue from the positions it already holds (it is extended in place: `fork()` it to keep it).
    `position_offset_bug` reproduces seed 003's wrong approach: positions restart at 0 every step.
    """
    cfg = model.config
    prompt = as_token_list(ids, cfg.vocab_size)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    check_sampling_args(temperature, top_k)
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id must be a token id in [0, {cfg.vocab_size}) or None, got {eos_id!r}")
    if mode == "naive" and (cache is not None or position_offset_bug):
        raise ValueError("cache= and position_offset_bug= only apply to mode='cached'")
    past = 0 if cache is None else cache.get_seq_length()
    # The last new token is returned, never fed back, so the model sees at most this many positions.
    needed = past + len(prompt) + max_new_tokens - 1
    if needed > cfg.block_size:
        raise ValueError(f"{past} cached + {len(prompt)} prompt + {max_new_tokens} new tokens needs {needed} "
                         f"positions > block_size={cfg.block_size}; lower max_new_tokens or shorten the prompt")
    if cache is not None and needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions but this call needs {needed}; "
                         f"pass a larger cache or lower max_new_tokens")
    if mode == "cached" and cache is None and max_new_tokens > 0:
        cache = KVCache.for_model(model, batch_size=1, max_len=needed)

    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    stats = Stats(prompt_len=len(prompt))
    events: list[TraceEvent] = []
    step_logits: list[torch.Tensor] = []
    sequence = list(prompt)
    with torch.inference_mode(), KVCounter(model) as counter:
        for step in range(max_new_tokens):
            if mode == "naive":
                inputs, before = sequence[:], 0  # recompute every position, every step
            else:
                inputs, before = (prompt if step == 0 else sequence[-1:]), cache.get_seq_length()
            positions = range(len(inputs)) if position_offset_bug else range(before, before + len(inputs))
            kv_before = counter.count
            logits = model(torch.tensor([inputs], device=device), cache=cache, last_only=True,
                           positions=torch.tensor(list(positions), device=device) if position_offset_bug else None)[0, -1]
            token = int(sample(logits, temperature, top_k, generator))
            sequence.append(token)
            stats.forward_passes += 1
            stats.positions_processed += len(inputs)
            if return_logits:
                step_logits.append(logits.float().clone())
            if trace:
                kind = "recompute" if mode == "naive" else ("prefill" if step == 0 else "decode")
                events.append(TraceEvent(step=step, kind=kind, input_ids=tuple(inputs), positions=tuple(positions),
                                         cache_len_before=before, cache_len_after=cache.get_seq_length() if cache else 0,
                                         kv_computed=counter.count - kv_before, token=token))
            if token == eos_id:
                break
    stats.new_tokens = len(sequence) - len(prompt)
    stats.kv_computed = counter.count
    return GenerationOutput(prompt=prompt, tokens=sequence[len(prompt):], stats=stats,
                            trace=events if trace else None,
                            logits=torch.stack(step_logits) if step_logits else None)
