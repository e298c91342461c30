"""The course site (``make site``): built from README, docs/ and the stored notebooks, then every page opened
in a real headless browser (Debian's Chromium, driven by Playwright) as a reader would open it.

Checked on every page: it loads with no console error, no uncaught script error and no failed request
(nothing is fetched from the network: the site is whole); every image on it loaded; every link inside
the site leads to a file the site has (and to an element with that id, for a link with #anchor). On
the front page: the headline picture. Skipped, with the reason, only where no Chromium can be found
(``apt-get install chromium``; CI installs it in .ci/run). ~60 s on 2 cores: the build ~20 s, the pages.
"""

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = next((path for path in (shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser"))
                 if path and Path(path).exists()), None)
#: what works headless as root in a container, with nothing reached outside the machine
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: the build's own files, not pages of the course (MathJax ships test pages of its own)
NOT_PAGES = ("_static", "_sources", "_downloads", "_images")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: apt-get install chromium")


def build_site(out: Path) -> Path:
    """What ``make site`` runs, into ``out``."""
    run = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-c", "site", "-q", ".", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site, served on the loopback address (as a reader's browser would get it): (folder, URL)."""
    out = build_site(tmp_path_factory.mktemp("site") / "html")
    handler = functools.partial(QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def pages(out: Path) -> list[Path]:
    return sorted(path for path in out.rglob("*.html") if not set(path.relative_to(out).parts) & set(NOT_PAGES))


def ids_of(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))


def broken_links(out: Path, page: Path, hrefs: list[str]) -> list[str]:
    """The links of ``page`` inside the site that lead to no file of it, or to no element with their #id."""
    broken = []
    for href in hrefs:
        parts = urlsplit(href)
        if parts.scheme in ("http", "https") and parts.hostname != "127.0.0.1" or parts.scheme in ("mailto", "data"):
            continue
        target = out / unquote(parts.path).lstrip("/") if parts.path else page
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{href} (no such file)")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in ids_of(target):
            broken.append(f"{href} (no element with id {parts.fragment!r})")
    return broken


def test_every_page_of_the_site_opens_whole_in_a_browser(site):
    from playwright.sync_api import sync_playwright

    assert Path("/usr/share/javascript/mathjax/MathJax.js").exists(), \
        "no local MathJax: apt-get install libjs-mathjax (else the pages fetch it from a CDN)"
    out, url = site
    found = pages(out)
    names = {path.relative_to(out).as_posix() for path in found}
    assert {"index.html", "README.html", "docs/benchmarks.html", "notebooks/00_quick_start.html",
            "notebooks/10_results.html"} <= names
    assert {f"notebooks/{path.stem}.html" for path in ROOT.glob("notebooks/[0-9][0-9]_*.ipynb")} <= names
    problems = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        context = browser.new_context()
        for path in found:
            name = path.relative_to(out).as_posix()
            errors = []
            tab = context.new_page()
            tab.on("console", lambda message: errors.append(f"console: {message.text}")
                   if message.type == "error" else None)
            tab.on("pageerror", lambda error: errors.append(f"script error: {error}"))
            tab.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))
            tab.on("response", lambda response: errors.append(f"HTTP {response.status}: {response.url}")
                   if response.status >= 400 else None)
            tab.goto(url + name, wait_until="load")
            tab.wait_for_load_state("networkidle")
            broken_images = tab.evaluate("Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0)"
                                         ".map(i => i.getAttribute('src'))")
            hrefs = tab.evaluate("Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
            local = [href.replace(url, "/", 1) if href.startswith(url) else href for href in hrefs]
            problems += [f"{name}: {error}" for error in errors]
            problems += [f"{name}: image not loaded: {src}" for src in broken_images]
            problems += [f"{name}: broken link {link}" for link in broken_links(out, path, local)]
            if name == "index.html":
                headline = tab.evaluate("Array.from(document.images).filter(i => i.src.endsWith('headline.png'))"
                                        ".map(i => i.naturalWidth)")
                if not headline or not all(headline):
                    problems.append("index.html: the headline picture is not on the front page")
            tab.close()
        browser.close()
    assert not problems, f"{len(problems)} problems in {len(found)} pages:\n" + "\n".join(problems[:40])
