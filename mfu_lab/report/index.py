"""A job's index page (``<job_root>/index.html``): its first screen (MFU with its peak, the ledger as one bar, the
first thing to change: :mod:`.first_screen`), every step's status and headline figures, the job's story
across steps (MFU progression, ledger before and after, changes measured, every recommendation, its runs),
the environment, then each step's section in detail.

It opens with no network: CSS inline, plots as PNG data URIs. Every value from results or job files is escaped
by the templates (``templates/job_index.html.j2``, ``templates/index_parts.html.j2``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from markupsafe import Markup, escape

from mfu_lab import plots
from mfu_lab.core.job import overrides as ov
from mfu_lab.core.job.overrides import WORKLOAD_KEYS
from mfu_lab.core.job.schema import find_workbook_root
from mfu_lab.core.measure.ledger import Ledger, LedgerItem
from mfu_lab.core.registry import BY_KEY, STEPS, StepInfo
from mfu_lab.core.store.files import RESULT_FILE, load_results, write_atomic
from mfu_lab.core.store.history import mfu_trend, runs
from mfu_lab.core.store.runstate import step_state
from mfu_lab.report.first_screen import first_screen
from mfu_lab.report.monitor_views import monitor_section
from mfu_lab.report.summary import (
    bar_meanings,
    changes,
    headline,
    ledger_before_after,
    mfu_points,
    peaks_note,
    recommendations,
    shared_line,
    with_operations,
)
from mfu_lab.report.tables.attention_comm import attention_comm_section
from mfu_lab.report.tables.baseline import baseline_section
from mfu_lab.report.tables.compile import compile_section
from mfu_lab.report.tables.fp8 import fp8_section
from mfu_lab.report.tables.kernels import kernels_section
from mfu_lab.report.tables.placement import placement_section
from mfu_lab.report.tables.verify import verify_section
from mfu_lab.report.templating import macros, render
from mfu_lab.steps import monitor
from mfu_lab.steps.verify.step import VerifyResult

PARTS = "index_parts.html.j2"
MONITOR_FOLDER = "00_monitor"  # mfu-lab run writes the monitor's report here when the job names monitor_dir
RUNS_LISTED = 20

# Each step's detailed section, in workbook order.
SECTIONS: dict[str, Callable[[dict[str, Any]], Markup]] = {
    "baseline": baseline_section, "attention_comm": attention_comm_section, "kernels": kernels_section,
    "compile": compile_section, "fp8": fp8_section, "placement": placement_section,
    "verify": verify_section}

STATUS_CSS = {"ok": "ok", "not run": "notrun", "running": "info"}


def _older(path: Path, than: Path) -> bool:
    """Whether ``path`` was written before ``than`` (a second of slack for coarse file systems)."""
    return path.is_file() and than.is_file() and path.stat().st_mtime < than.stat().st_mtime - 1.0


def _common_overrides(rows: list[dict[str, Any]], results: dict) -> str:
    """The command line's overrides when every step with a result measured with the same ones (one run's, as a
    rule): said once above the steps' table and taken off its rows, else '' and each row names its own."""
    told = {row["overrides"] for info, row in zip(STEPS, rows, strict=True) if info.key in results}
    if len(told) != 1 or not (common := told.pop()):
        return ""
    for row in rows:
        row["overrides"] = ""
    return common


def _step_row(job_root: Path, info: StepInfo, result: dict | None) -> dict[str, Any]:
    """One row of the steps' table: status, headline metrics and links to the step's files that exist. The
    executed notebook is written after the result it made is saved, and its report after it: a notebook older than
    the result (the step then ran in plain Python, ``mfu-lab step``) or a report older than its notebook
    (papermill without ``mfu-lab report``) belongs to an earlier run, so it is not linked, and the row says so."""
    folder = job_root / info.folder
    res, nb, html = folder / RESULT_FILE, folder / info.notebook, folder / "report.html"
    st = step_state(folder, result)
    stale = ""
    if st.status == "ok" and _older(nb, res):
        stale = ("this result was made without a notebook (mfu-lab step or plain Python): the notebook and report "
                 "here are an earlier run's, so they are not linked; mfu-lab run makes a report of this result")
    elif st.status == "ok" and _older(html, nb):
        stale = f"report.html is older than the executed notebook: mfu-lab report {job_root} exports it again"
    skip = {info.notebook, "report.html"} if stale.startswith("this result") else {"report.html"} if stale else set()
    links = [(info.folder, name, label)
             for name, label in (("report.html", "report"), (info.notebook, "notebook"), (RESULT_FILE, "result.json"),
                                 ("trace.json.gz", "trace"))
             if (folder / name).exists() and name not in skip]
    return {"number": info.number, "title": info.title, "status": st.status,
            "detail": "; ".join(x for x in (st.detail, stale) if x),
            "css": STATUS_CSS.get(st.status, "failed"), "metrics": (result or {}).get("metrics", {}), "links": links,
            "nodes": ((result or {}).get("nodes") or {}).get("text", ""),
            "shared": bool(result and shared_line(result)), "overrides": ov.flags(ov.recorded(result))}





def job_differences(results: dict[str, dict]) -> list[str]:
    """One sentence per difference from step 1 (or the first step that ran) in the workload parameters: the keys
    that differ and their two values, with every step measured so (five steps that all differ in one key are one
    sentence, not five)."""
    ran = [(info, results[info.key]) for info in STEPS if info.key in results and info.key != "verify"]
    if len(ran) < 2:
        return []
    (first, ref), by_diff = ran[0], {}
    base = ref.get("job") or {}
    for info, d in ran[1:]:
        job = d.get("job") or {}
        diff = ", ".join(f"{k} {job.get(k)!r} (step {first.number}: {base.get(k)!r})" for k in WORKLOAD_KEYS
                         if k in job and k in base and job[k] != base[k])
        if diff:
            by_diff.setdefault(diff, []).append(str(info.number))
    out = []
    for diff, numbers in by_diff.items():
        steps = (f"Step {numbers[0]} was" if len(numbers) == 1 else
                 f"Steps {', '.join(numbers[:-1])} and {numbers[-1]} were")
        them = "Its comparisons" if len(numbers) == 1 else "Their comparisons"
        out.append(f"{steps} measured with other job parameters than step {first.number}: {diff}. {them} with step "
                   f"{first.number} are not like for like; rerun with the same parameters.")
    return out


def _ledger_obj(d: dict) -> Ledger:
    return Ledger([LedgerItem(**i) for i in d["items"]])


def changes_table(results: dict[str, dict]) -> Markup:
    """Every change a step measured, its gain and whether the job has it (:func:`summary.changes`)."""
    return macros(PARTS).changes_table(changes(results))


def recommendations_list(results: dict[str, dict], items: list[tuple[str, dict]] | None = None) -> Markup:
    """Every step's advice in one list, the largest estimated gain first (:func:`summary.recommendations`)."""
    return macros(PARTS).recommendations_list(recommendations(results) if items is None else items)


def first_screen_html(results: dict[str, dict], items: list[tuple[str, dict]], states: dict[str, str]) -> Markup:
    """The page's first screen: MFU with its peak, the ledger as one bar, the first thing to change."""
    return macros(PARTS).first_screen(first_screen(results, items, states))


def environment_html(results: dict[str, dict]) -> Markup:
    """The environment of the latest step to run, and step 1's device health (NVML)."""
    latest = max(results.values(), key=lambda d: d.get("environment", {}).get("created_at") or "", default=None)
    env = latest["environment"] if latest else {}
    return macros(PARTS).environment_html(env, results.get("baseline", {}).get("health"), bool(results))


def history_html(job_root: Path) -> Markup:
    """The job's MFU across runs (a trend once two runs exist) and its runs, newest first."""
    table = runs(job_root)
    trend = mfu_trend(job_root, table) if table else []
    by_run = dict(trend)
    rows = []
    for rid, steps in list(table.items())[::-1][:RUNS_LISTED]:
        first = next(iter(steps.values()))
        rows.append({"id": rid, "is_dir": (job_root / "runs" / rid).is_dir(), "steps": list(steps),
                     "mfus": ", ".join(f"{k[:2]}: {v:.1%}" for k, v in by_run.get(rid, {}).items()),
                     "digest": str(first.get("job_digest")), "commit": str(first.get("git_commit")),
                     "overrides": ov.flags(first.get("overrides") if isinstance(first.get("overrides"), dict) else {})})
    uri = _drawn_once("trend", trend, lambda: plots.to_data_uri(plots.mfu_trend(trend))) if trend else None
    more = len(table) - RUNS_LISTED if len(table) > RUNS_LISTED else 0
    return macros(PARTS).history_html(rows, more, str(job_root), uri)


# A run rewrites the index before and after every step, and the page's plots take most of its time (a full run's
# top figures 1.5 s a write here): a part whose inputs have not changed is drawn once per process.
T = TypeVar("T")
_DRAWN: dict[tuple[str, str], Any] = {}  # (part, digest of its inputs) -> what it drew


def _drawn_once(part: str, inputs: Any, draw: Callable[[], T]) -> T:
    """``draw()``, or what it returned for the same ``inputs`` (JSON-digested) earlier in this process."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    if (part, digest) not in _DRAWN:
        if len(_DRAWN) > 64:
            _DRAWN.clear()
        _DRAWN[part, digest] = draw()
    return _DRAWN[part, digest]


def _section(key: str, d: dict[str, Any]) -> Markup:
    """One step's detailed section; a result this version cannot read (an older or damaged file) is named,
    not allowed to take the whole page down (and drawn again the next time, not kept)."""
    try:
        return _drawn_once("section:" + key, d, lambda: SECTIONS[key](d))
    except Exception as exc:  # noqa: BLE001 - any shape problem in a stored result
        return macros(PARTS).unreadable_section(BY_KEY[key].number, key, type(exc).__name__, str(exc))


def monitor_summary(job_root: Path, results: dict[str, dict]) -> tuple[dict | None, str | None, str]:
    """The production monitor's summary for this job: ``<job_root>/00_monitor/summary.json`` (written by
    ``mfu-lab run`` when the job names ``monitor_dir``), else the one in the job's monitor folder. Returns
    (summary, link to its report relative to the index, the folder named or "")."""
    named = next((str((d.get("job") or {}).get("monitor_dir") or "") for d in results.values()
                  if (d.get("job") or {}).get("monitor_dir")), "")
    own = job_root / MONITOR_FOLDER
    candidates = [own]
    if named:
        p = Path(named).expanduser()
        candidates.append(p if p.is_absolute() else find_workbook_root() / p)
    for folder in candidates:
        try:
            d = monitor.load(folder)
        except Exception:  # noqa: BLE001 - a damaged summary is left out, said below
            d = None
        if d:
            report = folder / "report.html"
            link = os.path.relpath(report, job_root) if report.is_file() else None
            return d, link, named
    return None, None, named


def _ledgers(results: dict[str, dict], mon: dict | None = None) -> dict[str, Any]:
    """The ledger before (step 1) and after (step 7), as one plot, or what is missing; with the operations loss
    the production monitor measured, when there is one."""
    before, after = ledger_before_after(results)
    ops = ((mon or {}).get("operations_loss") or {}).get("total") or {}
    note = ""
    if ops.get("value") is not None:
        note = f"{ops['value']:.1%} of the wall-clock ({ops['note']})"
        before = before and (before[0] + " + operations loss in production", with_operations(before[1],
                                                                                         ops["value"], note))
        after = after and (after[0] + " + operations loss in production", with_operations(after[1],
                                                                                      ops["value"], note))
    said = note if ops.get("value") is not None else None
    return _drawn_once("ledgers", (before, after, said), lambda: _ledger_figure(before, after, said))


def _ledger_figure(before, after, said: str | None) -> dict[str, Any]:
    if before and after:
        fig = plots.ledger_before_after(_ledger_obj(before[1]), _ledger_obj(after[1]), (before[0], after[0]))
        return {"kind": "both", "uri": plots.to_data_uri(fig), "ops": said}
    if before:
        return {"kind": "before", "uri": plots.to_data_uri(plots.ledger_waterfall(_ledger_obj(before[1]), before[0])),
                "ops": said}
    return {"kind": "none", "uri": None, "ops": said}


def _staircase_uri(results: dict[str, dict]) -> str | None:
    """Step 7's staircase chart for the top of the page, when step 7 measured one."""
    d = results.get("verify")
    if not d:
        return None
    try:
        return _drawn_once("staircase", d, lambda: _staircase_of(d))
    except Exception:  # noqa: BLE001 - an unreadable result is named in its own section below
        return None


def _staircase_of(d: dict[str, Any]) -> str | None:
    fig = plots.staircase(VerifyResult.from_dict(d))
    return plots.to_data_uri(fig) if fig else None


def _monitor_html(mon: dict | None, link: str | None, named: str) -> Markup | None:
    if mon:
        try:
            return _drawn_once("monitor", (mon, link), lambda: monitor_section(mon, link))
        except Exception as exc:  # noqa: BLE001 - an older or damaged summary
            return Markup(f"<p>The monitor's summary could not be read ({escape(type(exc).__name__)}: "
                          f"{escape(str(exc))}): rerun mfu-lab monitor report {escape(named)}</p>")
    if named:
        return Markup(f"<p>The job names the monitor folder <code>{escape(named)}</code>, but no summary of it "
                      f"exists yet: <code>mfu-lab monitor report {escape(named)}</code> (or <code>mfu-lab run</code>)"
                      " writes one.</p>")
    return None


def _progression_uri(points, meanings) -> str:
    return _drawn_once("progression", (points, meanings),
                       lambda: plots.to_data_uri(plots.mfu_progression(points, meanings)))


def write_index(job_root: Path) -> Path:
    """(Re)write ``<job_root>/index.html`` from whatever step results exist."""
    job_root = Path(job_root)
    results = load_results(job_root)
    mon, link, named = monitor_summary(job_root, results)
    points = mfu_points(results)
    any_result = next(iter(results.values()), None)
    rows = [_step_row(job_root, info, results.get(info.key)) for info in STEPS]
    table_overrides = _common_overrides(rows, results)
    states = {info.key: row["status"] for info, row in zip(STEPS, rows, strict=True)}  # the summary says as the table
    recs = recommendations(results)
    page = render(
        "job_index.html.j2", name=job_root.name, env=any_result["environment"] if any_result else {},
        top=first_screen_html(results, recs, states),
        summary=headline(results, states) + job_differences(results), staircase_uri=_staircase_uri(results),
        progression_uri=_progression_uri(points, bar_meanings(results)) if points else None,
        peaks_note=peaks_note(results),
        rows=rows, table_overrides=table_overrides,
        ledgers=_ledgers(results, mon), monitor=_monitor_html(mon, link, named), changes=changes_table(results),
        recommendations=recommendations_list(results, recs),
        history=history_html(job_root), environment=environment_html(results),
        sections=[_section(k, results[k]) for k in SECTIONS if k in results],
        toc=[info.number for info in STEPS if info.key in SECTIONS and info.key in results])
    return write_atomic(job_root / "index.html", page)
