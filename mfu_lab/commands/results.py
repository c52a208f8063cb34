"""A job's output folder after its runs: ``mfu-lab report`` (re-export the HTML and the index), ``history`` (its
runs with their MFU), ``compare`` (two runs, metric by metric) and ``check-html`` (its pages in headless Chromium)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mfu_lab.commands.common import EXIT_OK, EXIT_STEP_FAILED
from mfu_lab.core.errors import JobError, JobProblem, MfuLabError
from mfu_lab.core.registry import STEPS
from mfu_lab.core.store import files
from mfu_lab.core.store.files import JOB_MARKER, RESULT_FILE, is_job_root, write_json_atomic
from mfu_lab.core.store.history import compare, mfu_trend, resolve_run, runs
from mfu_lab.core.store.nodes import merge_into
from mfu_lab.core.store.runstate import JobBusy, job_lock, step_state
from mfu_lab.publish import settle_publications
from mfu_lab.report import export_html, fmt, write_index
from mfu_lab.report.browser import check_pages, ensure_chromium, job_pages
from mfu_lab.report.format import compare_text
from mfu_lab.runner import resolve_job


def cmd_report(args) -> int:
    root = Path(args.job_dir)
    if not root.is_dir():
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "no such folder")])
    if not is_job_root(root):
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "holds no mfu-lab results (no "
                                                   f"{JOB_MARKER} marker, no run history, no step result): "
                                                   "mfu-lab report rewrites index.html only in a folder a run "
                                                   "made, e.g. outputs/<job_name>")])
    try:  # a publication a killed run left half done is completed first; a run holding the folder finishes its own
        with job_lock(root, "(mfu-lab report)"):
            settle_publications(root)
    except JobBusy:
        pass
    for info in STEPS:
        nb = root / info.folder / info.notebook
        merged = root / info.folder / RESULT_FILE
        if merged.is_file() and (data := merge_into(merged, 1)) is not None:  # nodes that finished after node 0
            write_json_atomic(merged, data)
            print(f"merged the nodes' results into {merged}: {data['nodes']['text']}")
        if nb.is_file() and (st := step_state(root / info.folder)).status in ("running", "interrupted"):
            print(f"kept {root / info.folder / 'report.html'}: {info.folder} is {st.status} ({st.detail}), so its "
                  "notebook is not a finished one; the published report stands")
            continue
        if nb.is_file():
            try:
                print(f"exported {export_html(nb, root / info.folder / 'report.html')}")
            except files.DamagedFile as e:  # the other steps' reports and the index are still rebuilt
                print(f"warning: {e}; its report.html is left as it was", file=sys.stderr)
    print(f"wrote {write_index(root)}")
    return EXIT_OK


def _job_dir(arg: str | None) -> Path:
    """The job output folder named on the command line, else the default job's."""
    if arg:
        return Path(arg)
    job, _ = resolve_job(None, {}, None, writable=False)
    return job.output_root()


def cmd_history(args) -> int:
    root = _job_dir(args.job_dir)
    if not root.is_dir():  # as `report` says: a typo is not an empty history
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "no such folder")])
    table = runs(root)
    if not table:
        print(f"{root}: no run recorded yet (history.jsonl is written when a step saves its result)")
        return EXIT_OK
    trend = dict(mfu_trend(root, table))
    for rid, steps in table.items():
        first = next(iter(steps.values()))
        mfus = ", ".join(f"{k} {fmt(v, 'fraction')}" for k, v in trend.get(rid, {}).items())
        given = {k: v for line in steps.values() for k, v in (line.get("overrides") or {}).items()}
        over = " ".join(f"-p {k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sorted(given.items()))
        print(f"{rid}  {len(steps)} step(s): {', '.join(steps)}; commit {str(first.get('git_commit'))[:12]}; "
              f"job {first.get('job_digest')}" + (f"; overrides {over}" if over else "; the job as in its file")
              + (f"; MFU {mfus}" if mfus else ""))
    return EXIT_OK


def cmd_compare(args) -> int:
    root = _job_dir(args.job_dir)
    a, b = resolve_run(args.run_a, root), resolve_run(args.run_b, root)
    for run in (a, b):  # a damaged result is left out of the comparison: say which
        damaged: dict = {}
        files.load_results(run.where, damaged)
        for e in damaged.values():
            print(f"warning: {e}; left out of the comparison", file=sys.stderr)
    changes, notes = compare(a, b, args.tolerance)
    print(compare_text(a, b, changes, notes, args.all))
    return EXIT_OK


def cmd_check_html(args) -> int:
    root = _job_dir(args.job_dir)
    pages = job_pages(root)
    if not pages:
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "holds no index.html or step report")])
    try:
        import playwright.sync_api  # noqa: F401 - the browser driver check_pages uses
    except ImportError:
        raise MfuLabError("check-html drives Chromium through Playwright, which is not installed: "
                          "pip install -e '.[test]' (or pip install playwright)") from None
    chromium, why = ensure_chromium(install=False)
    if not chromium:
        raise MfuLabError(f"{why}: install Debian's chromium package (apt-get install chromium)")
    bad = 0
    for c in check_pages(pages, root / "screenshots", chromium):
        bad += not c.ok
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.page}: {c.images} images, {c.height_px} px tall -> {c.screenshot}")
        for p in c.problems():
            print(f"     {p}")
    return EXIT_OK if not bad else EXIT_STEP_FAILED
