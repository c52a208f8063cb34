"""``mfu-lab lab`` in a real JupyterLab, driven by headless Chromium: the tiny job's lab prepared, a JupyterLab
server started on it (with the command ``mfu-lab lab`` builds, so ``--allow-root`` when root), step 1's notebook
opened and run top to bottom from the browser, no error shown, and the explorer's slider moved: its plot redraws.

Screenshots (before and after the slider move) go to ``$MFU_LAB_SCREENSHOTS`` when set, else the test's temporary
folder; their paths are printed. The whole test is held to :data:`LIMIT_S` seconds: a watchdog stops the server.
"""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from mfu_lab import lab
from mfu_lab.cli import main
from mfu_lab.core.registry import STEPS
from mfu_lab.report.browser import CHROMIUM_ARGS, ensure_chromium

from .conftest import ROOT, TINY

pytestmark = pytest.mark.e2e

LIMIT_S = 180  # the whole test, server start to screenshots; it takes about 15-30 s on a 2-core CPU
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in the current tab
# Settings for this server only (the user's own are not read or written): every cell rendered (no windowing, so
# the explorer at the bottom is in the page), and no news popup over the notebook.
SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                                "checkForUpdates": False}}


@pytest.fixture(scope="session")
def chromium():
    pytest.importorskip("playwright", reason="playwright is not installed: pip install -e '.[test]'")
    path, why = ensure_chromium(install=True)
    if not path:
        pytest.skip(f"headless Chromium unavailable, browser checks skipped: {why}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyter_lab(folder: Path, home: Path, deadline: float):
    """A JupyterLab server on ``folder`` (no token, local only) until the block ends or the deadline passes; its
    base URL. Its settings, workspaces and runtime files live in ``home``."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed: pip install jupyterlab")
    port = free_port()
    for name, values in SETTINGS.items():
        (home / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (home / "settings" / name).write_text(json.dumps(values))
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    cmd = lab.lab_command(folder, port, False, "--ServerApp.ip=127.0.0.1", "--ServerApp.token=",
                          "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True")
    log = home / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:  # the server, and the kernels it started (its process group)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()

    watchdog = threading.Timer(max(1.0, deadline - time.monotonic()), stop)
    watchdog.start()
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            assert server.poll() is None, f"JupyterLab exited ({server.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"JupyterLab did not answer:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url, log
    finally:
        watchdog.cancel()
        stop()


def digests() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}


# The notebook's kernel started and idle: the toolbar's indicator says idle from the start, before any kernel, so
# the status bar must name the kernel too ("Python 3 (ipykernel) | Idle", not "No Kernel | Initializing").
KERNEL_READY = """(panel) => {
    const bar = document.querySelector('#jp-main-statusbar'), dot = document.querySelector(panel +
        ' .jp-Notebook-ExecutionIndicator');
    return !!bar && !!dot && dot.getAttribute('data-status') === 'idle' && bar.textContent.includes(' | Idle')
        && !bar.textContent.includes('No Kernel');
}"""
def ran(notebook: Path) -> bool:
    """Every code cell of the notebook file has an execution count (it was run and saved)."""
    try:
        cells = json.loads(notebook.read_text())["cells"]
    except ValueError:  # being written
        return False
    return all(c["execution_count"] for c in cells if c["cell_type"] == "code")


ERROR = re.compile(r"Traceback|^\w*(Error|Exception)\b", re.M)


def test_step_1_runs_in_jupyterlab_and_its_explorer_redraws(tmp_path, chromium):
    from playwright.sync_api import sync_playwright

    deadline = time.monotonic() + LIMIT_S

    def left_ms(cap_s: float = LIMIT_S) -> float:
        return max(1000.0, min(cap_s, deadline - time.monotonic()) * 1000)

    before = digests()
    out = tmp_path / "out"
    assert main(["lab", str(TINY), "--out", str(out), "--prepare-only"]) == 0
    folder = out / "tiny" / "lab"
    notebook = STEPS[0].notebook
    shots = Path(os.environ.get("MFU_LAB_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "jupyter"
    home.mkdir()
    console: list[str] = []
    with jupyter_lab(folder, home, deadline) as (url, log), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        try:
            # nothing leaves the machine: JupyterLab's own server, and what the page makes itself
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
                (url, "blob:", "data:", "about:")) else route.abort("blockedbyclient"))
            page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: console.append(f"uncaught: {exc}"))
            page.goto(f"{url}/lab/tree/{notebook}", timeout=left_ms(90))
            page.wait_for_selector(f"{PANEL} .jp-CodeCell", timeout=left_ms(90))
            page.wait_for_function(KERNEL_READY, arg=PANEL, timeout=left_ms(90))

            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()  # Run > Run All Cells
            page.locator("li[data-command='runmenu:run-all']").click()
            page.wait_for_function(  # every code cell ran: each prompt shows its execution count
                """(panel) => { const ps = [...document.querySelectorAll(panel + ' .jp-CodeCell .jp-InputArea-prompt')];
                   return ps.length > 0 && ps.every(p => /^\\[\\d+\\]:$/.test(p.textContent.trim())); }""",
                arg=PANEL, timeout=left_ms(150))
            page.wait_for_function(KERNEL_READY, arg=PANEL, timeout=left_ms(60))

            # JupyterLab 4 renders an error output as stderr text (data-mime-type application/vnd.jupyter.stderr)
            # holding the traceback; no class of its own marks it
            outputs = page.locator(f"{PANEL} .jp-OutputArea-output").all_inner_texts()
            errors = [t[:2000] for t in outputs if ERROR.search(t)]
            assert errors == [], errors

            image = page.locator(f"{PANEL} .widget-image")
            assert image.count() == 1, "step 1's explorer shows one plot"
            # the explorer's cell at the top of the view: its code, the slider, the plot and its caption
            page.locator(f"{PANEL} .jp-CodeCell:has(.widget-image)").evaluate(
                "cell => cell.scrollIntoView({block: 'start'})")
            first = image.get_attribute("src")
            caption = page.locator(f"{PANEL} .widget-html-content", has_text="steps kept")
            assert caption.count() == 1 and "4 steps kept" in caption.inner_text()
            page.screenshot(path=str(shots / "lab_01_baseline_before.png"), full_page=True)

            handle = page.locator(f"{PANEL} .widget-slider .noUi-handle")  # ipywidgets 8: noUiSlider's handle
            assert handle.count() == 1, "the explorer's 'discard more' slider"
            assert page.locator(f"{PANEL} .widget-readout").first.inner_text().strip() == "0"
            handle.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function("([sel, src]) => document.querySelector(sel).getAttribute('src') !== src",
                                   arg=[f"{PANEL} .widget-image", first], timeout=left_ms(60))
            assert page.locator(f"{PANEL} .widget-readout").first.inner_text().strip() == "1"
            page.wait_for_function("(sel) => document.querySelector(sel).textContent.includes('3 steps kept')",
                                   arg=f"{PANEL} .widget-image ~ .widget-html .widget-html-content",
                                   timeout=left_ms(30))
            page.screenshot(path=str(shots / "lab_01_baseline_after.png"), full_page=True)

            page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()  # File > Save Notebook
            page.locator("li[data-command='docmanager:save']").click()
            while not ran(folder / notebook):  # on disk, in the lab's copy
                assert time.monotonic() < deadline, "JupyterLab did not save the notebook"
                page.wait_for_timeout(300)  # not time.sleep: the page's requests pass through page.route here
        except Exception:
            page.screenshot(path=str(shots / "lab_failure.png"), full_page=True)  # what the page showed
            print(f"screenshot of the failure: {shots / 'lab_failure.png'}")
            raise
        finally:
            browser.close()
        assert console == [], console
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]

    saved = json.loads((folder / notebook).read_text())  # JupyterLab saved into the lab, with the outputs
    assert not [o for c in saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]
                if o["output_type"] == "error"]
    result = json.loads((out / "tiny" / STEPS[0].folder / "result.json").read_text())
    assert result["metrics"]["mfu"]["value"] > 0
    assert digests() == before  # the committed notebooks untouched: the lab's copy was the one run
    for name in ("before", "after"):
        shot = shots / f"lab_01_baseline_{name}.png"
        assert shot.stat().st_size > 20_000, shot
        print(f"screenshot ({name} the slider move): {shot}")
