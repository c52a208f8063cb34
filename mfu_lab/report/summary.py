"""The job's story across steps, for the summary page: where MFU started, what each step found worth
changing and what that change measured, every recommendation in one list, the ledger before and after.

Pure functions of the steps' result dicts (``mfu_lab.core.files.load_results``), so they are tested on stored results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mfu_lab.core.ledger import upgrade
from mfu_lab.core.registry import BY_KEY, STEPS

SEVERITY_ORDER = {"act": 0, "look": 1, "info": 2}


@dataclass
class Change:
    """One change a step measured: what, its gain, the gain's label, and whether the job already has it."""

    step: str  # step folder, e.g. 02_attention_and_comm
    change: str
    gain: float | None  # x (speedup) or fraction, see unit
    unit: str  # "x" | "fraction"
    source: str  # the gain's label: measured | emulated | modelled
    status: str  # adopt | in the job | keep as is | not measured
    how: str  # how the gain was obtained / how to adopt it (job-file fragment)


def _comm_row(rows: list[dict], hook: str, bucket: float, view: bool) -> dict | None:
    return next((r for r in rows if r.get("status") == "ok" and r.get("hook") == hook
                 and r.get("bucket_mb") == bucket and bool(r.get("grad_as_bucket_view")) == view), None)


def changes(results: dict[str, dict[str, Any]]) -> list[Change]:
    """Every change the steps that ran measured, in workbook order."""
    out: list[Change] = []
    if "attention_comm" in results:
        d, folder = results["attention_comm"], BY_KEY["attention_comm"].folder
        rec, m, job = d.get("recommendation", {}), d.get("metrics", {}), d.get("job", {})
        frag = rec.get("job_fragment") or {}
        speed = (m.get("attention_speedup") or {}).get("value")
        if frag:
            have = all(job.get(k) == v for k, v in frag.items())
            out.append(Change(folder, f"attention: {rec.get('attention')}", speed, "x", "measured",
                              "in the job" if have else "adopt",
                              "job file: " + ", ".join(f"{k}: {v}" for k, v in frag.items())
                              + "; step time against the job's own attention, side by side"))
        elif rec.get("attention_text"):
            out.append(Change(folder, "attention: keep the job's own", speed, "x", "measured", "keep as is",
                              rec["attention_text"]))
        comm = rec.get("comm")
        if comm:
            rows = d.get("comm", [])
            chosen = _comm_row(rows, comm.get("hook"), comm.get("bucket_cap_mb"),
                               comm.get("gradient_as_bucket_view", False))
            default = _comm_row(rows, "none", 25, False)
            gain = (default["step_median_s"] / chosen["step_median_s"] if chosen and default
                    and chosen.get("step_median_s") else None)
            is_default = (comm.get("hook"), comm.get("bucket_cap_mb"), bool(comm.get("gradient_as_bucket_view"))) \
                == ("none", 25, False)
            out.append(Change(folder, f"DDP: hook {comm.get('hook')}, bucket_cap_mb {comm.get('bucket_cap_mb')}, "
                              f"gradient_as_bucket_view {comm.get('gradient_as_bucket_view')}", gain, "x", "measured",
                              "keep as is" if is_default else "adopt",
                              "DDP step time of DDP's defaults / this configuration's, in one launch; "
                              + rec.get("comm_text", "")))
    if "compile" in results:
        d, folder = results["compile"], BY_KEY["compile"].folder
        rec, m = d.get("recommendation", {}), d.get("metrics", {})
        sp = (m.get("speedup") or {}).get("value")
        if rec.get("compile"):
            out.append(Change(folder, f"torch.compile, mode {rec.get('mode')}", sp, "x", "measured", "adopt",
                              rec.get("text", "")))
        else:
            out.append(Change(folder, "torch.compile: stay eager", sp, "x", "measured", "keep as is",
                              rec.get("text", "")))
    if "fp8" in results:
        d, folder = results["fp8"], BY_KEY["fp8"].folder
        ch, sp, job = d.get("choice") or {}, d.get("speed") or {}, d.get("job", {})
        if ch.get("groups"):
            have = sorted(job.get("fp8_layers") or []) == sorted(ch["groups"])
            if sp.get("status") == "ok" and sp.get("speedup"):
                out.append(Change(folder, f"FP8: {ch.get('policy')} ({ch.get('recipe')})", sp["speedup"], "x",
                                  "measured", "in the job" if have else "adopt",
                                  "bf16 step / fp8 step, both compiled (torchao); " + ch.get("fragment", "")))
            else:
                out.append(Change(folder, f"FP8: {ch.get('policy')} ({ch.get('recipe')})", ch.get("flops_share"),
                                  "fraction", "emulated", "in the job" if have else "adopt",
                                  "share of linear-layer FLOPs in FP8, loss kept in emulation; no speed measured ("
                                  + (sp.get("reason") or "no FP8 hardware") + "); " + ch.get("fragment", "")))
        else:
            out.append(Change(folder, "FP8: no policy kept the loss", None, "fraction", "emulated", "keep as is",
                              ch.get("text", "")))
    if "placement" in results:
        d, folder = results["placement"], BY_KEY["placement"].folder
        c, strategies = d.get("chosen"), d.get("strategies", [])
        if c:
            worst = max((s.get("vs_aware") or 1.0 for s in strategies if s.get("status") == "ok"), default=None)
            n = len(c.get("gpus") or [])
            out.append(Change(folder, f"placement: {n} GPUs as {c.get('label', '')}, topology-aware, "
                              f"predicted MFU {c.get('mfu', 0):.1%}",
                              worst, "x", "modelled", "adopt",
                              "predicted step time of the worst other placement / topology-aware's, on "
                              f"{d.get('cluster', {}).get('name', 'the cluster file')}; see the Slurm / Kueue hints"))
    return out


def recommendations(results: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """Every step's advice as (step folder, advice), the ones to act on first, then in workbook order."""
    items = [(info.folder, a) for info in STEPS for a in results.get(info.key, {}).get("advice", [])]
    return sorted(items, key=lambda x: SEVERITY_ORDER.get(x[1].get("severity"), 3))


# What each step's MFU bar measures (the summary chart's x labels and legend).
BAR_MEANING = {"baseline": "the job as it came, one process, eager",
               "attention_comm": "recommended attention, one process, eager",
               "kernels": "unprofiled steps, one process, eager",
               "compile": "recommended mode (or eager), one process",
               "verify": "the tuned job, one process, side by side with the original"}


def bar_meaning(key: str, result: dict[str, Any]) -> str:
    """What a step's MFU bar measures: :data:`BAR_MEANING`, or for a job run in its own layout (steps 1, 3 and
    7 under torchrun) the layout and its ranks."""
    lay = (result or {}).get("layout") or {}
    name = (lay.get("layout") or {}).get("name")
    if name and key in ("baseline", "kernels"):
        return f"the job in its layout {name}, {lay.get('world')} ranks, slowest rank per step"
    if key == "verify" and any("in the job's layout" in (r.get("reason") or "") for r in result.get("rungs") or []):
        return "the tuned job in its layout, side by side with the original"
    return BAR_MEANING.get(key, "as the step measured it")


def mfu_points(results: dict[str, dict[str, Any]]) -> list[tuple[str, float, str]]:
    """(step folder, MFU, its label) for every step that reports one, in workbook order; step 2's data-parallel
    MFU is a point of its own (folder ``02_…/DDP``), since it is a different measurement (N ranks)."""
    out = []
    for info in STEPS:
        metrics = results.get(info.key, {}).get("metrics", {})
        m = metrics.get("mfu")
        if m and m.get("value") is not None:
            out.append((info.folder, m["value"], m.get("source", "")))
        ddp = metrics.get("ddp_mfu")
        if ddp and ddp.get("value") is not None:
            out.append((info.folder + "/DDP", ddp["value"], ddp.get("source", "")))
    return out


def _peak_dtype(result: dict[str, Any], mfu: float) -> str:
    """The precision whose peak an MFU is against: the job's, or for step 7 the rung that gave it."""
    rung = next((r for r in result.get("rungs") or [] if r.get("mfu") == mfu and r.get("dtype")), None)
    return rung["dtype"] if rung else (result.get("job") or {}).get("dtype", "")


def bar_meanings(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each bar's meaning, in the order of :func:`mfu_points`: one process or data-parallel, eager or compiled,
    measured or modelled; and, when the bars stand on different precisions' peaks, which peak each is against."""
    out, peaks = [], []
    for folder, value, source in mfu_points(results):
        key = next(i.key for i in STEPS if folder.startswith(i.folder))
        peaks.append(_peak_dtype(results[key], value))
        if folder.endswith("/DDP"):
            world = (results[key].get("comm_layout") or {}).get("world_size")
            out.append(f"data-parallel, {world} ranks, recommended DDP configuration ({source})")
        else:
            out.append(f"{bar_meaning(key, results[key])} ({source})")
    if len(set(peaks)) > 1:  # an MFU against another peak is not comparable by height: say which
        out = [f"{m}, against the {p} peak" for m, p in zip(out, peaks)]
    return out


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """A few plain sentences: what was done and where MFU stands (each figure as stored, with its label)."""
    if not results:
        return ["No step has run yet: run `mfu-lab run` or open notebooks/01_baseline.ipynb."]
    ran = [info for info in STEPS if info.key in results]
    lines = [f"{len(ran)} of {len(STEPS)} steps have results: " + ", ".join(i.folder for i in ran) + "."]
    verified = (results.get("verify") or {}).get("headline") or {}
    if verified.get("text"):
        carried = ", ".join(verified.get("carried") or []) or "none beyond the noise"
        lines.insert(0, f"Verified: {verified['text']}. Changes that carried the gain: {carried} (step 7).")
    pts = mfu_points(results)
    base = results.get("baseline", {}).get("metrics", {}).get("mfu")
    if base and base.get("value") is not None:
        lay = ((results.get("baseline") or {}).get("layout") or {})
        where = (f" in its layout {lay['layout']['name']} on {lay.get('world')} ranks"
                 if (lay.get("layout") or {}).get("name") else "")
        lines.append(f"The job as it came measured {base['value']:.1%} MFU{where} (step 1, {base['source']}).")
    later = [p for p in pts if p[0] != BY_KEY["baseline"].folder]
    if later:
        text = "Later steps measured MFU " + ", ".join(
            f"{v:.1%} ({folder[:2]}{', data-parallel' if folder.endswith('/DDP') else ''})" for folder, v, _ in later)
        m = results.get("baseline", {}).get("metrics", {})
        med, p10, p90 = (m.get(k, {}).get("value") for k in ("step_time_median_s", "step_time_p10_s",
                                                              "step_time_p90_s"))
        if med and p10 is not None and p90 is not None:
            text += (f"; step 1's step times spread ±{(p90 - p10) / 2 / med:.0%} (p10-p90), so differences within that "
                     "are run-to-run noise, not gains: the gains are in Changes measured, each timed side by side")
        lines.append(text + ".")
    tuned = (results.get("verify") or {}).get("changes")
    to_adopt = [] if tuned is not None else [c for c in changes(results) if c.status == "adopt"]
    if tuned is not None:
        adopted = [c for c in tuned if c.get("adopted")]
        lines.append(f"tuned.yaml adopts {len(adopted)} of {len(tuned)} recommended change(s)"
                     + (": " + "; ".join(f"{c['key']}: {c['new']} ({c['rung']}, {c['label']})" for c in adopted)
                        if adopted else "") + " (step 7).")
    if to_adopt:
        lines.append(f"{len(to_adopt)} change(s) to adopt: "
                     + "; ".join(f"{c.change} [{c.source}]" for c in to_adopt) + ".")
    missing = [i.folder for i in STEPS if i.key not in results]
    if missing:
        lines.append("Not run yet: " + ", ".join(missing) + ".")
    return lines


def ledger_before_after(results: dict[str, dict[str, Any]]) -> tuple[tuple[str, dict] | None, tuple[str, dict] | None]:
    """(title, ledger dict) before and after. Both come from step 7 (verify) when it measured the tuned job: the
    original and the tuned job in the same interleaved rounds, by the same method, so the bars compare like
    with like. Without step 7: step 1's ledger before, and no "after" (no step measured the tuned job). An earlier
    run's item names are mapped to today's (:func:`mfu_lab.core.ledger.upgrade`)."""
    ledgers = (results.get("verify") or {}).get("ledgers") or {}
    if ledgers.get("before") and ledgers.get("after"):
        return (("Before: the original job (step 7, interleaved rounds)", upgrade(ledgers["before"])),
                ("After: the tuned job (step 7, the same rounds)", upgrade(ledgers["after"])))
    b = results.get("baseline", {}).get("ledger")
    return (("Before: the job as it came (step 1, one process)", upgrade(b)) if b else None), None


def with_operations(ledger: dict[str, Any], ops: float, note: str) -> dict[str, Any]:
    """A step's ledger with the operations loss the production monitor measured: every other bar x (1 - ops),
    and the operations bar = its own (scaled) + ops, so the parts still add up to 100% of peak x wall-clock.
    MFU becomes the step's MFU over the production wall-clock (queue, restarts, stragglers, throttling)."""
    items = []
    for it in ledger["items"]:
        it = dict(it)
        if it["name"] == "operations":
            it["fraction"] = it["fraction"] * (1 - ops) + ops
            it["source"] = "measured"
            it["explanation"] = f"measured in production by the monitor: {note}"
        else:
            it["fraction"] *= 1 - ops
            it["explanation"] += f" (x (1 - {ops:.1%}): the production operations loss)"
        items.append(it)
    return {**ledger, "items": items}
