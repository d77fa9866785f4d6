"""Disaggregated serving (chapter 13): prefill on one worker, decode on another.

A prompt's prefill is one long pass; a decode step is short. On one engine, a long
prompt that arrives stalls every running request for the length of its pass (chunked
prefill cuts the stall into slices; it does not remove it). DistServe (arXiv:2401.09670)
and Splitwise put the two phases on different workers; Mooncake, vLLM's disaggregated
prefill (its KV connector) and SGLang's disaggregation do it in production. The price:
the prompt's K/V must travel from the prefill worker to the decode worker.

Here the decode worker is the caller's process, a `DisaggregatedEngine` with the
`Engine` interface (add, step, abort, outputs, ...); the prefill worker is a second
process (parallel.py's rank, in one gloo group of two). A request's path:

1. its prompt, all but the last token, goes to the prefill worker (dist.isend);
2. there an ordinary Engine with a radix tree computes it (the tree, a prefix cache of
   the worker's own), and the tree's `export` reads its K/V out of that pool's blocks;
   they come back as a header (positions, the worker's block ids) and ONE message of
   keys and values (each message costs a fixed latency: bench-disagg measures it);
3. here the radix tree's `restore` writes them into FRESH blocks of this pool (the block
   ids change here: a block id means nothing outside its pool) and caches them;
4. the request joins this Engine, whose admission finds its prompt in the tree: it
   computes only the last position, whose logits choose its first token, then decodes.

The decode loop never waits for a prefill: a thread receives the K/V while it steps.
Deterministic requests (replayed alone where they decode) are refused; speculation is
not offered. Left to production systems: K/V streamed layer by layer while the prefill
runs, the first token sent by the prefill side, many workers of each kind and a router.
"""
from __future__ import annotations

import math
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .parallel import _rank
from .radix import Radix
from .sampling import Request
from .scheduler import fit
from .serving import Engine
from .validate import check_flags, int_at_least

STOP = -1  # a prompt length that tells the prefill worker to finish


def header_size(cfg, page_size: int) -> int:
    """A transfer's header: positions, prefill µs, the worker's block count and ids
    (room for the longest prompt's)."""
    return 3 + -(-cfg.block_size // page_size) + 1


def kv_shapes(pool, n: int) -> list[tuple]:
    """The shapes of `n` positions' keys and values as export gives them: (layers,
    kv_heads, n, head_dim); the same on both pools (the same model and page size)."""
    return [(len(t), t[0].shape[1], n, t[0].shape[3]) for t in (pool.keys, pool.values)]


def prefill_worker(rank: int, world: int, model, num_blocks: int,
                   page_size: int) -> dict:
    """The prefill worker: receive a prompt, compute it, send its K/V; until STOP. What
    its pool held at the end (`kept`: its tree's), and once the tree let go."""
    engine = Engine(model, num_blocks, page_size=page_size, prefix_caching=Radix())
    tree, size = engine.scheduler.prefix, header_size(model.config, page_size)
    while True:
        n = torch.zeros(1, dtype=torch.long)
        dist.recv(n, src=0)
        if n.item() == STOP:
            break
        prompt = torch.zeros(n.item(), dtype=torch.long)
        dist.recv(prompt, src=0)
        prompt, start = prompt.tolist(), time.perf_counter()
        index = engine.add(Request(prompt, 1))  # its token is not used: its K/V is
        while engine.has_work():
            engine.step()
        engine.forget(index)
        n, keys, values = tree.export(prompt)  # the tree keeps them: a prefix cache
        there = dict.fromkeys(b for node, _ in tree.match(prompt) for b in node.blocks)
        payload = torch.cat([keys.flatten(), values.flatten()])  # ONE message
        head = [n, round((time.perf_counter() - start) * 1e6), len(there), *there]
        dist.send(torch.tensor(head + [0] * (size - len(head))), 0)
        dist.send(payload, 0)
    dist.send(torch.full((size,), STOP), 0)  # the decode side's receiver stops too
    kept = engine.pool.num_blocks - engine.pool.n_free
    tree.evict(engine.pool.num_blocks)
    return dict(kept=kept, free=engine.pool.n_free, num_blocks=engine.pool.num_blocks,
                refs=sum(engine.pool.ref))


def receive(arrived: queue.Queue, pool, size: int) -> None:
    """The decode side's receiving thread: each transfer's header, then its keys and
    values in one message, timed from the header on, put on `arrived`; until the
    worker's STOP or an error (put on `arrived` too). A thread, because gloo's irecv
    cannot be polled: its work says done only once waited for."""
    try:
        while True:
            head = torch.zeros(size, dtype=torch.long)
            dist.recv(head, 1)
            if (head := head.tolist())[0] == STOP:
                return
            start, (k, v) = time.perf_counter(), kv_shapes(pool, head[0])
            payload = torch.empty(math.prod(k) + math.prod(v), dtype=pool.keys[0].dtype)
            dist.recv(payload, 1)
            keys, values = payload.split([math.prod(k), math.prod(v)])
            arrived.put(dict(positions=head[0], prefill_s=head[1] / 1e6,
                             blocks_there=head[3:3 + head[2]],
                             bytes=payload.numel() * payload.element_size(),
                             seconds=time.perf_counter() - start,
                             keys=keys.view(k), values=values.view(v)))
    except Exception as e:  # the link broke: the decode loop raises it
        arrived.put(e)


class DisaggregatedEngine:
    """An Engine whose prompts a prefill worker computes (module doc): `num_blocks` of
    `page_size` positions here, `prefill_blocks` there (default: as many); `timeout`
    seconds for the worker to start or answer. Close it (or use `with`) to stop the
    worker. One per process at a time: the process group is the process's.

    `lockstep`: a step waits for the K/V of every prompt it sent, so a request joins
    at its arrival step on every run, as on one Engine (a chapter's pictures, tests);
    the stall the worker removes comes back as that wait. `trace`: Engine's."""

    def __init__(self, model, num_blocks: int, *, prefill_blocks: int | None = None,
                 page_size: int = 16, max_running: int | None = None, policy=None,
                 timeout: float = 60.0, lockstep: bool = False, trace: bool = False):
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group "
                               "(another DisaggregatedEngine?): close that one first")
        check_flags(lockstep=lockstep)
        self.engine = Engine(model, num_blocks, page_size=page_size, policy=policy,
                             max_running=max_running, prefix_caching=Radix(),
                             replay=False, trace=trace)
        self.lockstep = lockstep
        self.prefill_blocks = num_blocks if prefill_blocks is None else prefill_blocks
        int_at_least("prefill_blocks", self.prefill_blocks, hint=" (the worker's pool)")
        self.pool, self.tree = self.engine.pool, self.engine.scheduler.prefix
        self.timeout, self.now, self.closed = timeout, 0, False
        self.arriving: list[tuple[int, Request]] = []  # their arrival step to come
        self.sent: list[tuple[int, Request]] = []  # at the prefill worker, in order
        self.aborted: set[int] = set()
        self.transfers: dict[int, dict] = {}  # by request: what it moved, how fast
        self.sends: list = []  # prompts on their way: (tensor, work), kept alive
        self.arrived: queue.Queue = queue.Queue()  # what the receiving thread got
        self._start(model, page_size)

    def _start(self, model, page_size: int) -> None:
        """The prefill worker as rank 1 (parallel.py's `_rank`), this process rank 0."""
        ctx, self.tmp = mp.get_context("spawn"), tempfile.TemporaryDirectory()
        store = os.path.join(self.tmp.name, "store")
        self.results, self.done, self.receiver = ctx.Queue(), ctx.Event(), None
        self.worker = ctx.Process(target=_rank, daemon=True, args=(
            prefill_worker, 1, 2, store, 1, self.results, self.done,
            (model, self.prefill_blocks, page_size), {}))
        self.worker.start()
        hook = sys.excepthook  # init_process_group would prefix our errors for good
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                    world_size=2,
                                    timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            self._stop()
            raise RuntimeError(f"the prefill worker did not start ({e}): a script that "
                               "starts one needs `if __name__ == '__main__':`") from None
        finally:
            sys.excepthook = hook
        size = header_size(model.config, page_size)
        self.receiver = threading.Thread(target=receive, daemon=True,
                                         args=(self.arrived, self.pool, size))
        self.receiver.start()
        self.heard = time.perf_counter()  # the worker's last sign of life

    # --- the Engine interface ---------------------------------------------------------
    def check(self, request: Request, index: int | None = None) -> tuple:
        """Engine.check, the prompt within the worker's pool too; a deterministic request
        refused (its prompt is replayed alone where it decodes)."""
        if isinstance(request, Request) and request.deterministic:
            raise ValueError("a deterministic request is not served disaggregated (its "
                             "prompt is replayed where it decodes): use a "
                             "serving.Engine")
        checked = self.engine.check(request, index)
        try:
            # what the worker's Engine asks of its prompt but the last, one new token and
            # a replay window of 4 ahead: the prompt, 1 new, 3 ahead
            fit(replace(request, max_new_tokens=1), self.engine.model.config,
                self.pool.page_size, 3, self.prefill_blocks)
        except ValueError as e:
            raise ValueError(f"its prompt does not fit the prefill worker's pool ({e}): "
                             "give it more prefill_blocks") from None
        return checked

    def add(self, request: Request, index: int | None = None) -> int:
        """Queue `request`; its prompt goes to the prefill worker at its arrival step."""
        self._check_open()
        self.check(request, index)
        taken = {i for i, _ in self.arriving + self.sent} | set(self.engine.outputs())
        if index is None:
            index = next(i for i in range(len(taken) + 1) if i not in taken)
        int_at_least("index", index, 0, " (the caller's number for the request)")
        if index in taken:
            raise ValueError(f"request {index} is already in this engine: give another")
        self.arriving.append((index, request))
        return index

    def step(self) -> dict[int, tuple[list[int], bool]]:
        """Send the prompts that arrived, take in the K/V that came back (waiting for it
        only when nothing decodes, or for all of it in lockstep), then one decode step."""
        self._check_open()
        if not self.engine.has_work() and not self.sent and self.arriving:
            self.now = max(self.now, min(r.arrival for _, r in self.arriving))
        for index, request in [x for x in self.arriving if x[1].arrival <= self.now]:
            self.arriving.remove((index, request))
            self._send(index, request)
        self._receive(wait=not self.engine.has_work())
        while self.lockstep and self.sent:
            self._receive(wait=True)
        self.now += 1
        return self.engine.step()

    def has_work(self) -> bool:
        return bool(self.arriving or self.sent or self.engine.has_work())

    def abort(self, index: int) -> None:
        """Out of the queue; at the prefill worker, dropped when its K/V comes back."""
        if any(i == index for i, _ in self.sent):
            self.aborted.add(index)
        elif any(i == index for i, _ in self.arriving):
            self.arriving = [x for x in self.arriving if x[0] != index]
        else:
            self.engine.abort(index)

    def forget(self, index: int) -> None:
        self.engine.forget(index)
        self.transfers.pop(index, None)

    def outputs(self) -> dict:
        return self.engine.outputs()

    def stats(self) -> dict:
        moved = self.transfers.values()
        return self.engine.stats() | {
            "at_prefill": len(self.sent), "arriving": len(self.arriving),
            "bytes_moved": sum(t["bytes"] for t in moved),
            "transfer_s": sum(t["seconds"] for t in moved)}

    def block_table(self, index: int) -> list[int]:
        return self.engine.block_table(index)

    # --- the transfer -----------------------------------------------------------------
    def _send(self, index: int, request: Request) -> None:
        """Its prompt but the last token to the prefill worker (the last is computed
        here: its logits choose the first token). A one-token prompt sends nothing."""
        prompt = self.engine.check(request)[0][:-1]
        if not prompt:
            self.engine.add(replace(request, arrival=0), index)
            return
        message = [torch.tensor([len(prompt)]), torch.tensor(prompt)]
        try:
            self.sends += [(m, dist.isend(m, 1)) for m in message]
        except RuntimeError as e:  # gloo's: the link broke
            self._check_worker(f"receiving a prompt ({e})", broken=True)
        self.sent.append((index, request))

    def _receive(self, wait: bool) -> None:
        """Every transfer that came back: its K/V restored into this pool, its request
        handed to the Engine; with `wait`, the first waited for."""
        while self.sent:
            try:
                got = self.arrived.get(timeout=0.01 if wait else 0)
            except queue.Empty:
                if not wait:
                    return
                self._check_worker("computing a prompt")
                continue
            if isinstance(got, Exception):  # the receiving thread's: the link broke
                self._check_worker(f"sending K/V ({got})", broken=True)
            wait, (index, request) = False, self.sent.pop(0)
            self.sends = self.sends[2:]  # its prompt was received
            self.heard = time.perf_counter()
            keys, values = got.pop("keys"), got.pop("values")
            self.transfers[index] = got
            if index not in self.aborted:
                self._restore(index, request, got["positions"], keys, values)
            self.aborted.discard(index)

    def _restore(self, index: int, request: Request, n: int, keys, values) -> None:
        """Into this pool's tree, then the Engine's queue. A pool too full to hold them
        now: the request computes its prompt here when admitted (`recomputed`)."""
        prompt = self.engine.check(request)[0]
        try:
            self.tree.restore(prompt[:n], keys, values)  # allocated here: new block ids
        except MemoryError:
            self.transfers[index]["recomputed"] = True
        self.engine.add(replace(request, arrival=0), index)

    def _check_worker(self, what: str, broken: bool = False) -> None:
        """The worker's failure (its traceback, from parallel.py's _rank), death or
        silence past `timeout`: the engine closed, a clear error."""
        failed = not self.results.empty()
        late = time.perf_counter() - self.heard > self.timeout
        if failed or broken or late or not self.worker.is_alive():
            trace = self.results.get()[2] if failed else ""
            self.close()
            raise RuntimeError(f"the prefill worker failed, died or timed out while "
                               f"{what} (exit code {self.worker.exitcode}): start a "
                               f"new engine\n{trace}")

    # --- the end ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this DisaggregatedEngine is closed: start a new one")

    def close(self) -> dict | None:
        """Stop the prefill worker; what its pool held at the end (`kept`), and once its
        tree let go (`free` of `num_blocks`, `refs`). None if it had died."""
        if self.closed:
            return self.report
        self.closed, self.report = True, None
        if self.worker.is_alive():
            stop = torch.tensor([STOP])
            try:
                work = dist.isend(stop, 1)  # noqa: F841 (kept until it is read)
                self.report = self._last_word()
            except RuntimeError:  # gloo's: the link broke, the worker is gone
                pass
        self._stop()
        return self.report

    def _last_word(self) -> dict | None:
        """The worker's result once it stops; None if it failed or died first."""
        deadline = time.perf_counter() + self.timeout
        while time.perf_counter() < deadline and self.worker.is_alive():
            try:
                _, ok, value = self.results.get(timeout=0.1)
                return value if ok else None
            except queue.Empty:
                pass
        return None

    def _stop(self) -> None:
        """The worker joined (killed if it will not end), the thread and group gone."""
        self.done.set()
        self.worker.join(5)
        if self.worker.is_alive():
            self.worker.kill()
            self.worker.join()
        if self.receiver is not None:
            self.receiver.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.tmp.cleanup()

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
