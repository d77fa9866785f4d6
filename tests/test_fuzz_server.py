"""The HTTP server under a fuzzer (issue 51): generated bodies sent to a live server, each answer
checked. Three kinds of body, drawn in turn:

- well-formed: every field OpenAI's /v1/completions takes that minikv serves, in every form a
  client may send it (text or token ids, a batch of one, null for a default, streamed or not);
  the answer must be 200 with the tokens `minikv.generate` gives for the same request;
- one field wrong: a well-formed body with one field given a wrong value of some kind (a bool
  where a number goes, a number too large for any machine integer, NaN, a string, a nested
  list, an unknown field); the answer must be a 4xx whose error object's `param` names it;
- arbitrary: any JSON value, any object, any bytes, JSON nested past any parser's depth; the
  answer must be a 4xx (or a 200) in OpenAI's error body, its `param` a field of the body.

Never a 5xx, and nothing at WARNING or above (a traceback) in the server's log. The default run
sends FUZZ_BODIES bodies (a few seconds); MINIKV_FUZZ_BODIES=2000 (or more) for the long run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.server import FIELDS, MAX_BODY_BYTES, create_app

from test_server import MODEL, TOK, Live

FUZZ_BODIES = int(os.environ.get("MINIKV_FUZZ_BODIES", "300"))
V, CONTEXT = MODEL.config.vocab_size, MODEL.config.block_size
EOT = TOK.eot_token


@pytest.fixture(scope="module")
def server():
    """A live server and the log records it wrote at WARNING or above."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    with Live(create_app(MODEL, TOK, "draft", num_blocks=64, max_running=4, max_queue=8)) as live:
        keep = Keep(logging.WARNING)
        # uvicorn's loggers do not propagate to the root: listen to each, and to asyncio's
        names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio", "starlette")
        for name in names:
            logging.getLogger(name).addHandler(keep)
        try:
            yield live, records
        finally:
            for name in names:
                logging.getLogger(name).removeHandler(keep)


# --- what is drawn ------------------------------------------------------------------------------
TOKEN_IDS = st.lists(st.integers(0, V - 1), min_size=1, max_size=20)
PROMPTS = st.one_of(st.text(min_size=1, max_size=30), TOKEN_IDS,
                    st.text(min_size=1, max_size=10).map(lambda t: [t]),
                    TOKEN_IDS.map(lambda ids: [ids]))


@st.composite
def well_formed(draw) -> dict:
    body = {"model": "draft", "prompt": draw(PROMPTS),
            "max_tokens": draw(st.integers(1, 4) | st.none())}  # null: the default, 16
    if draw(st.booleans()):  # sampled, seeded: the same draws wherever it runs
        body |= {"temperature": draw(st.floats(0.5, 1.5)), "seed": draw(st.integers(0, 2**63 - 1))}
    else:
        body["temperature"] = draw(st.sampled_from([0, 0.0]))
        if draw(st.booleans()):
            body["seed"] = draw(st.integers(0, 2**63 - 1) | st.none())
    optional = {"top_k": st.integers(1, V) | st.none(), "user": st.text(max_size=20),
                "n": st.sampled_from([1, 1.0, None]), "top_p": st.sampled_from([1, 1.0, None]),
                "stream": st.booleans() | st.none()}
    for name in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[name] = draw(optional[name])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = draw(st.sampled_from([{}, {"include_usage": True},
                                                       {"include_usage": False}, None]))
    return body


class Nested:
    """A value nested `depth` lists deep, written into the body's text as it is sent
    (json.dumps itself gives up past ~1,000 levels)."""

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"Nested({self.depth})"


NOT_NUMBERS = [True, False, "3", "", [3], {"n": 3}, Nested(100)]
HUGE = [10**400, -10**400, 1e300, -1e300, math.inf, -math.inf, math.nan]
WRONG = {
    "model": [None, 7, True, "target", "", ["draft"], {"id": "draft"}, Nested(100)],
    "prompt": [None, "", [], [-1], [V], [True], [1.5], [0] * (CONTEXT + 1), 12, True,
               {"text": "a"}, ["a", "b"], [[1], [2]], [["a"]], [[]], ["a", 1],
               "x" * (CONTEXT * 13 + 1), "ab " * 200, Nested(100)],
    "max_tokens": [0, -1, 2.5, CONTEXT, CONTEXT + 1, *NOT_NUMBERS, *HUGE],
    "temperature": [-0.1, 2.5, 0.0001, *NOT_NUMBERS, *HUGE],
    "top_k": [0, -1, V + 1, 1.5, *NOT_NUMBERS, *HUGE],
    "seed": [-1, 2**63, 1.5, *NOT_NUMBERS, *HUGE],
    "stream": ["yes", 1, 0, [], {}, Nested(100)],
    "stream_options": [{"include_usage": 1}, {"x": True}, "yes", [], 1, Nested(100)],
    "user": [1, True, ["a"], {"id": 1}, "u" * 1000],
    "n": [2, 0, True, "1", 1.5, [1], *HUGE],
    "top_p": [0.5, 0, True, "1", 2, *HUGE],
}
assert set(WRONG) == FIELDS  # every field the server takes is fuzzed
UNKNOWN = st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS)


@st.composite
def one_field_wrong(draw) -> tuple[dict, str]:
    body = draw(well_formed())
    field = draw(st.sampled_from(sorted(WRONG) + ["an unknown field"]))
    if field == "an unknown field":
        field = draw(UNKNOWN)
        body[field] = draw(JSON)
    else:
        body[field] = draw(st.sampled_from(WRONG[field]))
        if field == "stream_options":  # wrong whether streamed or not
            body["stream"] = draw(st.booleans())
    return body, field


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
ARBITRARY = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(sorted(FIELDS)) | st.text(max_size=8), JSON, max_size=6),
    st.fixed_dictionaries({"model": st.just("draft")}, optional={
        name: JSON for name in sorted(FIELDS - {"model"})}),
    st.binary(max_size=64),
    st.integers(1000, 200_000).map(Nested),
)


def encode(body) -> bytes:
    """The bytes sent: JSON (NaN and Infinity as Python writes them), with each Nested
    value spelled out."""
    if isinstance(body, bytes):
        return body
    nests: list[Nested] = []

    def mark(value):
        if isinstance(value, Nested):
            nests.append(value)
            return f"@@NEST{len(nests) - 1}@@"
        raise TypeError(value)
    text = json.dumps(body, default=mark)
    for i, nest in enumerate(nests):
        text = text.replace(f'"@@NEST{i}@@"', "[" * nest.depth + "]" * nest.depth)
    return text.encode()


# --- what is checked ----------------------------------------------------------------------------
def post(live, http: httpx.Client, body) -> httpx.Response:
    return http.post(live.url + "/v1/completions", content=encode(body),
                     headers={"Content-Type": "application/json"})


def answer_of(r: httpx.Response, stream: bool) -> tuple[str, int | None]:
    """The completion's text and (when given) its completion_tokens."""
    if not stream:
        doc = r.json()
        return doc["choices"][0]["text"], doc["usage"]["completion_tokens"]
    lines = [line for line in r.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-1]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    used = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), (used or [None])[0]


def expected(body: dict) -> list[int]:
    """Greedy: the tokens minikv.generate gives. Sampled: the server's engine draws each
    token from a generator seeded by (seed, position), as minikv.serve does, not from one
    generator for the whole call as generate does: the tokens serve gives the request alone."""
    prompt = body["prompt"]
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(
        prompt[0], (str, list)) else prompt
    ids = TOK.encode(prompt, allowed_special="all") if isinstance(prompt, str) else prompt
    n, temperature = body.get("max_tokens") or 16, body.get("temperature", 1.0)
    if temperature == 0:
        return minikv.generate(MODEL, ids, n, top_k=body.get("top_k"), eos_id=EOT).tokens
    request = minikv.Request(ids, n, temperature=temperature, top_k=body.get("top_k"),
                             seed=body["seed"], eos_id=EOT)
    return minikv.serve(MODEL, [request], num_blocks=64)[0].tokens


def check_error(r: httpx.Response, body) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


SENT = {"well-formed": 0, "one field wrong": 0, "arbitrary": 0}


def test_every_body_gets_its_tokens_or_a_4xx_naming_its_field(server):
    live, records = server
    start = time.monotonic()
    with httpx.Client(timeout=60) as http:

        @settings(max_examples=FUZZ_BODIES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def run(data):
            kind = data.draw(st.sampled_from(sorted(SENT)), label="kind")
            SENT[kind] += 1
            if kind == "well-formed":
                body = data.draw(well_formed(), label="body")
                r = post(live, http, body)
                assert r.status_code == 200, (r.status_code, r.text[:300])
                text, used = answer_of(r, bool(body.get("stream")))
                want = expected(body)
                assert text == TOK.decode([t for t in want if t != EOT])
                if used is not None or not body.get("stream"):
                    assert used == len(want)
            elif kind == "one field wrong":
                body, field = data.draw(one_field_wrong(), label="body, wrong field")
                error = check_error(post(live, http, body), body)
                assert error["param"] == field, (field, error)
            else:
                body = data.draw(ARBITRARY, label="body")
                r = post(live, http, body)
                if r.status_code != 200:
                    error = check_error(r, body)
                    named = set(body) if isinstance(body, dict) else set()
                    assert error["param"] in named | {None, "model", "prompt"}, error
            assert not records, [(r.getMessage(), r.exc_text) for r in records]
        run()
    seconds = time.monotonic() - start
    print(f"{sum(SENT.values())} bodies ({SENT}) in {seconds:.1f} s")
    assert sum(SENT.values()) >= FUZZ_BODIES and min(SENT.values()) > 0
    assert live.wait_idle()["free_blocks"] == 64  # nothing a refusal left behind
    assert not records


def test_health_answers_while_a_50_mb_body_is_refused(server):
    """A client sending 50 MB (with its length declared, or chunked without one) is refused at
    the cap (413), and the event loop stays free: /health answers in well under a second all
    the while. The bound is generous: a busy machine takes tens of milliseconds."""
    live, records = server
    size = 50 << 20
    answers: list = []

    def declared():
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % size)
            chunk = b"[" * (1 << 20)
            try:
                for _ in range(50):
                    s.sendall(chunk)
            except OSError:  # the server answered and closed: the rest is not read
                pass
            answers.append(s.recv(200).split(b" ")[1].decode())  # HTTP/1.1 413 ...

    def chunked():
        def body():
            for _ in range(50):
                yield b"x" * (1 << 20)
        try:
            r = httpx.post(live.url + "/v1/completions", content=body(), timeout=30,
                           headers={"Content-Type": "application/json"})
            answers.append(str(r.status_code))
        except httpx.HTTPError as e:  # the server may close before the client stops sending
            answers.append(type(e).__name__)

    for send in (declared, chunked):
        answers.clear()
        sender = threading.Thread(target=send)
        sender.start()
        waits = []
        while sender.is_alive() or not waits:
            t = time.monotonic()
            assert httpx.get(live.url + "/health", timeout=10).status_code == 200
            waits.append(time.monotonic() - t)
        sender.join(timeout=60)
        assert not sender.is_alive()
        assert max(waits) < 1.0, (send.__name__, max(waits))
        assert answers and answers[0] in ("413", "WriteError", "RemoteProtocolError",
                                          "ReadError"), answers
    assert MAX_BODY_BYTES < size
    assert live.health()["in_flight"] == 0
    assert not records, [(r.getMessage(), r.exc_text) for r in records]


def test_a_client_that_leaves_halfway_through_its_body_leaves_nothing_in_the_log(server):
    live, records = server
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    deadline = time.monotonic() + 60  # the server notices the closed socket when it reads
    while live.health()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # a log record, if any, is written just after the read fails
    assert live.health()["in_flight"] == 0
    assert not records, [(r.getMessage(), r.exc_text) for r in records]
