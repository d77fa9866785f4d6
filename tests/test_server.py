"""The HTTP server (python -m minikv serve-http), live on localhost: the official `openai` client
streams a completion and gets the tokens minikv.generate gives; bad requests get a 4xx that names
the field; a full server answers 503; a client that disconnects has its blocks freed."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

import minikv
from minikv.course.checkpoint import load_course_model
from minikv.server import Detokenizer, create_app

MODEL, TOK = load_course_model("draft")
PROMPT = "Ada flips a coin. It lands"
# How long a server may take to start, answer or go idle: milliseconds here, but a machine busy
# with other tests has taken seconds. Every wait polls and ends as soon as the server is ready,
# so a generous bound costs a passing run nothing.
WAIT_S = 60


class Live:
    """A uvicorn server on a free localhost port, in a thread, for one test module."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def health(self):
        return httpx.get(self.url + "/health", timeout=WAIT_S).json()

    def wait_idle(self, timeout=WAIT_S):
        deadline = time.monotonic() + timeout
        while (h := self.health())["running"] or h["waiting"] or h["in_flight"]:
            assert time.monotonic() < deadline, f"the server is still busy: {h}"
            time.sleep(0.05)
        return h


@pytest.fixture(scope="module")
def live():
    with Live(create_app(MODEL, TOK, "draft", num_blocks=64, max_running=4, max_queue=4)) as s:
        yield s


def test_a_server_whose_decode_runs_at_fixed_shapes_gives_the_same_tokens():
    """create_app(graphs=): the decode pass of GraphDecode (on a CPU: its buffers run eagerly;
    on a GPU, `serve-http` replays them as CUDA graphs), three clients at once."""
    prompts = [PROMPT, "Bob flips a coin twice.", "Once upon a time"]
    want = [TOK.decode([t for t in minikv.generate(MODEL, TOK.encode(p), 16,
                                                   eos_id=TOK.eot_token).tokens
                        if t != TOK.eot_token]) for p in prompts]
    app = create_app(MODEL, TOK, "draft", num_blocks=64, max_running=4, graphs=(1, 2, 4))
    assert app.state.worker.engine.runner.graphs.sizes == (1, 2, 4)
    with Live(app) as live, ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda p: client(live).completions.create(
            model="draft", prompt=p, max_tokens=16, temperature=0).choices[0].text, prompts))
    assert texts == want


def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def test_the_openai_client_streams_the_tokens_generate_gives(live):
    want = minikv.generate(MODEL, TOK.encode(PROMPT), 24, eos_id=TOK.eot_token).tokens
    pieces = [chunk.choices[0] for chunk in client(live).completions.create(
        model="draft", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)]
    assert len(pieces) > 1  # streamed, not sent whole
    text = "".join(c.text for c in pieces)
    assert text == TOK.decode([t for t in want if t != TOK.eot_token])
    assert pieces[-1].finish_reason == ("stop" if TOK.eot_token in want else "length")
    assert all(c.finish_reason is None for c in pieces[:-1])
    whole = client(live).completions.create(model="draft", prompt=PROMPT, max_tokens=24,
                                            temperature=0)
    assert whole.choices[0].text == text
    assert whole.usage.completion_tokens == len(want)
    assert whole.usage.prompt_tokens == len(TOK.encode(PROMPT))
    assert live.wait_idle()["free_blocks"] == 64


def test_concurrent_streams_each_get_their_own_tokens(live):
    prompts = [f"{name} flips a coin. It lands" for name in ("Ada", "Bo", "Cy", "Di", "Ed")]
    results = {}

    def ask(p):
        chunks = client(live).completions.create(model="draft", prompt=p, max_tokens=16,
                                                 temperature=0, stream=True)
        results[p] = "".join(c.choices[0].text for c in chunks)
    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for p in prompts:
        want = minikv.generate(MODEL, TOK.encode(p), 16, eos_id=TOK.eot_token).tokens
        assert results[p] == TOK.decode([t for t in want if t != TOK.eot_token])
    live.wait_idle()


def test_a_seeded_sampled_request_is_reproducible(live):
    def ask():
        return client(live).completions.create(model="draft", prompt=PROMPT, max_tokens=12,
                                               temperature=1.0, seed=7).choices[0].text
    assert ask() == ask()


@pytest.mark.parametrize("body, status, field, message", [
    ({"model": "draft", "prompt": PROMPT, "stop": ["."]}, 400, "stop", "unsupported parameter"),
    ({"model": "target", "prompt": PROMPT}, 404, "model", "is not served here"),
    ({"model": "draft", "prompt": ""}, 400, "prompt", "prompt is empty"),
    ({"model": "draft", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"model": "draft", "prompt": [1, 99_999]}, 400, "prompt", "outside the vocabulary"),
    ({"model": "draft", "prompt": 12}, 400, "prompt", "non-empty string or a list of token ids"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "from 1 to"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens", "an integer"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": 10_000}, 400, "max_tokens", "from 1 to"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": 250}, 400, "max_tokens",
     "does not fit this server"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": 10**400}, 400, "max_tokens", "from 1 to"),
    ({"model": "draft", "prompt": PROMPT, "seed": -10**400}, 400, "seed", "from 0 to"),
    ({"model": "draft", "prompt": PROMPT, "max_tokens": True}, 400, "max_tokens", "an integer"),
    ({"model": "draft", "prompt": PROMPT, "temperature": 0.0001}, 400, "temperature", "0.001"),
    ({"model": "draft", "prompt": PROMPT, "n": True}, 400, "n", "n must be 1"),
    ({"model": "draft", "prompt": PROMPT, "top_p": False}, 400, "top_p", "top_p must be 1"),
    ({"model": "draft", "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": 1}},
     400, "stream_options", "include_usage: true or false"),
    ({"model": "draft", "prompt": PROMPT, "stream_options": {}}, 400, "stream_options",
     "add \"stream\": true"),
    ({"model": "draft", "prompt": PROMPT, "user": ["a"]}, 400, "user", "user must be a string"),
    ({"model": 7, "prompt": PROMPT}, 400, "model", "model must be a string"),
    ({"model": "draft", "prompt": "x" * 100_000}, 400, "prompt", "shorten it"),
    ({"model": "draft", "prompt": [1] * 300}, 400, "prompt", "shorten it"),
    ({"model": "draft", "prompt": [True, 2]}, 400, "prompt", "list of token ids"),
    ({"model": "draft", "prompt": "ab " * 200}, 400, "prompt", "does not fit this server"),
    ({"model": "draft", "prompt": PROMPT, "temperature": 3}, 400, "temperature", "from 0.0 to 2"),
    ({"model": "draft", "prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "a number"),
    ({"model": "draft", "prompt": PROMPT, "temperature": True}, 400, "temperature", "a number"),
    ({"model": "draft", "prompt": PROMPT, "n": 2}, 400, "n", "n must be 1"),
    ({"model": "draft", "prompt": PROMPT, "stream": "yes"}, 400, "stream", "true or false"),
    (["not", "an", "object"], 400, None, "must be a JSON object"),
])
def test_a_bad_request_is_refused_naming_its_field(live, body, status, field, message):
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == field
    assert live.health()["in_flight"] == 0  # nothing was queued


def test_a_body_that_is_not_json_is_a_400(live):
    r = httpx.post(live.url + "/v1/completions", content=b"{prompt: nope", timeout=WAIT_S,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw, status, message", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"model": "draft", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not JSON"),
    (b'{"model": "draft", "prompt": "a", "temperature": 1e999}', 400, "from 0.0 to 2.0"),
    (b'{"model": "draft", "prompt": "a", "temperature": NaN}', 400, "from 0.0 to 2.0"),
    (b"\xff\xfe", 400, "not JSON"),
    (b'{"model": "draft", "prompt": "' + b"a" * (2 << 20) + b'"}', 413, "larger than"),
])
def test_a_body_no_parser_could_take_is_a_4xx_in_json(live, raw, status, message):
    r = httpx.post(live.url + "/v1/completions", content=raw, timeout=WAIT_S,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status and message in r.json()["error"]["message"]
    assert live.health()["in_flight"] == 0


def test_a_path_or_method_not_served_is_answered_in_openai_s_error_body(live):
    for r in (httpx.get(live.url + "/v1/chat/completions", timeout=WAIT_S),
              httpx.get(live.url + "/v1/completions", timeout=WAIT_S)):
        assert r.status_code in (404, 405)
        assert "this server serves POST /v1/completions" in r.json()["error"]["message"]


def test_the_openai_client_raises_the_servers_message(live):
    with pytest.raises(openai.BadRequestError, match="unsupported parameter"):
        client(live).completions.create(model="draft", prompt=PROMPT, logprobs=2)
    with pytest.raises(openai.NotFoundError, match="this server serves 'draft'"):
        client(live).completions.create(model="gpt-4", prompt=PROMPT)


def test_v1_models_lists_the_served_model(live):
    assert [m.id for m in client(live).models.list()] == ["draft"]


def slow(model, seconds):
    """`model`, its every pass `seconds` longer: a server busy long enough to fill up."""
    forward = model.forward

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)
    model.forward = slowed
    return model


def test_a_full_server_answers_503_and_a_disconnect_frees_the_blocks():
    model, _ = load_course_model("draft")
    app = create_app(slow(model, 0.05), TOK, "draft", num_blocks=32, max_running=1,
                     max_queue=1)
    with Live(app) as live:
        body = {"model": "draft", "prompt": PROMPT, "max_tokens": 200, "stream": True}
        with httpx.Client(timeout=WAIT_S) as http:
            with http.stream("POST", live.url + "/v1/completions", json=body) as first:
                lines = first.iter_lines()
                assert next(lines).startswith("data: ")  # the first running, a token out
                with http.stream("POST", live.url + "/v1/completions", json=body) as second:
                    assert second.status_code == 200  # waits in the queue
                    third = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT_S)
                    assert third.status_code == 503 and third.headers["Retry-After"] == "1"
                    assert "the server is full" in third.json()["error"]["message"]
                    h = live.health()
                    assert h["in_flight"] == 2  # counted as the HTTP side took them
                    deadline = time.monotonic() + WAIT_S
                    while h["waiting"] == 0 and time.monotonic() < deadline:
                        time.sleep(0.01)  # the engine thread takes the second between steps
                        h = live.health()
                    assert (h["running"], h["waiting"]) == (1, 1)
                    assert h["free_blocks"] < 32
                # both clients hang up halfway: their requests leave, their blocks come back
        h = live.wait_idle()
        assert h["free_blocks"] == 32
        done_at = h["step"]
        time.sleep(0.3)
        assert live.health()["step"] == done_at  # nothing is still being computed for them


def test_the_detokenizer_holds_back_half_a_character():
    ids = TOK.encode("café ☕ ok")
    pieces, d = [], Detokenizer(TOK)
    for t in ids:
        pieces.append(d.piece([t]))
    assert "".join(pieces) == "café ☕ ok"
    assert all("\ufffd" not in p for p in pieces)


def test_serve_http_is_a_command():
    from minikv.__main__ import COMMANDS
    assert COMMANDS["serve-http"] == ("minikv.server", False)
    with pytest.raises(SystemExit):
        from minikv.server import main
        main(["--max-queue", "-1", "--port", "1"])


def test_sse_lines_are_json_then_done(live):
    body = {"model": "draft", "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert events[-1]["usage"]["completion_tokens"] == 5 and events[-1]["choices"] == []
    assert all(e["object"] == "text_completion" for e in events)


def test_an_engine_that_fails_answers_500_then_503():
    model, _ = load_course_model("draft")

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")
    model.forward = broken
    with Live(create_app(model, TOK, "draft", num_blocks=16)) as live:
        body = {"model": "draft", "prompt": PROMPT, "max_tokens": 4}
        first = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert first.status_code == 500
        assert "the device fell over" in first.json()["error"]["message"]
        again = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert again.status_code == 503 and "restart the server" in again.json()["error"]["message"]
