"""The course in a real browser: JupyterLab + ipywidgets in headless Chromium (Debian's, never a
downloaded one).

nbval compares text; it cannot see whether a stepper renders or answers a click. Here JupyterLab
runs on 127.0.0.1 with a token and throwaway config/data/runtime/workspace directories, Chromium
(driven by Playwright) opens a copy of a chapter, runs every cell, clicks the stepper's Next button
and checks that the caption and the drawn cache length change as the engine's trace says, with no
JavaScript errors. Screenshots land in test-artifacts/browser/ (MINIKV_UPDATE_SCREENSHOTS=1 also
copies them into figures/).

Needs `chromium` on PATH: `make test` installs it with apt where it is missing. Without it these
tests fail and say how to install it; set MINIKV_SKIP_BROWSER=1 to skip them deliberately.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import minikv
from minikv.viz.replay import caption, replay

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
TOKEN = "minikv-browser-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# Installed in the kernel's IPython profile: MINIKV_BREAK_STEPPER=1 makes every stepper's
# Next/Prev raise.
BREAK_STEPPER = """
import os
if os.environ.get("MINIKV_BREAK_STEPPER") == "1":
    import minikv.viz.widgets
    def go(self, step):
        raise RuntimeError("deliberately broken stepper")
    minikv.viz.widgets.TraceStepper.go = go
"""

pytestmark = pytest.mark.browser
# How long a step of a stepper may take to show: a widget round trip takes a fraction of a second,
# but a machine busy with other tests has taken over 10 s. Every wait below polls and returns as
# soon as the page shows the step, so a generous bound costs a passing run nothing.
STEP_WAIT_S = 60
# How long a chapter's cells may take to run in the browser: under a minute alone on 2 cores, but
# several times that beside CPU-bound processes. Polled too.
RUN_ALL_S = 600


def chromium() -> str:
    if os.environ.get("MINIKV_SKIP_BROWSER") == "1":
        pytest.skip("MINIKV_SKIP_BROWSER=1")
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed: run "
                    "`apt-get update && apt-get install -y chromium` as root "
                    "(make test does it), or set MINIKV_SKIP_BROWSER=1 to skip the browser tests")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A throwaway JupyterLab server on 127.0.0.1, always stopped by PID (its kernels with it)."""

    def __init__(self, tmp: Path, notebooks: list[str] | None, broken: bool = False):
        """Serve copies of `notebooks` from a temporary root; None: start it as a student does,
        with `make lab` at the repository's root."""
        self.port, self.root = free_port(), tmp / "root" if notebooks is not None else ROOT
        tmp.mkdir(parents=True)
        if notebooks is not None:
            self.root.mkdir()
        # a copy: Lab may autosave, and the committed notebooks must not change
        for name in notebooks or []:
            shutil.copy(ROOT / "notebooks" / name, self.root / name)
        env = dict(os.environ)
        for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython"),
                         ("MPLCONFIGDIR", "mpl")]:
            env[var] = str(tmp / sub)
            (tmp / sub).mkdir()
        startup = tmp / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-break-stepper.py").write_text(BREAK_STEPPER)
        env["MINIKV_BREAK_STEPPER"] = "1" if broken else "0"
        settings = tmp / "data" / "lab" / "settings"
        settings.mkdir(parents=True)
        (settings / "overrides.json").write_text(json.dumps(
            {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                             "checkForUpdates": False}}))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        self.log = open(tmp / "lab.log", "w")
        flags = ["--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={self.port}",
                 f"--IdentityProvider.token={TOKEN}", "--LabApp.news_url=None"]
        if notebooks is None:  # the Makefile's own recipe, this interpreter's venv as its VENV
            venv = Path(sys.executable).parent.parent
            # the checkpoint Lab saves when it opens a notebook goes here, not beside it
            flags.append(f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}")
            argv = ["make", "-s", "-o", f"{venv}/.installed", f"VENV={venv}", "lab",
                    f"LAB_FLAGS={' '.join(flags)}"]
        else:
            argv = [sys.executable, "-m", "jupyter", "lab", *flags,
                    f"--ServerApp.root_dir={self.root}"]
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.api("status", timeout=60)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def api(self, path: str, timeout: float = 5):
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url(f"api/{path}?token={TOKEN}"), timeout=5) as r:
                    return json.load(r)
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.3)

    def wait_idle(self, notebook: str, timeout: float = 120) -> None:
        """Until the notebook's kernel exists and reports idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sessions = [s for s in self.api("sessions") if s["path"].endswith(notebook)]
            if sessions and sessions[0]["kernel"]["execution_state"] == "idle":
                return
            time.sleep(0.3)
        raise TimeoutError(f"the kernel of {notebook} never became idle")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # Lab stops its kernels on SIGTERM
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


class Browser:
    """Chromium via Playwright; every JavaScript error and failed widget message is collected."""

    def __init__(self, executable: str):
        from playwright.sync_api import sync_playwright
        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=executable,
                                                        args=CHROMIUM_ARGS)
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("console",
                     lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))

    def close(self) -> None:
        self.browser.close()
        self._playwright.stop()


@pytest.fixture
def session(tmp_path):
    """(start_lab(notebooks, broken), browser); both are always shut down."""
    executable = chromium()
    labs, browser = [], Browser(executable)

    def start_lab(notebooks: list[str] | None, broken: bool = False) -> Lab:
        labs.append(Lab(tmp_path / f"lab{len(labs)}", notebooks, broken))
        return labs[-1]
    try:
        yield start_lab, browser
    finally:
        browser.close()
        for lab in labs:
            lab.stop()


def text(html: str) -> str:
    """What a browser shows for a caption's HTML: tags dropped, entities decoded, spaces
    collapsed."""
    import html as html_lib
    return " ".join(html_lib.unescape(re.sub(r"<[^>]+>", " ", html)).split())


def run_notebook(lab: Lab, browser: Browser, notebook: str):
    """Open the notebook, run every cell, wait until the kernel is idle again; return the last
    stepper's locators."""
    page = browser.page
    page.goto(lab.url(f"lab/tree/{notebook}?reset&token={TOKEN}"))
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    panel.locator(".jp-Cell").first.wait_for(timeout=60_000)
    # the "Jupyter news?" prompt hides the stepper
    page.add_style_tag(content=".Toastify { display: none !important; }")
    lab.wait_idle(notebook)
    page.locator("#jp-main-statusbar").get_by_text("Idle").first.wait_for(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    stepper = panel.locator(".widget-vbox:has(> .widget-hbox .minikv-next)").last
    stepper.wait_for(timeout=RUN_ALL_S * 1000)
    # "Run All" queues every cell, and a click on a stepper waits behind them: go on only once
    # no cell is queued or running and the kernel is idle
    deadline = time.monotonic() + RUN_ALL_S
    while panel.locator(".jp-InputArea-prompt", has_text="[*]").count():
        if time.monotonic() > deadline:
            raise AssertionError(f"{notebook}: cells still running after {RUN_ALL_S} s")
        time.sleep(0.5)
    lab.wait_idle(notebook, timeout=RUN_ALL_S)
    return stepper


def shot(browser: Browser, stepper, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stepper.scroll_into_view_if_needed()
    path = ARTIFACTS / f"{name}.png"
    stepper.screenshot(path=str(path))
    if os.environ.get("MINIKV_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(path, ROOT / "figures" / f"browser_{name}.png")


def click_through(browser: Browser, stepper, expected: list[tuple[str, int]], name: str,
                  shots: dict[int, str], first: int = 0, wait: float = STEP_WAIT_S) -> None:
    """Click Next through `expected` (caption text, cache length), the stepper showing step
    `first` (from 0) at the start, and check what the page shows at every step, waiting up to
    `wait` seconds for each thing to show."""
    caption_box, cache_box = stepper.locator(".minikv-caption"), stepper.locator(".minikv-cache")
    image = stepper.locator(".minikv-image img, img.minikv-image").first
    sources = set()
    for i, (want_caption, want_len) in enumerate(expected):
        if i:
            stepper.locator(".minikv-next").click()
        try:
            caption_box.get_by_text(f"step {first + i + 1}/", exact=False).wait_for(
                timeout=wait * 1000)
        except Exception as e:
            raise AssertionError(f"{name}: after {i} clicks the caption still reads "
                                 f"{caption_box.text_content()!r}; "
                                 f"errors: {browser.errors}") from e
        shown = " ".join(caption_box.text_content().split())
        assert shown == want_caption, (
            f"{name} step {i + 1}: caption {shown!r}, trace says {want_caption!r}")
        want_cache = f"KV cache: {want_len} positions"
        deadline = time.monotonic() + wait
        while not cache_box.text_content().startswith(want_cache) and time.monotonic() < deadline:
            # widget updates are separate messages: the cache line may land just after the caption
            time.sleep(0.1)
        cache_text = cache_box.text_content()
        assert cache_text.startswith(want_cache), (
            f"{name} step {i + 1}: {cache_text!r}, trace says {want_len} positions")
        # the slider counts from 1, as the caption does
        readout = stepper.locator(".widget-readout").first
        deadline = time.monotonic() + wait
        while (readout.text_content().strip() != str(first + i + 1)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert readout.text_content().strip() == str(first + i + 1), (
            f"{name} step {first + i + 1}: the slider reads {readout.text_content()!r}")
        deadline = time.monotonic() + wait
        while image.get_attribute("src") in sources and time.monotonic() < deadline:
            time.sleep(0.1)  # the picture's update may arrive just after the caption's
        src = image.get_attribute("src")
        assert src not in sources, (
            f"{name} step {i + 1}: the picture did not change within {wait} s; "
            f"errors: {browser.errors}")
        sources.add(src)
        size = browser.page.evaluate("async src => (await (await fetch(src)).blob()).size", src)
        assert size > 8000, (
            f"{name} step {i + 1}: the picture is {size} bytes, a blank canvas "
            "(a drawn step is ≥ 15 kB)")
        if i in shots:
            shot(browser, stepper, f"{name}_{shots[i]}")
    assert not browser.errors, f"{name}: JavaScript errors: {browser.errors}"


def expected_steps(trace, decode, upto: int) -> list[tuple[str, int]]:
    snaps = replay(trace)
    return [(text(f"step {i + 1}/{len(snaps)} {caption(s, decode)}"), s.cache_len)
            for i, s in enumerate(snaps[:upto])]


def test_speculative_chapter_in_jupyterlab(session):
    """Chapter 04's stepper: prefill → draft → verify → rollback → commit, as the engine's trace
    says."""
    start_lab, browser = session
    lab = start_lab(["04_speculative_decoding.ipynb"])
    stepper = run_notebook(lab, browser, "04_speculative_decoding.ipynb")
    target, tok = minikv.load_course_model("target", "cpu")
    draft, _ = minikv.load_course_model("draft", "cpu")
    # The chapter's main stepper is over this run (notebooks/04, section 1).
    trace = minikv.speculative_generate(target, draft, tok.encode("Once upon a time"), 40, gamma=3,
                                        eos_id=tok.eot_token, trace=True).trace
    kinds = [e.kind for e in trace]
    upto = kinds.index("rollback") + 2  # through the first rollback and its commit
    assert {"prefill", "draft", "verify", "commit"} <= set(kinds[:upto])
    click_through(browser, stepper, expected_steps(trace, tok.decode, upto), "04",
                  {0: "prefill", upto - 3: "verify", upto - 2: "rollback"})


def test_deterministic_chapter_in_jupyterlab(session):
    """Chapter 05's stepper: decode → verify → rollback; each caption's cache length is the one
    drawn."""
    start_lab, browser = session
    lab = start_lab(["05_deterministic_requests.ipynb"])
    stepper = run_notebook(lab, browser, "05_deterministic_requests.ipynb")
    caption_box, cache_box = stepper.locator(".minikv-caption"), stepper.locator(".minikv-cache")
    total = int(re.search(r"step 1/(\d+)", caption_box.text_content()).group(1))
    kinds_seen, saw_rollback = [], False
    for i in range(total):
        if i:
            stepper.locator(".minikv-next").click()
            caption_box.get_by_text(f"step {i + 1}/{total}").wait_for(timeout=STEP_WAIT_S * 1000)
        shown = " ".join(caption_box.text_content().split())
        kind = shown.split()[2].rstrip(":")
        kinds_seen.append(kind)
        length = int(re.match(r"KV cache: (\d+) positions", cache_box.text_content()).group(1))
        if kind == "rollback":  # "rollback: cache 20 → 18; ..." and the drawn cache is 18 long
            before, after = map(int, re.search(r"cache (\d+) → (\d+)", shown).groups())
            assert after < before and length == after, (shown, length)
            shot(browser, stepper, "05_rollback")
            saw_rollback = True
            break
        if kind == "verify" and "prefill" in kinds_seen and len(kinds_seen) < 8:
            shot(browser, stepper, "05_verify")
    assert saw_rollback and {"prefill", "decode", "verify"} <= set(kinds_seen), kinds_seen
    assert not browser.errors, browser.errors


def chapter_06_pool_steps():
    """The run chapter 06's block-pool stepper steps through (notebooks/06, section 3). Its pool
    steps depend on the prompts, budgets and arrivals only (no request has an end-of-text token),
    not on the tokens the model picks."""
    target, tok = minikv.load_course_model("target", "cpu")
    statement = tok.encode("A coin's state is heads. Alice flips, then Bob flips.")
    small = [minikv.Request(statement + tok.encode(" What's the state? A:"), 6),
             minikv.Request(statement + tok.encode(" Then Carol flips. What's the state? A:"), 6,
                            arrival=1),
             minikv.Request(tok.encode("Once upon a time"), 24, arrival=2),
             minikv.Request(tok.encode("The color of dog"), 12, arrival=2)]
    return minikv.serve(target, small, page_size=4, num_blocks=10, trace=True).pool_steps


def test_many_requests_chapter_in_jupyterlab(session):
    """Chapter 06's block-pool stepper opens on the full pool one step before the preemption;
    Next walks through the preemption and the readmission, each caption, numbers line and slider
    readout as the engine's pool records say, each picture drawn anew; Prev goes back."""
    from minikv.viz.pool import pool_caption
    start_lab, browser = session
    lab = start_lab(["06_many_requests.ipynb"])
    stepper = run_notebook(lab, browser, "06_many_requests.ipynb")
    steps = chapter_06_pool_steps()
    logged = [{what for _, what, _, _ in step.log} for step in steps]
    share = next(i for i, kinds in enumerate(logged) if "share" in kinds)
    preempt = next(i for i, kinds in enumerate(logged) if "preempt" in kinds)
    assert share < preempt - 1
    expected = [(text(f"step {i + 1}/{len(steps)} {pool_caption(step)}"),
                 sum(step.lengths.values())) for i, step in enumerate(steps)]
    assert "reused by request(s) [1] from the prefix cache" in expected[share][0]
    click_through(browser, stepper, expected[preempt - 1:preempt + 2], "06",
                  {0: "full", 1: "preempt"}, first=preempt - 1)
    caption_box = stepper.locator(".minikv-caption")
    stepper.locator(".minikv-prev").click()
    caption_box.get_by_text(f"step {preempt + 1}/{len(steps)}").wait_for(
        timeout=STEP_WAIT_S * 1000)
    assert " ".join(caption_box.text_content().split()) == expected[preempt][0]
    assert "preempted (to be recomputed)" in expected[preempt][0]
    assert not browser.errors, browser.errors


def test_a_broken_stepper_fails_the_check(session):
    """With Next's handler raising in the kernel, the caption never advances and the check fails."""
    start_lab, browser = session
    lab = start_lab(["01_prefill_decode.ipynb"], broken=True)
    stepper = run_notebook(lab, browser, "01_prefill_decode.ipynb")
    target, tok = minikv.load_course_model("target", "cpu")
    trace = minikv.generate(target, tok.encode("The color of dog"), 10, eos_id=tok.eot_token,
                            trace=True).trace
    with pytest.raises(AssertionError, match="after 1 clicks the caption still reads"):
        # the stepper is meant never to advance: the wait is spent in full, so keep it short
        click_through(browser, stepper, expected_steps(trace, tok.decode, 3), "01-broken", {},
                      wait=10)


def chapter_09_walk():
    """The walk chapter 09's stepper steps through (notebooks/09, sections 0-2): request 0's
    decode query, layer 3, over its block table after 9 engine steps beside a second request."""
    from minikv.engine.flash import walk
    from minikv.engine.serving import Engine
    target, tok = minikv.load_course_model("target", "cpu")
    cfg = target.config
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the chapter: the same bits as its kernel computes
    try:
        engine = Engine(target, num_blocks=40, page_size=4)
        question = tok.encode(
            "A coin's state is heads. Alice flips, then Bob flips. What's the state? A:")
        engine.add(minikv.Request(question, 12))
        engine.add(minikv.Request(tok.encode("Once upon a time"), 12))
        new = []
        for _ in range(10):  # as the chapter: the prefill's step, then 9 decode steps
            new += engine.step().get(0, ([], False))[0]
        tokens = question + new
        table, length = engine.block_table(0), len(tokens) - 1
        caught = {}
        hook = target.transformer.h[3].attn.c_attn.register_forward_hook(
            lambda module, args, out: caught.update(q=out[0, -1, :cfg.n_embd]))
        with torch.inference_mode():
            target(torch.tensor([tokens[:length]]))
        hook.remove()
        steps = []
        walk(caught["q"].view(cfg.n_head, cfg.head_dim), engine.pool.keys[3],
             engine.pool.values[3], table, 0, length, steps=steps)
    finally:
        torch.set_num_threads(threads)
    return steps, length


def test_attention_kernel_chapter_in_jupyterlab(session):
    """Chapter 09's stepper through a decode query's tiles opens on the first tile that raises
    head 5's max; Next walks on, each caption (block, slots, the max and the rescale factor) and
    numbers line (positions read, m, sum) as engine.flash.walk's steps say, each picture new."""
    from minikv.viz.tiles import walk_caption
    start_lab, browser = session
    lab = start_lab(["09_the_attention_kernel.ipynb"])
    stepper = run_notebook(lab, browser, "09_the_attention_kernel.ipynb")
    steps, length = chapter_09_walk()
    rises = [i for i in range(1, len(steps)) if steps[i].max[5] > steps[i - 1].max[5]]
    expected = [(text(f"step {i + 1}/{len(steps)} {walk_caption(steps, i, 5)}"), length)
                for i in range(len(steps))]
    assert "rescaled by exp(old m − new m)" in expected[rises[0]][0]
    click_through(browser, stepper, expected[rises[0]:rises[0] + 4], "09",
                  {0: "rescale"}, first=rises[0])


def chapter_10_round():
    """The tree round chapter 10's stepper steps through (notebooks/10, section 2): the feature
    head's 2x2 tree, 3 deep, after 21 tokens of the target's own story, verified by the target."""
    from functools import partial

    from minikv.engine.eagle import FeatureProposer
    from minikv.engine.verify import accept_matching, verify_and_commit
    target, tok = minikv.load_course_model("target", "cpu")
    head = minikv.load_feature_head(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the chapter
    try:
        story = tok.encode("Once upon a time")
        seq = (story + minikv.generate(target, story, 40).tokens)[:21]
        propose = FeatureProposer(target, head, minikv.SamplingParams(), torch.Generator(),
                                  tree=(2, 2))
        cache = minikv.KVCache.for_model(target)
        with torch.inference_mode():
            propose.verify(seq[:-1], cache)
            tree = propose(seq, 3)
            accept = partial(accept_matching, sampling=minikv.SamplingParams(),
                             first_position=len(seq), parents=tree.parents)
            rnd = verify_and_commit(list(seq), tree.tokens, cache, propose.verify, accept,
                                    parents=tree.parents)
    finally:
        torch.set_num_threads(threads)
    return rnd, (lambda t: tok.decode([t])), tok.decode([seq[-1]])


def test_speculation_chapter_tree_stepper_in_jupyterlab(session):
    """Chapter 10's stepper through one token-tree round: proposed, judged depth by depth (each
    caption names the target's choice and the children it was offered), committed; the numbers
    line gives the cache holding every node until the commit keeps only the accepted path."""
    from minikv.viz.tree import round_steps, tree_caption
    start_lab, browser = session
    lab = start_lab(["10_speculation_beyond_a_draft.ipynb"])
    stepper = run_notebook(lab, browser, "10_speculation_beyond_a_draft.ipynb")
    rnd, label, root = chapter_10_round()
    steps = round_steps(rnd)
    before, after = rnd.cache_lens["verifier"]
    expected = [(text(f"step {i + 1}/{len(steps)} {tree_caption(rnd, i, label, root)}"),
                 after if s["kind"] == "commit" else before) for i, s in enumerate(steps)]
    assert len(rnd.verdict.path) >= 2 and before > after
    click_through(browser, stepper, expected, "10", {0: "tree_proposed", len(steps) - 1:
                                                     "tree_committed"})


def chapter_11_snapshots():
    """The run chapter 11's tree stepper steps through (notebooks/11, section 4): two users on a
    pool of 22 blocks of 4 with a tier of 16, recorded after every engine step."""
    from minikv.engine.serving import Engine
    from minikv.engine.session import Session, turn
    from minikv.viz.radix import TreeRecorder
    target, tok = minikv.load_course_model("target", "cpu")

    def message(turn_, name, flips):
        act = "flips" if flips else "doesn't flip"
        said = (f"A coin's state is heads. {name} {act}." if turn_ == 0
                else f" Then {name} {act}.")
        return tok.encode(said + " What's the state? A:")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the chapter: the same bits, the same replies
    try:
        engine = Engine(target, 22, page_size=4, prefix_caching=minikv.Radix(tier_blocks=16))
        recorder = TreeRecorder(engine, tok.decode)
        a, b = Session(engine), Session(engine)
        a.say(message(0, "Alice", True), 2)
        b.say(message(0, "Bob", False), 2)
        turn([a, b], [message(1, "Carol", True), message(1, "Dave", True)], 2)
        a.say(message(2, "Erin", False), 2)
        b.say(message(2, "Frank", True), 2)
    finally:
        torch.set_num_threads(threads)
    return recorder.snapshots


def test_cache_across_turns_chapter_tree_stepper_in_jupyterlab(session):
    """Chapter 11's stepper over the engine's radix tree opens on the split; Next walks through
    the turns that follow to a leaf evicted to the tier and the step that copies it back, each
    caption (what the step did to the tree) and numbers line as the engine's recorded state
    says, each picture drawn anew."""
    from minikv.viz.radix import tree_caption, tree_info
    start_lab, browser = session
    lab = start_lab(["11_the_cache_across_turns.ipynb"])
    stepper = run_notebook(lab, browser, "11_the_cache_across_turns.ipynb")
    snaps = chapter_11_snapshots()
    events = [" ".join(s.events) for s in snaps]
    split = next(i for i, e in enumerate(events) if "split at position" in e)
    back = next(i for i, e in enumerate(events) if "copied back from the tier" in e)
    assert split < next(i for i, e in enumerate(events) if "evicted to the tier" in e) < back
    expected = [(text(f"step {i + 1}/{len(snaps)} {tree_caption(s)}"),
                 int(tree_info(s).split()[2])) for i, s in enumerate(snaps)]
    assert "copy-on-write" in expected[split][0]
    click_through(browser, stepper, expected[split:back + 1], "11",
                  {0: "tree_split", back - split: "tree_copied_back"}, first=split)


def chapter_13_stages():
    """The run chapter 13's transfer stepper steps through (notebooks/13, section 6): four short
    prompts and one of 225 tokens at step 4 on a DisaggregatedEngine in lockstep, recorded; the
    long prompt's six stages."""
    from minikv.engine.disagg import DisaggregatedEngine
    from minikv.viz.transfer import TransferRecorder, transfer_stages
    target, tok = minikv.load_course_model("target", "cpu")
    starts = ("The color of dog", "Once upon a time", "Alice flips a coin.", "My cat is")
    crowd = [minikv.Request(tok.encode(text), 20) for text in starts]
    story = "Bob " + "A coin's state is heads. Alice flips, then Bob flips. " * 30
    work = crowd + [minikv.Request(tok.encode(story)[:225], 6, arrival=4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the chapter: the same bits, the same tokens
    try:
        with DisaggregatedEngine(target, 48, lockstep=True, trace=True) as split:
            recorder = TransferRecorder(split)
            for r in work:
                split.add(r)
            while split.has_work():
                split.step()
            recorder.close()
            return transfer_stages(recorder, len(crowd))
    finally:
        torch.set_num_threads(threads)


def test_more_than_one_device_chapter_13_transfer_stepper_in_jupyterlab(session):
    """Chapter 13's stepper over a request's K/V moving from the prefill worker's pool to the
    decode worker's: Next walks sent → computed there → one message → restored into fresh
    blocks (the remap) → admitted → decoding, each caption and numbers line as a run of the
    engine in this process says, each picture drawn anew."""
    from minikv.viz.transfer import transfer_caption, transfer_info
    start_lab, browser = session
    lab = start_lab(["13_more_than_one_device.ipynb"])
    stepper = run_notebook(lab, browser, "13_more_than_one_device.ipynb")
    stages = chapter_13_stages()
    expected = [(text(f"step {i + 1}/{len(stages)} {transfer_caption(s)}"),
                 int(transfer_info(s).split()[2])) for i, s in enumerate(stages)]
    assert "→" in expected[3][0] and stages[3].blocks_here != stages[3].blocks_there
    click_through(browser, stepper, expected, "13", {0: "transfer_sent", 3: "transfer_restored"})


def course_files() -> dict[str, bytes]:
    return {str(p.relative_to(ROOT)): p.read_bytes() if p.is_file() else b"<dir>"
            for folder in ("notebooks", "exercises", "solutions")
            for p in (ROOT / folder).iterdir()}


def test_make_lab_opens_chapter_00_and_an_exercise_from_its_file_browser(session):
    """The README's first command as a student runs it: `make lab` serves the repository's root
    and lands on chapter 00; from the file browser, up to the root, into exercises/, and an
    exercise opens with its kernel. Nothing in the course's folders is written."""
    before = course_files()
    start_lab, browser = session
    lab, page = start_lab(None), browser.page
    assert {"notebooks", "exercises", "solutions"} <= {
        item["name"] for item in lab.api("contents")["content"] if item["type"] == "directory"}
    page.goto(lab.url(f"?token={TOKEN}"))  # the address `make lab` prints, less its path
    page.wait_for_url("**/lab/tree/notebooks/00_setup.ipynb**", timeout=60_000)
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    title = panel.locator(".jp-RenderedMarkdown h1")
    title.filter(has_text="00 · Setup and a tiny GPT").first.wait_for(timeout=60_000)
    page.add_style_tag(content=".Toastify { display: none !important; }")
    files = page.locator("#filebrowser")
    if not files.is_visible():
        page.locator(".jp-SideBar [data-id='filebrowser']").click()
    files.locator(".jp-BreadCrumbs-home").click()  # the lab's root: the repository
    listing = files.locator(".jp-DirListing-item")
    listing.filter(has_text="exercises").first.dblclick()
    exercise = "02_kv_cache_guide.ipynb"
    listing.filter(has_text=exercise).first.dblclick()
    title.filter(has_text="02 · The KV cache, visually").first.wait_for(timeout=60_000)
    page.wait_for_url(f"**/lab/tree/exercises/{exercise}**", timeout=STEP_WAIT_S * 1000)
    lab.wait_idle(f"exercises/{exercise}")  # its kernel started, from the exercises/ folder
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "make_lab_exercise.png"))
    assert not browser.errors, f"JavaScript errors: {browser.errors}"
    lab.stop()
    assert course_files() == before, "the lab wrote into notebooks/, exercises/ or solutions/"
