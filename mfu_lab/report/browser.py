"""Reports checked in a real browser: headless Chromium (Debian's package) driven by Playwright.

For each page: every console error and uncaught exception, every failed request, every request that
would leave the machine (a report must open offline), and every image that did not load, plus a
full-page screenshot. ``mfu-lab check-html JOB_DIR`` runs it on a job's index and step reports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Flags for a closed network: without the background-networking ones Chromium keeps trying to reach
# Google's hosts at start, which a machine without internet refuses many times over.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_chromium(install: bool = True) -> tuple[str | None, str]:
    """The Chromium binary, installing Debian's ``chromium`` package when absent and this process may
    (root with apt-get); else None and why not."""
    path = find_chromium()
    if path or not install:
        return path, "" if path else "no chromium on PATH"
    if not shutil.which("apt-get"):
        return None, "no chromium on PATH, and no apt-get to install Debian's chromium package"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return None, "no chromium on PATH; installing Debian's chromium package needs root (apt-get install chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd, limit in ((["apt-get", "update", "-q"], 180), (["apt-get", "install", "-y", "-q", "chromium"], 600)):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)
        except (subprocess.TimeoutExpired, OSError) as e:
            return None, f"{' '.join(cmd)} did not finish: {e}"
        if p.returncode != 0 and cmd[1] == "install":
            return None, f"apt-get install chromium failed: {p.stderr.strip()[-400:]}"
    path = find_chromium()
    return path, "" if path else "apt-get install chromium ran, but no chromium binary is on PATH"


@dataclass
class PageCheck:
    page: str
    screenshot: str = ""
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)
    split_words: list[str] = field(default_factory=list)  # a short word of a table cell split over two lines
    wider_px: int = 0  # how far the page is wider than the window (a table or figure that does not wrap)
    images: int = 0
    height_px: int = 0

    @property
    def ok(self) -> bool:
        return not (self.console_errors or self.failed_requests or self.external_requests or self.broken_images
                    or self.split_words or self.wider_px)

    def problems(self) -> list[str]:
        return ([f"console: {m}" for m in self.console_errors] + [f"failed request: {u}" for u in self.failed_requests]
                + [f"request off the machine: {u}" for u in self.external_requests]
                + [f"image not loaded: {i}" for i in self.broken_images]
                + [f"word split over two lines in a table: {w!r}" for w in self.split_words]
                + ([f"page {self.wider_px} px wider than the window"] if self.wider_px else []))


LOCAL = ("file:", "data:", "about:", "blob:")  # what a report may load: nothing off the machine
SHORT_WORD = 24  # a table cell's word up to this many characters fits any column: it never breaks mid-word
# Each word of SHORT_WORD characters or fewer in a table cell whose boxes lie on more than one line: a column the
# browser squeezed below its words (e.g. "exclude|d"), which a reader must piece together.
SPLIT_WORDS_JS = """max => { const out = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    if (!n.parentElement || !n.parentElement.closest('td, th')) continue;
    for (const m of n.data.matchAll(/[\\w.,:;%'µ]+/g)) {  // a word: a break at a space, dash, bracket... is fair
      if (m[0].length < 2 || m[0].length > max) continue;
      const r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
      const boxes = Array.from(r.getClientRects()).filter(b => b.width > 0);  // a box per run of one font
      if (boxes.some(b => Math.abs(b.top - boxes[0].top) > boxes[0].height / 2)) out.push(m[0]);  // another line
    } }
  return out; }"""


def check_pages(pages: list[Path], shots: Path, chromium: str, width: int = 1280) -> list[PageCheck]:
    """Open each page from disk in headless Chromium; record what went wrong and save a full-page screenshot."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    out = []
    with sync_playwright() as pw:  # Playwright gives the browser a fresh, empty profile
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            for page_path in pages:
                page_path = Path(page_path).resolve()
                c = PageCheck(str(page_path))
                page = browser.new_page(viewport={"width": width, "height": 900})
                # A page's scripts never reach the network: a request off the machine is aborted (and reported).
                page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(LOCAL) else
                           route.abort("blockedbyclient"))
                page.on("console", lambda m, c=c: c.console_errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda exc, c=c: c.console_errors.append(f"uncaught: {exc}"))
                page.on("requestfailed", lambda r, c=c: c.failed_requests.append(f"{r.url} ({r.failure})"))
                page.on("request", lambda r, c=c: c.external_requests.append(r.url)
                        if not r.url.startswith(LOCAL) else None)
                page.goto(page_path.as_uri(), wait_until="load")
                imgs = page.evaluate("Array.from(document.images).map(i => [i.alt || i.src.slice(0, 60), "
                                     "i.complete && i.naturalWidth > 0])")
                c.images = len(imgs)
                c.broken_images = [alt for alt, ok in imgs if not ok]
                c.height_px = page.evaluate("document.documentElement.scrollHeight")
                c.split_words = page.evaluate(SPLIT_WORDS_JS, SHORT_WORD)[:20]
                c.wider_px = max(0, page.evaluate("document.documentElement.scrollWidth") - width)
                name = page_path.parent.name + "_" + page_path.stem if page_path.stem != "index" else "index"
                c.screenshot = str(shots / f"{name}.png")
                page.screenshot(path=c.screenshot, full_page=True)
                page.close()
                out.append(c)
        finally:
            browser.close()
    return out


def job_pages(job_root: Path) -> list[Path]:
    """The index and every step report of a job's output folder."""
    job_root = Path(job_root)
    pages = [job_root / "index.html"] if (job_root / "index.html").is_file() else []
    return pages + sorted(job_root.glob("[0-9][0-9]_*/report.html"))
