"""The reports in a real browser: headless Chromium (Debian's package, installed here when absent and
possible), no console error, no failed or off-machine request, every image loaded; screenshots kept.

Screenshots go to ``$MFU_LAB_SCREENSHOTS`` when set, else next to the reports (``<job>/screenshots/``).
"""

import os
from pathlib import Path

import pytest

from mfu_lab.report.browser import check_pages, ensure_chromium, job_pages

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def chromium():
    pytest.importorskip("playwright", reason="playwright is not installed: pip install -e '.[test]'")
    path, why = ensure_chromium(install=True)
    if not path:
        pytest.skip(f"headless Chromium unavailable, browser checks skipped: {why}")
    return path


def test_a_broken_page_is_caught(tmp_path, chromium):
    page = tmp_path / "index.html"
    page.write_text('<html><body><img alt="missing" src="nope.png"><img alt="remote" src="https://example.invalid/x.png">'
                    "<script>console.error('boom'); undefined_function();</script>"
                    '<table style="width:60px"><tr><td style="overflow-wrap:anywhere">communication</td></tr></table>'
                    '<div style="width:2000px">wide</div></body></html>')
    (c,) = check_pages([page], tmp_path / "shots", chromium)
    assert not c.ok
    assert any("boom" in m for m in c.console_errors) and any("undefined_function" in m for m in c.console_errors)
    assert any("nope.png" in u for u in c.failed_requests)
    assert any("example.invalid" in u for u in c.external_requests)
    # the page's own request off the machine never left it: aborted by the checker, not failed by the network
    assert any("example.invalid" in u and "ERR_BLOCKED_BY_CLIENT" in u for u in c.failed_requests), c.failed_requests
    assert set(c.broken_images) == {"missing", "remote"}
    assert c.split_words == ["communication"] and c.wider_px == 2000 - 1280 + 8  # the body's 8 px margin
    assert Path(c.screenshot).stat().st_size > 0


def test_every_report_of_a_full_run_renders_cleanly(full_run, chromium):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    pages = job_pages(job_root)
    assert len(pages) == 9  # the index, the monitor's report (step 0) and seven step reports
    shots = Path(os.environ.get("MFU_LAB_SCREENSHOTS") or job_root / "screenshots")
    checks = check_pages(pages, shots, chromium)
    for c in checks:
        assert c.ok, (c.page, c.problems())
        assert Path(c.screenshot).stat().st_size > 20_000, c.screenshot
    by_name = {Path(c.page).parent.name if Path(c.page).name == "report.html" else "index": c for c in checks}
    # the index: progression, ledger before/after, trend, and each step's own plots
    assert by_name["index"].images >= 12, by_name["index"].images
    for step, least in (("00_monitor", 3), ("01_baseline", 2), ("02_attention_and_comm", 3), ("03_kernels", 3),
                        ("04_compile", 2), ("05_fp8", 3), ("06_placement", 4), ("07_verify", 1)):
        assert by_name[step].images >= least, (step, by_name[step].images)
    print("screenshots:", shots)


def test_the_monitor_report_renders_cleanly(two_ranks, tmp_path, chromium):
    from mfu_lab.runner import monitor_report

    report, _ = monitor_report(two_ranks, tmp_path / "report", quiet=True)
    shots = Path(os.environ.get("MFU_LAB_SCREENSHOTS") or tmp_path / "screenshots")
    (c,) = check_pages([report], shots, chromium)
    assert c.ok, c.problems()
    assert c.images >= 3, c.images  # MFU and shares over time, work per rank, operations loss (no GPU: said why)
    assert Path(c.screenshot).stat().st_size > 20_000
    print("screenshot:", c.screenshot)
