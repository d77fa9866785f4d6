"""`make book`: the chapters as a static site, read in headless Chromium.

The book is built by the Makefile's own recipe into a temporary folder, then served from 127.0.0.1.
Every link the site has must lead to a page or file it has; the landing page lists the chapters in
order; a chapter shows every picture its notebook saved (each stepper's first step included, not a
blank widget area) and its formula, and its links to other chapters and to the glossary open them.
The site needs nothing from the network: every request that leaves 127.0.0.1 fails the test.
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from test_browser import CHROMIUM_ARGS, chromium

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "book"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOURCES = ("notebooks", "book", "solutions")  # what the book reads: it must write nothing there

pytestmark = pytest.mark.browser


class Links(HTMLParser):
    """A page's links (<a href>) and the resources it loads (src=, <link href>), as written."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.loads: list[str] = []
        self.pictures = 0  # <img> inside the page's <article>, the chapter's body
        self.in_article = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.in_article += tag == "article"
        self.pictures += tag == "img" and self.in_article > 0
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag == "link" and attrs.get("href"):
            self.loads.append(attrs["href"])
        if attrs.get("src"):
            self.loads.append(attrs["src"])

    def handle_endtag(self, tag):
        self.in_article -= tag == "article"


def snapshot() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in SOURCES for p in sorted((ROOT / folder).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}  # book/_ext's, when Python writes it


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> tuple[Path, float]:
    """(the site's html folder, seconds the build took), built by `make book` itself."""
    out = tmp_path_factory.mktemp("book")
    venv = Path(sys.executable).parent.parent
    before = snapshot()
    start = time.monotonic()
    # -o: the test runs inside an installed venv, so make must not reinstall it first
    run = subprocess.run(["make", "-s", "-o", f"{venv}/.installed", f"VENV={venv}", "book",
                          f"BOOK_OUT={out}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    seconds = time.monotonic() - start
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    changed = sorted(set(before.items()) ^ set(snapshot().items()))
    assert not changed, f"make book wrote beside the chapters: {changed[:5]}"
    print(f"make book: {seconds:.1f} s")
    return out / "_build" / "html", seconds


def pictures(notebook: Path) -> int:
    """Saved outputs with a picture: matplotlib figures and each stepper's first step."""
    return sum("image/png" in out.get("data", {})
               for cell in nbformat.read(notebook, as_version=4).cells
               for out in cell.get("outputs", []))


def title(notebook: Path) -> str:
    first = next(c for c in nbformat.read(notebook, as_version=4).cells
                 if c.cell_type == "markdown")
    return next(line[2:].strip() for line in first.source.splitlines() if line.startswith("# "))


def test_every_link_in_the_book_leads_somewhere(book):
    html, _ = book
    pages = {str(p.relative_to(html)): p for p in sorted(html.rglob("*.html"))
             if "_static" not in p.parts}  # the themes' template fragments, not pages
    wanted = {f"notebooks/{c.stem}.html" for c in CHAPTERS} | {
        "notebooks/glossary.html", "solutions/concept-questions.html", "book/intro.html"}
    assert wanted <= set(pages), f"pages missing: {sorted(wanted - set(pages))}"
    broken, remote = [], []
    for name, page in pages.items():
        parser = Links()
        parser.feed(page.read_text(errors="replace"))
        remote += [f"{name} loads {u}" for u in parser.loads
                   if urlparse(u).scheme in ("http", "https")]
        for link in parser.links + parser.loads:
            url = urlparse(link)
            if url.scheme or url.netloc or not url.path:  # another site, or this page's anchor
                continue
            target = (page.parent / unquote(url.path)).resolve()
            if not target.is_file() or not target.stat().st_size:
                broken.append(f"{name} → {link}")
        chapter = ROOT / "notebooks" / name.removeprefix("notebooks/").replace(".html", ".ipynb")
        if chapter in CHAPTERS:  # every saved picture is on the page, none became a blank widget
            assert parser.pictures == pictures(chapter), (
                f"{name}: {parser.pictures} pictures, {pictures(chapter)} saved in the notebook")
    assert not broken, f"{len(broken)} broken links, e.g. {broken[:5]}"
    assert not remote, f"pages load from the network (a CDN?): {remote[:5]}"


@pytest.fixture
def site(book):
    """(the site's address on 127.0.0.1, Playwright's page, requests elsewhere, errors)."""
    from playwright.sync_api import sync_playwright
    executable = chromium()  # skips (MINIKV_SKIP_BROWSER=1) or fails before anything starts
    html, _ = book

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    playwright = sync_playwright().start()
    browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    elsewhere, errors = [], []

    def route(r):  # the test runs offline too: a request elsewhere is refused, and recorded
        if r.request.url.startswith(address + "/"):
            r.continue_()
        else:
            elsewhere.append(r.request.url)
            r.abort()
    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.on("response", lambda r: r.status >= 400 and errors.append(f"{r.status}: {r.url}"))
    try:
        yield address, page, elsewhere, errors
    finally:
        browser.close()
        playwright.stop()
        server.shutdown()


def test_the_book_opens_in_a_browser(site):
    address, page, elsewhere, errors = site
    page.goto(f"{address}/index.html")  # the site's front door redirects to the landing page
    page.wait_for_url("**/book/intro.html", timeout=30_000)
    article = page.locator("article")
    listed = [" ".join(t.split()) for t in article.locator("ol li a").all_text_contents()]
    titles = [title(c) for c in CHAPTERS]
    assert len(titles) == 14 and listed == titles

    chapter = "04_speculative_decoding"
    article.locator("ol li a", has_text=titles[4]).click()
    page.wait_for_url(f"**/notebooks/{chapter}.html", timeout=30_000)
    page.wait_for_load_state("load")
    images = article.locator("img")
    want = pictures(ROOT / "notebooks" / f"{chapter}.ipynb")
    assert want >= 2 and images.count() == want, (  # the stepper's picture and a figure, at least
        f"{chapter}: {images.count()} pictures on the page, {want} saved in the notebook")
    for i in range(want):
        width = images.nth(i).evaluate("img => img.complete ? img.naturalWidth : 0")
        assert width > 100, f"{chapter}: picture {i} did not load ({width} px wide)"
    # its one formula, drawn by the browser from MathML: a fraction, so taller than a line of text
    formula = article.locator("math[display=block]").first.bounding_box()
    assert formula and formula["width"] > 200 and formula["height"] > 30, formula
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    images.nth(0).scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / f"{chapter}.png"))

    # a link in the chapter's text to another chapter (the markdown's `[…](NN_name.ipynb)`)
    hrefs = article.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    other = next(h for h in hrefs if re.fullmatch(r"\d\d_\w+\.html", h or "")
                 and not h.startswith(chapter))
    article.locator(f"a[href='{other}']").first.click()
    page.wait_for_url(f"**/notebooks/{other}", timeout=30_000)
    want_title = title(ROOT / "notebooks" / other.replace(".html", ".ipynb"))
    assert " ".join(page.locator("article h1").first.inner_text().split()) == want_title
    assert want_title in page.title()
    page.locator("a[href='glossary.html']").first.click()  # the text's, or the sidebar's
    page.wait_for_url("**/notebooks/glossary.html", timeout=30_000)
    assert "Glossary" in page.locator("article h1").first.inner_text()
    assert not errors, f"errors in the browser: {errors}"
    assert not elsewhere, f"the site fetched from outside 127.0.0.1: {elsewhere}"


def test_the_build_is_quick(book):
    """The whole book takes seconds, not minutes: nothing is executed (a build that ran the
    notebooks would take about ten minutes on 2 cores)."""
    _, seconds = book
    assert seconds < 120, f"make book took {seconds:.0f} s: is it executing the notebooks?"
