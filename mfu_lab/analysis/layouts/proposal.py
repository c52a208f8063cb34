"""A layout change for the tuned job: what step 6 (layouts measured on this node) or step 2 (an FSDP2 candidate)
found faster beyond the noise than the job's own layout, as job keys with their evidence.

Step 6's result holds ``layouts``: one entry per layout measured here, ``{layout, status, terms: [{term, model,
observed, ratio, source}]}``, named ``ddp2``, ``fsdp2``, ``fsdp2-noreshard``, ``tp2``, ``tp2-sp``, ``pp2-gpipe-m4``,
``pp2-interleaved_1f1b-v2-m4``, ``tp2-fsdp4``...; its term ``step_time_s`` (source ``measured``) is the layout's
step time. A layout is proposed when it ran (``status`` ok: it fits here), its name reads as job keys, and its step
time is below the job's own layout's beyond the noise: its p90 below the reference's p10 where the entry records a
spread (``p10``/``p90`` on the term, ``step_p10_s``/``step_p90_s`` on the entry, or the timed steps ``wall_s``),
else at least :data:`mfu_lab.core.thresholds.RACE_NOISE_FLOOR` faster (the race's noise band), said so.

Step 7 verifies the proposal side by side under torchrun against the original job (steps.verify.layout).
"""

from __future__ import annotations

import re
from typing import Any

from mfu_lab.analysis.racing import beyond_noise
from mfu_lab.core.measure.timed import stats
from mfu_lab.core.thresholds import RACE_NOISE_FLOOR

# every key a layout name sets, with the value a name that does not mention it means
LAYOUT_DEFAULTS: dict[str, Any] = {"dp_mode": "ddp", "fsdp_reshard_after_forward": True, "tp": 1, "sp": False,
                                   "pp": 1, "pp_schedule": "1f1b", "pp_microbatches": 4, "pp_virtual_stages": 1}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
STEP_TERM = "step_time_s"


def layout_keys(name: str) -> dict[str, Any] | None:
    """The job keys of a layout name (``tp2-fsdp4``, ``pp2-interleaved_1f1b-v2-m4``), every layout key present;
    None when a part of the name is not understood (such a layout is never proposed)."""
    keys = dict(LAYOUT_DEFAULTS)
    for part in name.lower().split("-"):
        m = re.fullmatch(r"(ddp|fsdp|tp|pp|v|m)(\d+)", part)
        if m and m.group(1) in ("ddp", "fsdp"):
            keys["dp_mode"] = m.group(1)
        elif m and m.group(1) in ("tp", "pp"):
            keys[m.group(1)] = int(m.group(2))
        elif m:
            keys["pp_virtual_stages" if m.group(1) == "v" else "pp_microbatches"] = int(m.group(2))
        elif part == "noreshard":
            keys["fsdp_reshard_after_forward"] = False
        elif part == "sp":
            keys["sp"] = True
        elif part in SCHEDULES:
            keys["pp_schedule"] = part
        else:
            return None
    return keys


def _relevant(keys: dict[str, Any]) -> dict[str, Any]:
    """The keys that shape the layout: FSDP's only under FSDP, SP's only under TP, the schedule's only under PP."""
    out = {"dp_mode": keys["dp_mode"], "tp": keys["tp"], "pp": keys["pp"]}
    if keys["dp_mode"] == "fsdp":
        out["fsdp_reshard_after_forward"] = keys["fsdp_reshard_after_forward"]
    if keys["tp"] > 1:
        out["sp"] = keys["sp"]
    if keys["pp"] > 1:
        out |= {k: keys[k] for k in ("pp_schedule", "pp_microbatches", "pp_virtual_stages")}
    return out


def is_own_layout(job: Any, name: str) -> bool:
    """Whether layout ``name`` is how ``job`` trains today."""
    keys = layout_keys(name)
    if keys is None:
        return False
    mine = _relevant({k: getattr(job, k) for k in LAYOUT_DEFAULTS})
    return _relevant(keys) == mine


def step_figures(entry: dict) -> tuple[float, float, float] | None:
    """(median, p10, p90) of a layout's measured step time; p10 = p90 = median when no spread was recorded; None
    when it has no measured step time."""
    term = next((t for t in entry.get("terms") or [] if t.get("term") == STEP_TERM), None)
    if not term or term.get("observed") is None:
        return None
    med = float(term["observed"])
    if entry.get("wall_s"):
        st = stats(entry["wall_s"])
        return med, st.p10, st.p90
    lo = term.get("p10", entry.get("step_p10_s"))
    hi = term.get("p90", entry.get("step_p90_s"))
    return (med, float(lo), float(hi)) if lo is not None and hi is not None else (med, med, med)


def dp_of(name: str, world: int | None) -> int | None:
    """A layout's data-parallel degree on ``world`` ranks: world / (tp x pp); None when unknown."""
    keys = layout_keys(name)
    if keys is None or not world or world % (keys["tp"] * keys["pp"]):
        return None
    return world // (keys["tp"] * keys["pp"])


def faster_layout(job: Any, layouts: list[dict], world: int | None = None) -> dict[str, Any] | None:
    """The layout to propose from step 6's ``layouts`` measured on ``world`` ranks, or None: ``{layout, keys,
    changes, step_s, reference, reference_step_s, speedup, rule}``; ``changes`` holds only the keys that differ
    from the job's.

    Step 6 runs every layout at the job's ``micro_batch`` per data-parallel rank, so a layout of a smaller
    data-parallel degree trains fewer samples a step: layouts are compared per sample (step time / (micro_batch x
    dp)), and the proposal keeps the job's samples per optimizer step by scaling ``micro_batch`` by dp_own /
    dp_new (a layout where that is not a whole number, or not a multiple of its pipeline micro-batches, is not
    proposed). Without ``world`` only layouts of the job's own data-parallel degree (tp x pp) are compared."""
    figures, spread, samples = {}, {}, {}
    own = None
    for e in layouts:
        name, fig = e.get("layout"), step_figures(e)
        if e.get("status") != "ok" or not name or fig is None or layout_keys(name) is None:
            continue
        if own is None and is_own_layout(job, name):
            own = name
        figures[name], spread[name] = fig, fig[1] != fig[2]
    if own is None or len(figures) < 2:
        return None
    own_keys = layout_keys(own)
    for name in list(figures):
        keys = layout_keys(name)
        dp, own_dp = dp_of(name, world), dp_of(own, world)
        if dp is None or own_dp is None:  # world unknown: only the job's own dp degree compares step for step
            dp = own_dp = 1
            if keys["tp"] * keys["pp"] != own_keys["tp"] * own_keys["pp"]:
                del figures[name]
                continue
        mb, rest = divmod(job.micro_batch * own_dp, dp)
        if rest or mb < 1 or (keys["pp"] > 1 and mb % keys["pp_microbatches"]):
            del figures[name]
            continue
        samples[name] = (job.micro_batch * dp, mb)  # samples a step as measured, micro_batch that keeps the job's
        figures[name] = tuple(v / samples[name][0] for v in figures[name])
    if len(figures) < 2 or own not in figures:
        return None
    if all(spread[k] for k in figures):
        pick, rule = beyond_noise(figures, own), "its p90 time per sample below the job's own layout's p10 (measured)"
    else:  # no spread recorded for some layout: the race's noise floor on the medians
        fastest = min(figures, key=lambda k: figures[k][0])
        pick = fastest if figures[fastest][0] < figures[own][0] * (1 - RACE_NOISE_FLOOR) else own
        rule = (f"more than {RACE_NOISE_FLOOR:.0%} faster per sample than the job's own layout (no spread "
                "recorded: the race's noise floor)")
    if pick == own:
        return None
    keys = _relevant(layout_keys(pick)) | {"micro_batch": samples[pick][1]}
    changes = {k: v for k, v in keys.items() if getattr(job, k) != v}
    return {"layout": pick, "keys": keys, "changes": changes, "step_s": figures[pick][0] * samples[pick][0],
            "reference": own, "reference_step_s": figures[own][0] * samples[own][0],
            "per_sample_s": figures[pick][0], "reference_per_sample_s": figures[own][0],
            "speedup": figures[own][0] / figures[pick][0], "rule": rule}
