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

No client's mistake is a 500: a body is read up to MAX_BODY_BYTES and no further (413), decoded
(any nesting, any number: a 400 in OpenAI's error body), checked field by field
(check_completion: `param` names the field at fault), and its prompt refused if longer than the
model could hold before it is tokenized, on a worker thread, so that one large prompt never
holds up other clients (or /health).

/v1/chat/completions is left out: the course models are not chat models (no chat template,
no chat data), and a chat endpoint over them would teach a format they cannot follow.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass

from .engine.sampling import MIN_TEMPERATURE
from .engine.serving import Engine, Request
from .engine.validate import int_at_least

# OpenAI's /v1/completions fields minikv serves; any other is refused, by name, with a 400
# (a silently ignored `stop` or `logprobs` would change what a client thinks it got).
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream",
          "stream_options", "user", "n", "top_p"}
# A body is read up to this many bytes and no further: the longest prompt any course model
# holds is a few kB of text (or 256 token ids), so a megabyte is generous and a 50 MB body is
# refused at its first megabyte rather than held in memory and parsed.
MAX_BODY_BYTES = 1 << 20
MAX_USER_CHARS = 256  # OpenAI's `user` is an end-user id, not a payload


class BadRequest(ValueError):
    """A request the server refuses: its HTTP status, its message, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Completion:
    """A /v1/completions body, every field checked but the prompt not yet tokenized (that
    waits for a worker thread: the event loop must stay free for other clients)."""
    text: str | None            # the prompt as text, or
    ids: list[int] | None       # as token ids
    max_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    stream: bool
    include_usage: bool


def decode_body(raw: bytes):
    """The JSON value of a request body; BadRequest (param None: no field is at fault yet)
    for bytes that are not JSON, JSON nested deeper than the parser goes, or a number it
    cannot convert."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the body is nested too deeply: send a flat JSON object") from None
    except ValueError as e:  # also UnicodeDecodeError, and an int of more than 4,300 digits
        raise BadRequest(f"the body is not JSON ({_short(str(e))}): send a JSON object, e.g. "
                         "{\"model\": ..., \"prompt\": \"Ada flips a coin\"}") from None


def check_completion(body, model_name: str, vocab: int, context: int,
                     max_prompt_chars: int) -> Completion:
    """Every field of a /v1/completions body checked (BadRequest naming the first that is
    wrong), nothing computed: cheap enough for the event loop, whatever the body holds.
    `max_prompt_chars`: the longest text that could tokenize into `context` tokens."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object, e.g. {\"model\": \"%s\", \"prompt\": "
                         "\"Ada flips a coin\", \"max_tokens\": 16}" % model_name)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unsupported parameter(s): {_short(', '.join(unknown))}; minikv serves "
                         f"{', '.join(sorted(FIELDS))}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string: this server serves {model_name!r}", "model")
    if model != model_name:
        raise BadRequest(f"model {_short(repr(model))} is not served here; this server serves "
                         f"{model_name!r} (GET /v1/models)", "model", status=404)
    text, ids = _prompt(body.get("prompt"), vocab, context, max_prompt_chars)
    max_tokens = _number(body, "max_tokens", 16, int, 1, context)
    temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:  # the engine's floor: below it, logits overflow
        raise BadRequest(f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE} to 2.0, not "
                         f"{temperature!r}", "temperature")
    top_k = _number(body, "top_k", None, int, 1, vocab)
    seed = _number(body, "seed", None, int, 0, 2**63 - 1)
    seed = random.randrange(1 << 31) if seed is None else seed  # none: a fresh draw, as OpenAI
    for name, only in (("n", 1), ("top_p", 1)):
        value = body.get(name)
        if value is not None and not (type(value) in (int, float) and value == only):
            raise BadRequest(f"{name} must be {only} here (minikv does not serve {name}), not "
                             f"{_short(repr(value))}", name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, not {_short(repr(stream))}", "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {
            "include_usage"} and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be an object with one field, include_usage: true "
                         f"or false; not {_short(repr(options))}", "stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options is for a streamed request: add \"stream\": true",
                         "stream_options")
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= MAX_USER_CHARS):
        raise BadRequest(f"user must be a string of at most {MAX_USER_CHARS} characters (an "
                         "id for the end user)", "user")
    return Completion(text, ids, max_tokens, temperature, top_k, seed, bool(stream),
                      bool((options or {}).get("include_usage")))


def _prompt(prompt, vocab: int, context: int, max_chars: int):
    """(text, None) or (None, ids) for the prompt field, within what the model could hold."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character", "prompt")
        if len(prompt) > max_chars:  # refused before tokenizing: no token is that long
            raise BadRequest(f"prompt has {len(prompt):,} characters; the model holds "
                             f"{context} tokens, which no text over {max_chars:,} characters "
                             "fits in: shorten it", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if len(prompt) > context:
            raise BadRequest(f"prompt has {len(prompt):,} token ids; the model holds "
                             f"{context}: shorten it", "prompt")
        if any(not 0 <= t < vocab for t in prompt):
            raise BadRequest(f"prompt has token ids outside the vocabulary (0..{vocab - 1})",
                             "prompt")
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request: send a request for each", "prompt")
    raise BadRequest("prompt must be a non-empty string or a list of token ids (ints from 0 to "
                     f"{vocab - 1})", "prompt")


def _number(body, name, default, kind, low, high):
    """body[name], of `kind` within [low, high], or `default` when absent or null. A bool is
    not a number here (JSON's true is not 1), and an int of any size is compared, never
    converted to a float first (float(10**400) overflows)."""
    value = body.get(name)
    if value is None:  # absent, or null as OpenAI's clients may send it
        return default
    if kind is int:
        ok = type(value) is int or (type(value) is float and value.is_integer())
    else:
        ok = type(value) in (int, float)
    if not ok or not low <= value <= high:  # NaN fails the comparison too
        what = "an integer" if kind is int else "a number"
        raise BadRequest(f"{name} must be {what} from {low} to {high}, not "
                         f"{_short(repr(value))}", name)
    return kind(value)


def _short(text: str, limit: int = 80) -> str:
    """A client's value quoted back, cut: an error message must not echo a megabyte."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def longest_token(tokenizer) -> int:
    """The most characters one token stands for (its UTF-8 bytes bound them): a prompt
    longer than context × this cannot fit, whatever it says."""
    try:
        return max(len(tokenizer.decode_single_token_bytes(i))
                   for i in range(tokenizer.n_vocab))
    except (AttributeError, KeyError, TypeError):  # another tokenizer: a generous bound
        return 64


def build_request(checked: Completion, ids: list[int], tokenizer, engine: Engine,
                  context: int) -> Request:
    """The minikv.Request for a checked body and its prompt's ids, once it fits the engine
    (`context`: the model's block_size)."""
    request = Request(ids, checked.max_tokens, temperature=checked.temperature,
                      top_k=checked.top_k, seed=checked.seed,
                      eos_id=getattr(tokenizer, "eot_token", None))
    try:  # the engine's one fit rule: the model's context and this server's pool
        request.prompt = engine.check(request)[0]
    except (ValueError, TypeError) as e:
        why = str(e).removeprefix("the request: ")
        # the prompt is at fault when it leaves no room for even one new token
        at_fault = "prompt" if len(ids) >= context else "max_tokens"
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({checked.max_tokens}) does "
                         f"not fit this server: {why}", at_fault) from None
    return request


def parse_completion(body, model_name: str, model, tokenizer,
                     engine: Engine) -> tuple[Request, bool, bool]:
    """The minikv.Request a /v1/completions body asks for, whether to stream, and whether
    to end the stream with a usage chunk; BadRequest, naming the field, if anything is
    wrong. (The server runs the same steps, the tokenizing on a worker thread.)"""
    context = model.config.block_size
    checked = check_completion(body, model_name, model.config.vocab_size, context,
                               context * longest_token(tokenizer))
    ids = checked.ids or tokenizer.encode(checked.text, allowed_special="all")
    request = build_request(checked, ids, tokenizer, engine, context)
    return request, checked.stream, checked.include_usage


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

    def __init__(self, model, tokenizer, model_name: str, worker: EngineThread,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.model, self.tokenizer, self.name, self.worker = model, tokenizer, model_name, worker
        self.max_body_bytes = max_body_bytes
        self.context = model.config.block_size
        self.max_prompt_chars = self.context * longest_token(tokenizer)

    async def read_body(self, http) -> bytes:
        """The body, refused (413) as soon as it is known to pass the cap: from its
        Content-Length before a byte is read, or while it streams in without one."""
        cap = self.max_body_bytes
        too_big = BadRequest(f"the body is larger than this server takes ({cap:,} bytes): "
                             "send a shorter prompt", status=413)
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise too_big
        from starlette.requests import ClientDisconnect
        chunks, size = [], 0
        try:
            async for chunk in http.stream():
                size += len(chunk)
                if size > cap:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # gone halfway through its body: nobody to answer, no error
            raise BadRequest("the client left before its body was sent") from None
        return b"".join(chunks)

    async def completions(self, http):
        from starlette.responses import JSONResponse, StreamingResponse
        try:
            body = decode_body(await self.read_body(http))
            checked = check_completion(body, self.name, self.model.config.vocab_size,
                                       self.context, self.max_prompt_chars)
            ids = checked.ids
            if ids is None:  # tokenizing takes time in proportion to the text: off the loop
                ids = await asyncio.to_thread(self.tokenizer.encode, checked.text,
                                              allowed_special="all")
            request = build_request(checked, ids, self.tokenizer, self.worker.engine,
                                    self.context)
            stream, usage = checked.stream, checked.include_usage
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


async def http_error(_, e):
    """Starlette's own refusals (no such path, a GET where POST goes) as OpenAI's error body,
    not plain text: a client reads every error the same way."""
    return error_response(BadRequest(f"{e.detail}: this server serves POST /v1/completions, "
                                     "GET /v1/models and GET /health", status=e.status_code))


def create_app(model, tokenizer, model_name: str, *, num_blocks: int = 256, page_size: int = 16,
               max_running: int | None = 16, max_queue: int = 64, policy=None,
               max_body_bytes: int = MAX_BODY_BYTES, graphs: tuple | None = None):
    """The Starlette app serving `model` as `model_name`, with its engine thread (started
    with the app, stopped with it); `graphs`: the batch sizes whose decode pass is replayed
    as a CUDA graph (engine/static.py; None: every decode pass eager)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    int_at_least("max_queue", max_queue, 0, " (requests waiting beyond the running ones)")
    engine = Engine(model, num_blocks, page_size=page_size, max_running=max_running,
                    policy=policy, graphs=graphs)
    int_at_least("max_body_bytes", max_body_bytes)
    api = CompletionsAPI(model, tokenizer, model_name, EngineThread(engine, max_queue),
                         max_body_bytes)
    app = Starlette(routes=[Route("/v1/completions", api.completions, methods=["POST"]),
                            Route("/v1/models", api.models), Route("/health", api.health)],
                    lifespan=api.lifespan, exception_handlers={HTTPException: http_error})
    app.state.worker = api.worker
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .course import arguments
    from .course.checkpoint import COURSE_MODELS, load_course_model
    from .course.device import free_memory
    from .engine.cache import memory_plan
    from .engine.scheduler import FirstComeFirstServed

    parser = argparse.ArgumentParser(prog="python -m minikv serve-http", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=COURSE_MODELS, default="target")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: this machine only; 0.0.0.0 "
                             "opens it to the network: there is no authentication)")
    parser.add_argument("--port", type=arguments.port, default=8000)
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=arguments.positive, default=None,
                      help="blocks in the KV pool (default: 256)")
    pool.add_argument("--memory-utilization", default=None,
                      type=arguments.number(0.0, 1.0, " (a fraction of free memory)", above=True),
                      help="size the pool from the device's free memory instead: this "
                           "fraction of it, less the weights (vLLM's gpu_memory_utilization)")
    parser.add_argument("--page-size", type=arguments.positive, default=16,
                        help="positions per block")
    parser.add_argument("--max-running", type=arguments.positive, default=16,
                        help="requests run at once")
    parser.add_argument("--max-queue", type=arguments.integer(0), default=64,
                        help="requests that may wait beyond the running ones (then 503)")
    parser.add_argument("--chunk-budget", type=arguments.positive, default=None,
                        help="chunked prefill: tokens per engine step (default: off)")
    parser.add_argument("--eager", action="store_true",
                        help="on a GPU, run every decode pass eagerly (default there: replay a "
                             "CUDA graph, captured at start for batch sizes 1, 2, 4, ... up to "
                             "--max-running; vLLM's enforce_eager)")
    args = parser.parse_args(argv)
    model, tokenizer = load_course_model(args.model)
    graphs = not args.eager and model.device.type == "cuda"  # decode replayed: CUDA graphs
    try:
        num_blocks = args.num_blocks or 256
        if args.memory_utilization is not None:
            plan = memory_plan(model, free_memory(model.device), args.memory_utilization,
                               args.page_size, graphs=args.max_running if graphs else 0)
            num_blocks = plan.num_blocks
            print(f"memory plan: {plan.budget:,} bytes = weights {plan.weights:,} + reserve "
                  f"{plan.reserve:,} + a pool of {num_blocks:,} blocks of {plan.block:,} "
                  f"(room for {plan.requests:,} requests of {model.config.block_size} "
                  f"positions)")
        policy = (FirstComeFirstServed(args.chunk_budget, chunked_prefill=True)
                  if args.chunk_budget is not None else None)
        most = min(args.max_running, num_blocks)  # graphs for batch sizes 1, 2, 4, ..., most
        sizes = sorted({2 ** i for i in range(most.bit_length())} | {most})
        app = create_app(model, tokenizer, args.model, num_blocks=num_blocks,
                         page_size=args.page_size, max_running=args.max_running,
                         max_queue=args.max_queue, policy=policy,
                         graphs=tuple(sizes) if graphs else None)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
