""""What this step found": the block a step's exported report opens with (``report.html``, :mod:`.export`).

Built from the step's ``result.json`` beside the executed notebook (``<out>/<job>/<NN_step>/``), never from the
notebook's outputs: the headline figures, each with its unit and label; the recommendation (the step's own
recommendation texts, then its ``act`` advice); and MFU now against step 1's (``../01_baseline/result.json``),
naming the job parameters the two were measured with that differ.

Which parameters count: :data:`mfu_lab.core.job.overrides.WORKLOAD_KEYS`, the keys that define the workload measured
(model and shapes, data, batch, precision, compile, DDP settings; the same rule the index page uses). Bookkeeping
(``job_name``, ``out_dir``, ``keep``), run lengths (``steps``, ``warmup_steps``) and the other steps' sweep settings
are not compared; the device the results were measured on is (``environment.device_name``).

It must never make an export fail: a result of an older format or an unexpected shape gives one sentence instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from markupsafe import Markup

from mfu_lab.core.job import overrides as ov
from mfu_lab.core.job.overrides import WORKLOAD_KEYS
from mfu_lab.core.registry import STEPS, StepInfo
from mfu_lab.core.store.files import RESULT_FILE, DamagedFile, read_json
from mfu_lab.core.store.runstate import step_state
from mfu_lab.report.format import fmt
from mfu_lab.report.gains import estimate, rank
from mfu_lab.report.summary import bar_meaning, peak_dtype, shared_line
from mfu_lab.report.templating import render

TEMPLATE = "found.html.j2"
BASELINE = STEPS[0]  # step 1: the reference every later step's MFU is set against

# The headline figures of each step, in order (those the result has a value for are shown).
KEY_METRICS: dict[str, tuple[str, ...]] = {
    "baseline": ("mfu", "tokens_per_s", "step_time_median_s", "peak_flops_per_s"),
    "attention_comm": ("mfu", "attention_speedup", "ddp_mfu", "exposed_comm_share"),
    "kernels": ("mfu", "matmul_attention_share", "memory_bound_share", "fusion_candidates"),
    "compile": ("mfu", "speedup", "compile_cold_s", "break_even_steps"),
    "fp8": ("precision_speedup", "fp8_flops_share", "chosen_final_gap", "worst_group_snr_db"),
    "placement": ("predicted_mfu", "placement_gpus", "worst_placement_slowdown", "check_error"),
    "verify": ("mfu_before", "mfu_after", "speedup", "final_loss_gap"),
}
NAMES = {
    "mfu": "MFU", "tokens_per_s": "throughput", "step_time_median_s": "step time (median)",
    "peak_flops_per_s": "peak used for MFU", "attention_speedup": "best attention's speedup", "ddp_mfu": "DDP MFU",
    "exposed_comm_share": "exposed communication (DDP)", "matmul_attention_share": "matmuls and attention",
    "memory_bound_share": "memory-bound operations", "fusion_candidates": "fusion candidates",
    "speedup": "speedup", "compile_cold_s": "cold compile", "break_even_steps": "break-even",
    "precision_speedup": "lower precision's speedup", "fp8_flops_share": "linear FLOPs in FP8",
    "chosen_final_gap": "FP8 loss gap", "worst_group_snr_db": "worst group's FP8 SNR",
    "predicted_mfu": "predicted MFU", "placement_gpus": "GPUs to run on", "worst_placement_slowdown":
    "worst placement's slowdown", "check_error": "model's error on step 2's DDP step", "mfu_before": "MFU before",
    "mfu_after": "MFU after", "final_loss_gap": "loss gap, tuned against original",
}
# The step's own recommendation texts (paths into its result), before its "act" advice.
REC_TEXTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "attention_comm": (("recommendation", "attention_text"), ("recommendation", "comm_text")),
    "compile": (("recommendation", "text"),),
    "fp8": (("choice", "text"), ("precision", "choice", "text")),
    "verify": (("headline", "text"),),
}
MAX_RECS = 4
NOT_FINISHED = ("failed", "interrupted", "timeout", "running")


def step_of(notebook: Path) -> StepInfo | None:
    """The step an executed notebook belongs to (by its name, else its folder's), or None (the monitor's, a
    notebook of one's own)."""
    notebook = Path(notebook)
    return next((s for s in STEPS if notebook.stem == s.folder), None) \
        or next((s for s in STEPS if notebook.parent.name == s.folder), None)


def _get(d: Any, *path: str) -> Any:
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _figure(metrics: Any, name: str) -> dict[str, Any] | None:
    """One metric as the template shows it, or None when the result has no usable value for it."""
    m = metrics.get(name) if isinstance(metrics, dict) else None
    if not isinstance(m, dict):
        return None
    value, unit = m.get("value"), str(m.get("unit") or "")
    if isinstance(value, bool) or not isinstance(value, int | float | str) or value == "":
        return None
    return {"name": name, "label": NAMES.get(name, name.replace("_", " ")), "value": value, "unit": unit,
            "text": fmt(value, unit), "source": str(m.get("source") or "unlabelled"), "note": str(m.get("note") or "")}


def _recommendations(key: str, d: dict[str, Any]) -> tuple[list[dict[str, str]], int, list[dict[str, str]]]:
    """(what to do: the step's recommendation texts, then its "act" advice; how many of those are left out; the
    "look" advice, shown when there is nothing to act on)."""
    recs = [{"message": t, "because": ""} for path in REC_TEXTS.get(key, ())
            if isinstance(t := _get(d, *path), str) and t.strip()
            and not (path == ("choice", "text") and d.get("path") == "emulated")]  # FP8 numerics only: not a to-do
    advice = [{"severity": str(a.get("severity") or ""), "message": str(a.get("message") or ""),
               "because": str(a.get("because") or "")}
              for a in (d.get("advice") if isinstance(d.get("advice"), list) else []) if isinstance(a, dict)]
    acts = [a for a in advice if a["severity"] == "act" and a["message"]]
    recs = [r for r in recs if not any(a["message"].endswith(r["message"]) for a in acts)]  # an act item says it
    seen = {r["message"] for r in recs}
    recs += [a for a in acts if a["message"] not in seen]
    look = [a for a in advice if a["severity"] == "look" and a["message"]]
    recs, look = by_gain(key, d, recs), by_gain(key, d, look)
    return recs[:MAX_RECS], max(0, len(recs) - MAX_RECS), look[:MAX_RECS]


def by_gain(key: str, d: dict[str, Any], items: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Items of a step's advice with their estimated gain's text, the largest gain first (as on the index:
    :func:`mfu_lab.report.gains.rank`); those with no figure to estimate from after, in their own order."""
    out = []
    for n, a in enumerate(items):
        g = estimate(key, d, a)
        out.append((rank(n, {**a, "gain": g}), {**a, "gain": g.text if g and g.kind != "none" else "",
                                                   "evidence": g.evidence if g else ""}))
    return [a for _, a in sorted(out, key=lambda x: x[0])]


def job_differences(job: Any, base: Any, env: Any = None, base_env: Any = None) -> list[str]:
    """The workload parameters (and device) two results were measured with that differ: ``key here (step 1: x)``."""
    job, base = job if isinstance(job, dict) else {}, base if isinstance(base, dict) else {}
    out = [f"{k} {job[k]!r} (step 1: {base[k]!r})" for k in WORKLOAD_KEYS
           if k in job and k in base and job[k] != base[k]]
    dev, base_dev = _get(env, "device_name"), _get(base_env, "device_name")
    if dev and base_dev and dev != base_dev:
        out.append(f"device {dev!r} (step 1: {base_dev!r})")
    return out


def _since_step1(info: StepInfo, d: dict[str, Any], folder: Path) -> dict[str, Any]:
    """MFU here against step 1's, the job parameters that differ, and step 1's noise, as the template shows them."""
    if info.key == BASELINE.key:
        return {"text": "This is step 1: the reference every later step's MFU is set against."}
    path = folder.parent / BASELINE.folder / RESULT_FILE
    if not path.is_file():
        return {"text": f"Step 1 has no result beside this step ({BASELINE.folder}/{RESULT_FILE}), so there is no "
                        "MFU to compare with."}
    try:
        base = read_json(path)
    except DamagedFile as e:
        return {"text": f"Step 1's result cannot be read ({e.why}), so there is no MFU to compare with."}
    now, then = _figure(d.get("metrics"), "mfu"), _figure(base.get("metrics"), "mfu")
    out: dict[str, Any] = {"now": now, "then": then, "meaning": bar_meaning(info.key, d),
                           "differs": job_differences(d.get("job"), base.get("job"), d.get("environment"),
                                                      base.get("environment"))}
    if now and then and isinstance(now["value"], int | float) and isinstance(then["value"], int | float) \
            and then["value"] > 0:
        here, there = peak_dtype(d, now["value"]), peak_dtype(base, then["value"])
        tps, base_tps = (_get(x, "metrics", "tokens_per_s", "value") for x in (d, base))
        if here and there and here != there:  # another precision's peak: the MFU ratio is no speed ratio
            speed = (f": tokens/s here are {fmt(tps / base_tps, 'x')} step 1's"
                     if all(isinstance(x, int | float) for x in (tps, base_tps)) and base_tps > 0 else "")
            out["peaks"] = (f"The two MFUs stand on different peaks ({here}'s here, {there}'s in step 1), so a lower "
                            f"MFU is not a slower job{speed}.")
        else:
            out["ratio"] = fmt(now["value"] / then["value"], "x")
    if not now:
        out["text"] = ("This step has no MFU value of its own to set against step 1's"
                       + (f" {then['text']} ({then['source']})." if then else "."))
    m = base.get("metrics") if isinstance(base.get("metrics"), dict) else {}
    med, p10, p90 = (_get(m, k, "value") for k in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s"))
    if all(isinstance(v, int | float) for v in (med, p10, p90)) and med:
        out["noise"] = f"±{(p90 - p10) / 2 / med:.0%}"
    return out


def _context(notebook: Path, info: StepInfo, result: Path | None = None) -> dict[str, Any]:
    folder = Path(notebook).parent
    ctx: dict[str, Any] = {"info": info, "figures": [], "recs": [], "more": 0, "look": [], "since": None,
                           "note": "", "created": "", "nodes": "", "layout": "", "overrides": ""}
    res = Path(result) if result is not None else folder / RESULT_FILE
    # a damaged result.json reads as "damaged" (or as the failure, when one is recorded); a staged one is given
    state = step_state(folder, read_json(res) if result is not None else None)
    # a staged result is the new result of a step that ran to its end, exported while its own running mark is still
    # in place (publish: the mark goes once the set is in place): that run finished, whatever the mark says
    finished_here = result is not None and state.status == "running"
    if state.status in NOT_FINISHED and not finished_here:
        kept = (" The result.json beside it is an earlier run's; its figures are on the job's index page, not here."
                if res.is_file() else "")
        ctx["note"] = (f"This run of step {info.number} did not finish ({state.status}: {state.detail}); the error "
                       f"is shown below, where it happened.{kept}")
        return ctx
    if not res.is_file():
        ctx["note"] = (f"There is no {RESULT_FILE} beside this notebook (the step did not finish, or wrote its result "
                       "elsewhere), so there is nothing to summarise here.")
        return ctx
    try:
        d = read_json(res)
    except DamagedFile as e:
        ctx["note"] = f"This step's {RESULT_FILE} cannot be read ({e.why}), so there is nothing to summarise here."
        return ctx
    if Path(notebook).is_file() and res.stat().st_mtime > Path(notebook).stat().st_mtime + 1.0:
        ctx["note"] = (f"The {RESULT_FILE} beside this notebook is newer than it (made afterwards, by mfu-lab step or "
                       "plain Python), so its figures are not this notebook's and are not summarised here.")
        return ctx
    ctx["figures"] = [f for name in KEY_METRICS.get(info.key, ("mfu",))
                      if (f := _figure(d.get("metrics"), name)) is not None]
    ctx["recs"], ctx["more"], ctx["look"] = _recommendations(info.key, d)
    ctx["since"] = _since_step1(info, d, folder)
    ctx["created"] = str(_get(d, "environment", "created_at") or "")
    ctx["nodes"] = str(_get(d, "nodes", "text") or "")  # a multi-node job: whose figures these are
    ctx["layout"] = " ".join(x for x in (shared_line(d), layout_line(d)) if x)  # the first line of the block
    ctx["overrides"] = ov.pairs(ov.recorded(d))  # the command line's -p, beside the figures they produced
    return ctx


def layout_line(d: dict[str, Any]) -> str:
    """One sentence naming the layout a step ran the job in (steps 1, 3 and 7 under torchrun), '' for one process."""
    lay = d.get("layout") or {}
    name = (lay.get("layout") or {}).get("name")
    if not name:
        return ""
    lc = lay.get("loss_check") or {}
    gap = lc.get("max_rel_gap")
    check = (f"its loss was checked against {lc.get('reference')} first: largest relative gap {gap:.2g}, tolerance "
             f"{lc.get('tolerance'):.0e}" if gap is not None else "its loss was not checked (no reference could run)")
    return (f"The job ran in its own layout, {name}, on {lay.get('world')} ranks over {lay.get('backend')}; "
            f"{check}. Every figure is all ranks' (the slowest rank per step).")


def found_html(notebook: Path, result: Path | None = None) -> Markup:
    """The "What this step found" block for an executed step notebook; empty for a notebook that is no step's
    (the monitor's). Never raises: anything unexpected in the result gives one sentence saying so."""
    info = step_of(notebook)
    if info is None:
        return Markup("")
    try:
        return render(TEMPLATE, **_context(Path(notebook), info, result))
    except Exception as e:  # noqa: BLE001 - an older or unexpected result must not stop the export
        return Markup('<section class="mfu mfu-found"><h2>What this step found</h2><p>{}</p></section>').format(
            f"This step's {RESULT_FILE} could not be summarised ({type(e).__name__}: {e}); its figures are in the "
            "sections below.")
