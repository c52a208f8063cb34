"""The index's first screen (what fits 1280 x 800 above the fold): the job's MFU with its peak, its label and
whether the machine was shared; where the rest of the peak went, step 1's ledger as one bar; and the first thing
to change, the recommendation with the largest estimated gain (:mod:`mfu_lab.report.gains`), with its evidence.

Every figure comes from the steps' results as stored; a part with nothing to show says which step makes it.
Pure functions of the result dicts; the page draws them in ``templates/index_parts.html.j2`` (``first_screen``).
"""

from __future__ import annotations

from typing import Any

from mfu_lab.core.job import overrides as ov
from mfu_lab.core.measure.ledger import LABELS, ORDER, upgrade
from mfu_lab.core.registry import BY_KEY
from mfu_lab.report.format import fmt
from mfu_lab.report.gains import first_change
from mfu_lab.report.summary import shared_how, the_job, verified_text

# One colour per ledger item, the same order as the waterfall: MFU green, recompute and the losses after it.
COLOURS = {"mfu": "#2f9e44", "recompute": "#94d82d", "efficiency": "#f08c00", "structure": "#1971c2",
           "software": "#c2255c", "operations": "#868e96"}
OTHERS_SHOWN = 80  # characters of the overrides that leave the job as it is, beyond which they are only counted
LABEL_INSIDE = 0.07  # a segment at least this wide carries its own label; narrower ones only in the legend


def _metric(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    m = ((result.get("metrics") or {}).get(name)) or {}
    v = m.get("value")
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    return {"value": v, "text": fmt(v, str(m.get("unit") or "")), "source": str(m.get("source") or "unlabelled"),
            "note": str(m.get("note") or "")}


def ledger_bar(ledger: dict[str, Any] | None) -> dict[str, Any] | None:
    """Step 1's ledger as one bar: a segment per item with a share above zero, in the ledger's order, and the
    legend with every item (the zero ones said, so nothing looks left out)."""
    if not ledger or not ledger.get("items"):
        return None
    items = {i["name"]: i for i in upgrade(ledger)["items"] if isinstance(i.get("fraction"), int | float)}
    names = [n for n in ORDER if n in items] + [n for n in items if n not in ORDER]
    total = sum(max(0.0, items[n]["fraction"]) for n in names) or 1.0
    segments = []
    for n in names:
        it = items[n]
        f = float(it["fraction"])
        segments.append({"name": n, "label": LABELS.get(n, n), "fraction": f, "text": f"{f:.1%}",
                         "width": max(0.0, f) / total * 100, "colour": COLOURS.get(n, "#adb5bd"),
                         "inside": f >= LABEL_INSIDE, "source": str(it.get("source") or ""),
                         "explanation": str(it.get("explanation") or "")})
    negative = [s for s in segments if s["fraction"] < 0]
    return {"segments": segments, "total": sum(s["fraction"] for s in segments),
            "negative": negative, "losses": sorted((s for s in segments if s["name"] != "mfu" and s["fraction"] > 0),
                                                  key=lambda s: -s["fraction"])}


def _headline_mfu(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Step 1's MFU, its peak and label, the statistic it is, and whether the machine was shared."""
    base = results.get("baseline") or {}
    mfu = _metric(base, "mfu")
    if mfu is None:
        return None
    peak = _metric(base, "peak_flops_per_s")
    job, env = base.get("job") or {}, base.get("environment") or {}
    lay = base.get("layout") or {}
    where = (f"in its layout {lay['layout']['name']} on {lay.get('world')} ranks"
             if (lay.get("layout") or {}).get("name") else "one process")
    statistic = ("model FLOPs of the measured steps / (peak x their total wall time)"
                 if "total wall time" in mfu["note"] else mfu["note"].split(";")[0])
    c = (base.get("timings") or {}).get("contention") or {}
    how, quiet = shared_how(base), ""
    shared = "" if how is None else "; ".join(how) or "other processes ran while step 1 measured"
    if how is None and c.get("sampled") and isinstance(c.get("other_cores"), int | float):
        quiet = (f"the machine was quiet while step 1 measured (other processes kept {c['other_cores']:.2f} of "
                 f"{c.get('usable_cores')} cores busy)")
    device = str(env.get("device_name") or env.get("device_type") or "")
    given = ov.recorded(base)  # the command line's -p: said beside the figures they produced
    changed = ov.workload(given)
    others = ov.flags({k: v for k, v in given.items() if k not in changed})  # sweeps, run lengths, budget
    return {"mfu": mfu, "peak": peak, "quiet": quiet, "dtype": str(job.get("dtype") or ""), "device": device,
            "job": the_job(base), "overrides": ov.flags(changed),
            "others": others if len(others) <= OTHERS_SHOWN else f"{len(given) - len(changed)}, with the steps table",
            "where": where, "statistic": statistic, "shared": shared,
            "tokens": _metric(base, "tokens_per_s") or _metric(base, "samples_per_s"),
            "median": _metric(base, "step_time_median_s"), "padding": _padding(base)}


PADDING_SAID = 0.5  # above this share of positions padding, the first screen says so


def _padding(base: dict[str, Any]) -> str:
    """A line for the first screen when more than half of the measured positions were padding: MFU counts the
    useful tokens only, so most of each batch's work is not in it."""
    m = _metric(base, "padding_share")
    if not m or m["value"] <= PADDING_SAID:
        return ""
    return (f"{m['value']:.0%} of the batches' positions are padding (targets of -100, counted): MFU counts only the "
            "other tokens, so most of each step's work is not model work. Pack the samples (seq_policy: pack) or "
            "check the data's labels")


def first_screen(results: dict[str, dict[str, Any]], recommendations: list[tuple[str, dict[str, Any]]],
                 states: dict[str, str] | None = None) -> dict[str, Any]:
    """What the top of the index shows: ``mfu`` (None before step 1 has a result), ``bar`` (step 1's ledger),
    ``first`` (the first thing to change, with its step and evidence), ``tuned`` (step 7's verified line) and
    ``pending`` (a step 1 that is running or did not finish, as the steps table says)."""
    states = states or {}
    first = first_change(recommendations)
    rec = None
    if first:
        folder, a = first
        g = a.get("gain")
        rec = {"folder": folder, "number": folder[:2].lstrip("0"), "severity": str(a.get("severity") or ""),
               "message": str(a.get("message") or ""), "because": str(a.get("because") or ""),
               "gain": g.text if g else "", "evidence": g.evidence if g else "", "source": g.source if g else "",
               "others": sum(1 for f, b in recommendations if b is not a and b.get("severity") != "info")}
    verify = results.get("verify") or {}
    tuned = verified_text(verify) if (verify.get("headline") or {}).get("speedup") else ""
    status = states.get("baseline", "ok" if "baseline" in results else "not run")
    return {"mfu": _headline_mfu(results), "bar": ledger_bar((results.get("baseline") or {}).get("ledger")),
            "first": rec, "tuned": tuned, "baseline_folder": BY_KEY["baseline"].folder,
            "pending": "" if status in ("ok", "not run") else status}
