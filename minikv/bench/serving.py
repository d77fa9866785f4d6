"""Serving many requests: one at a time, static batching, continuous batching over the paged
cache, and Hugging Face's batched generate as a peer; and prefix caching on a shared prompt.
`python -m minikv bench` and chapter 06 call these.

Arrivals are counted in engine steps. The workloads arrive faster than any of the servers can
finish them (a queue builds), so every server always has work and tokens/s compares the servers,
not the arrival rate."""
from __future__ import annotations

import math
import random

import torch

from ..engine import GPT, Request, generate, generate_batch, serve
from . import alternate


def workload(prompts: list[list[int]], n: int, seed: int = 0, new_tokens=(4, 128),
             long_tailed: bool = True, arrivals_per_step: float = 4.0) -> list[Request]:
    """n greedy requests: prompts drawn from `prompts`; output budgets in `new_tokens`, uniform in
    their logarithm when `long_tailed` (many short answers, a few long ones, as in chat logs) or
    uniform; Poisson arrivals, on average `arrivals_per_step` a step."""
    rng = random.Random(seed)
    lo, hi = new_tokens
    requests, step = [], 0.0
    for _ in range(n):
        step += rng.expovariate(arrivals_per_step)
        budget = (round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if long_tailed
                  else rng.randint(lo, hi))
        requests.append(Request(list(rng.choice(prompts)), budget, arrival=int(step)))
    return requests


class PassCount:
    """Forward passes of `model` inside a `with` block (a forward pre-hook counts them)."""

    def __init__(self, model: GPT):
        self.model, self.n = model, 0

    def __enter__(self) -> "PassCount":
        self._hook = self.model.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


def kv_bytes(model: GPT, positions: int) -> int:
    """Bytes of K and V for `positions` positions of every layer."""
    cfg = model.config
    return 2 * cfg.n_layer * cfg.n_embd * positions * model.dtype.itemsize


def one_at_a_time(model, requests: list[Request]) -> dict:
    """Every request alone, in arrival order: the baseline. KV memory: the longest request's."""
    with PassCount(model) as passes:
        tokens = [generate(model, r.prompt, r.max_new_tokens).tokens for r in requests]
    peak = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return {"tokens": tokens, "passes": passes.n,
            "rows": sum(len(r.prompt) + r.max_new_tokens - 1 for r in requests),
            "kv_positions": peak}


def batches(requests: list[Request], batch_size: int) -> list[list[int]]:
    """Request indices in arrival order, batch_size at a time."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def static_kv_positions(requests: list[Request], batch_size: int) -> int:
    """Positions static batching reserves: the largest batch x (longest prompt + longest
    output) in it."""
    return max(len(group) * (max(len(requests[i].prompt) for i in group)
                             + max(requests[i].max_new_tokens for i in group))
               for group in batches(requests, batch_size))


def static_batching(model, requests: list[Request], batch_size: int) -> dict:
    """Requests in arrival order, batch_size at a time, each batch padded to its longest prompt
    (generate_batch) and run until its longest output is done: a finished row keeps its place.
    KV memory: the largest batch's padded cache, reserved for the whole batch."""
    tokens: list = [None] * len(requests)
    rows = 0
    with PassCount(model) as passes:
        for group in batches(requests, batch_size):
            n = max(requests[i].max_new_tokens for i in group)
            outs = generate_batch(model, [requests[i].prompt for i in group], n)
            for i, out in zip(group, outs):
                tokens[i] = out.tokens[: requests[i].max_new_tokens]
            rows += len(group) * (max(len(requests[i].prompt) for i in group) + n - 1)  # padded
    return {"tokens": tokens, "passes": passes.n, "rows": rows,
            "kv_positions": static_kv_positions(requests, batch_size)}


def continuous_batching(model, requests: list[Request], block_size: int, num_blocks: int,
                        prefix_caching: bool = True, max_running: int | None = None) -> dict:
    """minikv.serve over a pool of num_blocks blocks (and at most max_running requests at once):
    requests join and leave the batch at every step. Rows: token positions pushed through the
    model. Waste: the most unused positions a request ever held in its blocks. Batch: the mean
    and the largest number of requests in a decode pass."""
    with PassCount(model) as passes:
        outs = serve(model, requests, page_size=block_size, num_blocks=num_blocks, trace=True,
                     prefix_caching=prefix_caching, max_running=max_running)
    waste = max((len(blocks) * block_size - step.lengths[r]
                 for step in outs.pool_steps for r, blocks in step.tables.items()), default=0)
    rows = sum(e.kv_computed for o in outs for e in o.trace)  # every token row of every pass
    batch = {e.step: e.batch for o in outs for e in o.trace if e.kind == "decode"}
    return {"tokens": [o.tokens for o in outs], "passes": passes.n, "rows": rows,
            "mean_batch": sum(batch.values()) / max(len(batch), 1),
            "max_batch": max(batch.values(), default=0),
            "kv_positions": num_blocks * block_size, "waste_per_request": waste,
            "preempted": sum(o.stats.preempted for o in outs)}


def hf_twin(model: GPT):
    """Hugging Face's GPT2LMHeadModel with this model's weights (None without transformers)."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, layer_norm_epsilon=cfg.layer_norm_eps,
        bos_token_id=0, eos_token_id=0))
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # GPT-2 stores these (in, out)
    state = {("" if k.startswith("lm_head") else "transformer.") + k.removeprefix("transformer."):
             v.t() if k.endswith(conv1d) else v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, strict=False)  # the causal-mask buffers are HF's own
    return hf.to(model.device, model.dtype).eval()


def hf_static_batching(hf_model, requests: list[Request], batch_size: int) -> dict:
    """Hugging Face transformers' batched generate on the same batches: left padding and an
    attention mask, greedy, with its own KV cache."""
    tokens: list = [None] * len(requests)
    for group in batches(requests, batch_size):
        prompts = [requests[i].prompt for i in group]
        width, n = max(map(len, prompts)), max(requests[i].max_new_tokens for i in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids.to(hf_model.device),
                                    attention_mask=mask.to(hf_model.device), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=0)
        for i, row in zip(group, out[:, width:].tolist()):
            tokens[i] = row[: requests[i].max_new_tokens]
    return {"tokens": tokens}


def bench_serving(model, requests: list[Request], batch_size: int, block_size: int,
                  repeats: int, device, with_hf: bool = True) -> dict:
    """Tokens/s and KV memory of each way to serve `requests`, continuous batching given the same
    KV memory as static batching, first without prefix caching (batching alone), then with it
    (requests that repeat a prompt reuse its blocks); every ratio against static batching in the
    same run."""
    num_blocks = static_kv_positions(requests, batch_size) // block_size
    hf = hf_twin(model) if with_hf else None
    runs = {"one at a time": lambda: one_at_a_time(model, requests),
            "static batching": lambda: static_batching(model, requests, batch_size),
            "continuous batching": lambda: continuous_batching(model, requests, block_size,
                                                               num_blocks, prefix_caching=False),
            "continuous batching + prefix caching": lambda: continuous_batching(
                model, requests, block_size, num_blocks)}
    if hf is not None:
        runs["transformers batched generate"] = lambda: hf_static_batching(hf, requests,
                                                                           batch_size)
    results: dict = {}
    seconds = alternate({name: lambda name=name, run=run: results.update({name: run()})
                         for name, run in runs.items()}, repeats, device)
    useful = sum(r.max_new_tokens for r in requests)
    reference = results["one at a time"]["tokens"]
    reserved = num_blocks * block_size  # transformers reserves as static batching does
    rows = {}
    for name, r in results.items():
        rows[name] = {"seconds": seconds[name], "tokens_per_s": useful / seconds[name],
                      "vs_static": seconds["static batching"] / seconds[name],
                      "kv_bytes": kv_bytes(model, r.get("kv_positions", reserved)),
                      "same_tokens": sum(a == b for a, b in zip(r["tokens"], reference)),
                      "passes": r.get("passes"), "rows": r.get("rows")}
    cont = results["continuous batching"]
    return {"requests": len(requests), "new_tokens": useful, "batch_size": batch_size,
            "block_size": block_size, "num_blocks": num_blocks, "rows": rows,
            "waste_per_request": cont["waste_per_request"], "preempted": cont["preempted"],
            "prompt_lengths": (min(len(r.prompt) for r in requests),
                               max(len(r.prompt) for r in requests)),
            "output_lengths": (min(r.max_new_tokens for r in requests),
                               max(r.max_new_tokens for r in requests))}


def prefix_caching_run(model, shared: list[int], suffixes: list[list[int]], block_size: int,
                       prefix_caching: bool) -> dict:
    """One request per suffix, each `shared + suffix`, arriving one engine step apart, asking for
    one token: every step is one request's prefill, so its time is that request's time to first
    token. K/V computed and reused positions, with or without prefix caching."""
    requests = [Request(shared + s, 1, arrival=i) for i, s in enumerate(suffixes)]
    outs = serve(model, requests, page_size=block_size, prefix_caching=prefix_caching)
    reused = sum(o.stats.reused for o in outs)
    return {"kv_computed": sum(len(r.prompt) for r in requests) - reused, "reused": reused,
            "reused_each": [o.stats.reused for o in outs], "tokens": [o.tokens for o in outs]}


def bench_prefix_caching(model, shared: list[int], suffixes: list[list[int]], block_size: int,
                         repeats: int, device) -> dict:
    """K/V computed, bytes of K/V held for the prompts and mean time to first token, with and
    without prefix caching, for requests sharing the prefix `shared`."""
    runs = {f"prefix caching {state}": (lambda on=on: prefix_caching_run(
        model, shared, suffixes, block_size, on)) for state, on in (("off", False), ("on", True))}
    seconds = alternate(runs, repeats, device)
    rows = {}
    for name, run in runs.items():
        r = run()
        r.pop("reused_each")
        rows[name] = {"kv_computed": r["kv_computed"], "reused": r["reused"],
                      "ttft_ms": 1000 * seconds[name] / len(suffixes),
                      "kv_bytes_computed": kv_bytes(model, r["kv_computed"]),
                      "tokens": r["tokens"]}
    off, on = rows["prefix caching off"], rows["prefix caching on"]
    return {"shared_tokens": len(shared), "requests": len(suffixes), "rows": rows,
            "same_tokens": off.pop("tokens") == on.pop("tokens"),
            "ttft_speedup": off["ttft_ms"] / on["ttft_ms"],
            "kv_ratio": off["kv_computed"] / on["kv_computed"]}


def course_prompts(tok, n: int = 40, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths from the course corpus: story openings, coin-flip questions
    and facts."""
    from ..course import corpus
    rng = random.Random(seed)
    texts = [corpus.random_story(rng)[:rng.randint(20, 200)] for _ in range(n // 2)]
    texts += [corpus.random_coin_flip(rng).prompt() for _ in range(n // 4)]
    texts += [corpus.random_fact(rng) for _ in range(n - len(texts))]
    return [tok.encode(t) for t in texts]


def shared_prefix_prompts(tok, n_shared: int = 200, n: int = 16,
                          seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A `n_shared`-token prefix (stories, as a long system prompt would be) and n questions."""
    from ..course import corpus
    rng = random.Random(seed)
    shared: list[int] = []
    while len(shared) < n_shared:
        shared += tok.encode(corpus.random_story(rng) + "\n")
    return shared[:n_shared], [tok.encode(corpus.random_coin_flip(rng).prompt())[-40:]
                               for _ in range(n)]
