"""python -m minikv serve-http: the engine behind an OpenAI-compatible HTTP endpoint.

    python -m minikv serve-http --model target --port 8000
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "target", "prompt": "Ada flips a coin", "max_tokens": 20, "stream": true}'

Any OpenAI client works (`openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`).
Endpoints: POST /v1/completions (streamed as server-sent events with "stream": true), GET
/v1/models, GET /health (the engine's queues and pool, as JSON).

Two threads, as in vLLM's and SGLang's servers: the HTTP side (Starlette on uvicorn: the
ASGI stack FastAPI, and with it vLLM's and SGLang's servers, stand on, without FastAPI's
pydantic layer, since every field is checked here by hand with the message a student
needs) parses and checks each request, then hands it to the engine thread, which owns the
Engine (engine/serving.py) and runs its steps for as long as any request is queued or
running, posting each step's new tokens back to the request that made them. The queue is
bounded (a full server answers 503 at once rather than make a client wait without end); a
client that disconnects has its request aborted and its blocks freed at the next step; if a
step fails, the requests in flight get the error (500) and later ones a 503.

/v1/chat/completions is left out: the course models are not chat models (no chat template,
no chat data), and a chat endpoint over them would teach a format they cannot follow.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import queue
import random
import threading
import time
import uuid

from .engine.serving import Engine, Request
from .engine.validate import int_at_least

# OpenAI's /v1/completions fields minikv serves; any other is refused, by name, with a 400
# (a silently ignored `stop` or `logprobs` would change what a client thinks it got).
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream",
          "stream_options", "user", "n", "top_p"}


class BadRequest(ValueError):
    """A request the server refuses: its HTTP status, its message, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def parse_completion(body, model_name: str, model, tokenizer,
                     engine: Engine) -> tuple[Request, bool, bool]:
    """The minikv.Request a /v1/completions body asks for, whether to stream, and whether
    to end the stream with a usage chunk; BadRequest, naming the field, if anything is
    wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object, e.g. {\"model\": \"%s\", \"prompt\": "
                         "\"Ada flips a coin\", \"max_tokens\": 16}" % model_name)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unsupported parameter(s): {', '.join(unknown)}; minikv serves "
                         f"{', '.join(sorted(FIELDS))}", unknown[0])
    if body.get("model") != model_name:
        raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves "
                         f"{model_name!r} (GET /v1/models)", "model", status=404)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character", "prompt")
        ids = tokenizer.encode(prompt, allowed_special="all")
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("one prompt per request: send a request for each", "prompt")
    else:
        raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"prompt has token ids outside the vocabulary (0..{vocab - 1})",
                         "prompt")
    max_tokens = _number(body, "max_tokens", 16, int, 1)
    temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
    top_k = _number(body, "top_k", None, int, 1)
    seed = _number(body, "seed", None, int, 0)  # none: a fresh draw, as OpenAI's API does
    seed = random.randrange(1 << 31) if seed is None else seed
    for name, only in (("n", 1), ("top_p", 1)):
        if body.get(name, only) != only:
            raise BadRequest(f"{name} must be {only} here (minikv does not serve {name})", name)
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("stream must be true or false, stream_options an object", "stream")
    request = Request(ids, max_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      eos_id=getattr(tokenizer, "eot_token", None))
    try:  # the engine's one fit rule: the model's context and this server's pool
        request.prompt = engine.check(request)[0]
    except (ValueError, TypeError) as e:
        why = str(e).removeprefix("the request: ")
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) does not fit "
                         f"this server: {why}", "max_tokens") from None
    return request, stream, bool(options.get("include_usage"))


def _number(body, name, default, kind, low, high=math.inf):
    """body[name], of `kind` within [low, high], or `default` when absent."""
    value = body.get(name)
    if value is None:  # absent, or null as OpenAI's clients may send it
        return default
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (kind is float or float(value).is_integer()) and low <= value <= high)
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise BadRequest(f"{name} must be {what} from {low} to {high}, not {value!r}", name)
    return kind(value)


class EngineThread:
    """The thread that owns the Engine. The HTTP side calls `submit` and `cancel` (both
    thread-safe: they only enqueue); the engine thread adds, aborts and steps, and posts
    (tokens, finished) to each request's asyncio queue on the server's event loop."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        stats = engine.stats()
        self.capacity = (stats["max_running"] or stats["num_blocks"]) + max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.outputs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.in_flight = 0  # submitted and not yet finished or cancelled (HTTP side's count)
        self.ids = iter(range(1 << 62))
        self.stopping = False
        self.failed: str | None = None  # why the engine thread stopped, if it did
        self.thread = threading.Thread(target=self.run, name="minikv-engine", daemon=True)

    def submit(self, request: Request) -> tuple[int, asyncio.Queue]:
        """Queue a checked request: its id and the queue its tokens will come to; 503 when
        the server already holds as many requests as it may."""
        if self.failed:
            raise BadRequest(f"the engine stopped ({self.failed}): restart the server",
                             status=503)
        if self.in_flight >= self.capacity:
            raise BadRequest(f"the server is full ({self.in_flight} requests running or "
                             "waiting): retry in a moment", status=503)
        index, out = next(self.ids), asyncio.Queue()
        self.in_flight += 1
        self.outputs[index] = (asyncio.get_running_loop(), out)
        self.inbox.put(("add", index, request))
        self.wake.set()
        return index, out

    def cancel(self, index: int) -> None:
        """The client left: abort its request (the engine thread frees its blocks)."""
        self.inbox.put(("abort", index, None))
        self.wake.set()

    def release(self) -> None:
        self.in_flight -= 1

    def run(self) -> None:
        """The engine loop; if a step fails, every request in flight gets the error and the
        server refuses new ones (503) rather than leave clients waiting on a dead thread."""
        try:
            self.loop()
        except Exception as e:  # any failure must reach the clients waiting on it
            self.failed = f"{type(e).__name__}: {e}"
            for index in list(self.outputs):
                loop, out = self.outputs.pop(index)
                loop.call_soon_threadsafe(out.put_nowait, (RuntimeError(self.failed), True))

    def loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            while not self.inbox.empty():
                what, index, request = self.inbox.get()
                if what == "add":  # checked by parse_completion
                    engine.add(request, index=index)
                elif index in self.outputs:  # not finished yet: abort it
                    engine.abort(index)
                    engine.forget(index)
                    self.outputs.pop(index, None)
            if not engine.has_work():
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            for index, (tokens, done) in engine.step().items():
                if done:
                    engine.forget(index)  # handed out whole: nothing more to keep
                if index in self.outputs:
                    loop, out = self.outputs[index] if not done else self.outputs.pop(index)
                    loop.call_soon_threadsafe(out.put_nowait, (tokens, done))

    def health(self) -> dict:
        return self.engine.stats() | {"in_flight": self.in_flight}


class Detokenizer:
    """Text for a growing list of token ids, a piece per call: a byte-level BPE token may
    end inside a UTF-8 character, so a piece that ends in an unfinished character waits for
    the next token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def piece(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new


class CompletionsAPI:
    """The HTTP side: each handler checks a request, submits it to the engine thread, and
    answers with its tokens as they come (a stream of server-sent events, or one JSON body)."""

    def __init__(self, model, tokenizer, model_name: str, worker: EngineThread):
        self.model, self.tokenizer, self.name, self.worker = model, tokenizer, model_name, worker

    async def completions(self, http):
        from starlette.responses import JSONResponse, StreamingResponse
        try:
            body = json.loads(await http.body())
        except ValueError as e:
            return error_response(BadRequest(f"the body is not JSON ({e})"))
        engine = self.worker.engine
        try:
            request, stream, usage = parse_completion(
                body, self.name, self.model, self.tokenizer, engine)
            index, out = self.worker.submit(request)
        except BadRequest as e:
            return error_response(e)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                "created": int(time.time()), "model": self.name}
        counts = {"prompt_tokens": len(request.prompt), "completion_tokens": 0}
        pieces = self.pieces(http, request, index, out, counts)
        if not stream:
            text, finish = "", None
            try:
                async for piece, finish in pieces:
                    text += piece
            except RuntimeError as e:
                return error_response(BadRequest(f"the engine failed: {e}", status=500))
            return JSONResponse(head | {"choices": [choice(text, finish)],
                                        "usage": usage_of(counts)})

        async def events():
            async for piece, finish in pieces:
                yield f"data: {json.dumps(head | {'choices': [choice(piece, finish)]})}\n\n"
            if usage:
                yield f"data: {json.dumps(head | {'choices': [], 'usage': usage_of(counts)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def pieces(self, http, request: Request, index: int, out: asyncio.Queue,
                     counts: dict):
        """(text, finish_reason) per engine step that gave the request tokens, until it
        finishes; a client that left (the stream's next write fails, or a check while it
        waits finds it gone) cancels it, and its blocks go back to the pool."""
        detok, finished = Detokenizer(self.tokenizer), False
        try:
            while not finished:
                try:
                    new, finished = await asyncio.wait_for(out.get(), timeout=0.5)
                except asyncio.TimeoutError:  # nothing yet: is anyone still listening?
                    if await http.is_disconnected():
                        return
                    continue
                if isinstance(new, Exception):  # the engine thread failed
                    raise new
                counts["completion_tokens"] += len(new)
                stop = request.eos_id is not None and request.eos_id in new
                finish = ("stop" if stop else "length") if finished else None
                text = [t for t in new if t != request.eos_id]  # the EOS is not text
                yield detok.piece(text, finished), finish
        finally:
            self.worker.release()
            if not finished:
                self.worker.cancel(index)

    async def models(self, _):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "minikv"}]})

    async def health(self, _):
        from starlette.responses import JSONResponse
        return JSONResponse(self.worker.health())

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The engine thread runs while the app does."""
        self.worker.thread.start()
        yield
        self.worker.stopping = True
        self.worker.wake.set()
        self.worker.thread.join(timeout=5)


def choice(text: str, finish: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def usage_of(counts: dict) -> dict:
    return counts | {"total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


def error_response(e: BadRequest):
    """OpenAI's error body; a 503 says when to retry."""
    from starlette.responses import JSONResponse
    kind = {404: "not_found_error", 500: "server_error", 503: "server_overloaded"}.get(
        e.status, "invalid_request_error")
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param,
                                   "code": None}}, e.status, headers=headers)


def create_app(model, tokenizer, model_name: str, *, num_blocks: int = 256, page_size: int = 16,
               max_running: int | None = 16, max_queue: int = 64, policy=None):
    """The Starlette app serving `model` as `model_name`, with its engine thread (started
    with the app, stopped with it)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    int_at_least("max_queue", max_queue, 0, " (requests waiting beyond the running ones)")
    engine = Engine(model, num_blocks, page_size=page_size, max_running=max_running,
                    policy=policy)
    api = CompletionsAPI(model, tokenizer, model_name, EngineThread(engine, max_queue))
    app = Starlette(routes=[Route("/v1/completions", api.completions, methods=["POST"]),
                            Route("/v1/models", api.models), Route("/health", api.health)],
                    lifespan=api.lifespan)
    app.state.worker = api.worker
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .course.checkpoint import COURSE_MODELS, load_course_model
    from .engine.scheduler import FirstComeFirstServed

    parser = argparse.ArgumentParser(prog="python -m minikv serve-http", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=COURSE_MODELS, default="target")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: this machine only; 0.0.0.0 "
                             "opens it to the network: there is no authentication)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-blocks", type=int, default=256, help="blocks in the KV pool")
    parser.add_argument("--page-size", type=int, default=16, help="positions per block")
    parser.add_argument("--max-running", type=int, default=16, help="requests run at once")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait beyond the running ones (then 503)")
    parser.add_argument("--chunk-budget", type=int, default=None,
                        help="chunked prefill: tokens per engine step (default: off)")
    args = parser.parse_args(argv)
    model, tokenizer = load_course_model(args.model)
    try:
        policy = (FirstComeFirstServed(args.chunk_budget, chunked_prefill=True)
                  if args.chunk_budget else None)
        app = create_app(model, tokenizer, args.model, num_blocks=args.num_blocks,
                         page_size=args.page_size, max_running=args.max_running,
                         max_queue=args.max_queue, policy=policy)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
