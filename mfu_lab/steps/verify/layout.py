"""The verify step for a job in its own layout (FSDP2, TP, SP, PP): the staircase's rungs run in that layout.

A job that is more than plain DDP is not one process, so its rungs cannot be one process each either. Each rung
(the original, then each adopted change on top of the one below) is a set of job keys; every rung runs in the
job's layout through one torchrun launch of the layout worker (:func:`mfu_lab.workers.layout_launch.run_layouts`),
in :data:`ROUNDS` rounds whose order alternates (A B C, C B A: a steady drift favours no rung), each turn checked
against one process's loss first, then ``warmup_steps`` discarded and ``verify_steps`` timed. A rung's step time
is the slowest rank's per step, pooled over its turns; its MFU is its model FLOPs (counted on the meta device) x
the data-parallel degree x its steps / (the world's peak x their total wall time): one GPU's peak x the world, or on
a CPU the whole CPU's, which the ranks share. The median step stays its own figure (:func:`rung_figures`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mfu_lab.core.engine.work import samples_per_step, token_job
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.timed import stats
from mfu_lab.steps.baseline.layout import meta_flops, on_events, slowest_rank_steps
from mfu_lab.workers.layout_launch import run_layouts

ROUNDS = 2  # each turn rebuilds the layout and checks its loss: far dearer than a single-process round


def rung_figures(rung, model_flops_per_step: float, tokens_per_step: float, samples_per_step: float = 0) -> None:
    """A rung's figures from its timed steps (``rung.wall_s``): the median step and its p10-p90 as their own
    figures; tokens/s and MFU over the total wall time of the measured steps (model FLOPs x steps / (peak x total
    wall)), the one MFU statistic every step uses."""
    st = stats(rung.wall_s)
    n, total = len(rung.wall_s), sum(rung.wall_s)
    rung.step_median_s, rung.step_p10_s, rung.step_p90_s = st.median, st.p10, st.p90
    rung.tokens_per_s = tokens_per_step * n / total if tokens_per_step else None  # 0: not token ids
    rung.samples_per_s = samples_per_step * n / total if samples_per_step else None
    rung.mfu = model_flops_per_step * n / (rung.peak_flops_per_s * total) if rung.peak_flops_per_s else None


def overrides(rung_job: Job, job: Job) -> dict[str, Any]:
    """The keys in which a rung's job differs from the job itself."""
    a, b = rung_job.to_dict(), job.to_dict()
    return {k: v for k, v in a.items() if b.get(k) != v}


def measure_in_layout(job: Job, rungs: list, jobs: list[Job], work: Path, say, device: dev.DeviceInfo,
                      world: int) -> list[list]:
    """Fill every measurable rung from turns in the job's layout; returns the order run ([round, rung])."""
    ok = [(r, j) for r, j in zip(rungs, jobs) if r.status == "ok"]
    if not ok:
        return []
    rounds = max(1, min(job.verify_rounds, ROUNDS))
    plan = [(k, r, j) for k in range(rounds) for r, j in (ok if k % 2 == 0 else ok[::-1])]
    say(f"the job's layout: {len(ok)} rung(s) x {rounds} rounds in one torchrun launch of {world} ranks, each "
        f"turn checked against one process, then {job.verify_steps} timed steps")
    runs = run_layouts(job, device.type, work / "layout", [{"overrides": overrides(j, job)} for _, _, j in plan],
                       progress=on_events(say), steps=job.verify_steps)
    flops = {r.name: meta_flops(dataclasses.replace(j, compile_mode="off"), device.type) for r, j in ok}
    scale = world if device.type == "cuda" else 1  # on a CPU the ranks share the one CPU's peak
    pooled: dict[str, dict[str, list]] = {r.name: {"wall": [], "loss": []} for r, _ in ok}
    for (_, rung, _), run in zip(plan, runs):
        if run.status != "ok":
            rung.status, rung.reason = "failed", f"in its layout {run.layout.get('name')}: {run.status}: {run.reason}"
            continue
        if rung.name == "fp8" and (run.fp8 or {}).get("why_not"):  # as a single process's rung (rungs.py)
            rung.status, rung.reason = "excluded", (f"its ranks trained without FP8 ({run.layout.get('name')}: "
                                                    f"{run.fp8['why_not']}); its time would not be FP8's, so the "
                                                    "rung is not timed")
            continue
        pooled[rung.name]["wall"] += slowest_rank_steps(run)
        pooled[rung.name]["loss"] += list(run.losses)
        dp = run.layout["dp"]
        pooled[rung.name]["dp"] = dp
        pooled[rung.name]["name"] = run.layout["name"]
    for rung, _ in ok:
        p = pooled[rung.name]
        if rung.status != "ok" or not p["wall"]:
            continue
        rung.wall_s, rung.loss = p["wall"], p["loss"]
        rung.data_s = [0.0] * len(rung.wall_s)  # the rank worker times whole optimizer steps
        rung.compute_s = list(rung.wall_s)
        report = flops[rung.name]
        if rung.peak_flops_per_s:
            rung.peak_flops_per_s *= scale
        rung_figures(rung, report.model_flops_per_step * p["dp"],
                     job.tokens_per_step * p["dp"] if token_job(job) else 0, samples_per_step(job) * p["dp"])
        rung.hardware_flops_ratio = report.hardware_flops_per_step / report.model_flops_per_step
        rung.flops_source = report.model_flops_source + " (meta device)"
        where = f"in the job's layout {p['name']} ({world} ranks, slowest rank per step, {len(rung.wall_s)} steps " \
                f"over {rounds} alternating rounds)"
        rung.reason = f"{rung.reason}; {where}" if rung.reason else where
    return [[k, r.name] for k, r, _ in plan]


LAYOUT_TURNS = 3  # a layout change: the original and the proposed layout alternated A B, B A, A B in one launch


def layout_change(job: Job, chosen: list) -> dict[str, Any]:
    """The adopted layout change (the ``layout`` rung of analysis.tuning) as job keys, {} when none."""
    return {c.key: c.new for c in chosen if c.adopted and c.rung == "layout"}


def verify_layout_change(job: Job, device_type: str, chosen: list, work: Path, say) -> dict[str, Any]:
    """A proposed layout (step 6's or step 2's FSDP2 pick) against the job's own, side by side under torchrun: one
    launch of the layout worker, the two alternated for :data:`LAYOUT_TURNS` turns (ABBA), each turn checked against
    one process's loss, then ``warmup_steps`` discarded and ``verify_steps`` timed; the slowest rank's step times
    pooled per side and compared with a bootstrap interval, and the final losses against ``loss_tolerance``."""
    from mfu_lab.core.measure.sidebyside import bootstrap_speedup
    from mfu_lab.workers.launch import world_layout

    keys = layout_change(job, chosen)
    if not keys:
        return {"status": "skipped", "reason": "no layout change was adopted"}
    nnodes, nproc = world_layout(job, device_type)
    if nnodes * nproc < 2:
        return {"status": "skipped", "keys": keys, "reason": f"the job runs {nnodes * nproc} process: a layout needs "
                "2 or more ranks (nproc_per_node: 2+)"}
    turns = max(1, min(job.verify_rounds, LAYOUT_TURNS))
    pair = [{}, keys]
    plan = [pair[i] for t in range(turns) for i in ((0, 1) if t % 2 == 0 else (1, 0))]
    say(f"layout change {keys}: the original and the proposed layout alternated {turns} times in one torchrun launch "
        f"of {nnodes * nproc} ranks")
    runs = run_layouts(job, device_type, work / "layout_change", [{"overrides": o} for o in plan],
                       progress=on_events(say), steps=job.verify_steps)
    side: dict[str, dict[str, list]] = {"original": {"wall": [], "loss": []}, "tuned": {"wall": [], "loss": []}}
    names, order = {}, []
    for o, run in zip(plan, runs):
        who = "tuned" if o else "original"
        order.append(who)
        if run.status != "ok":
            why = f"{who} layout {run.layout.get('name')}: {run.status}: {run.reason}"
            _withdraw(job, chosen, keys, f"step 7: the layout check failed ({why})")
            return {"status": "failed", "keys": keys, "reason": why, "order": order}
        side[who]["wall"] += slowest_rank_steps(run)
        side[who]["loss"].append(run.losses[-1] if run.losses else None)
        names[who] = run.layout.get("name")
    a, b = side["original"]["wall"], side["tuned"]["wall"]
    sp = bootstrap_speedup(a, b)
    la, lb = side["original"]["loss"][-1], side["tuned"]["loss"][-1]
    gap = abs(lb - la) / abs(la) if la and lb is not None else None
    loss_ok = gap is not None and gap <= job.loss_tolerance
    verdict = "faster" if sp.low > 1 else "slower" if sp.high < 1 else "not proven (the interval includes 1.0)"
    sa, sb = stats(a), stats(b)
    out = {"status": "ok", "keys": keys, "layouts": names, "order": order, "world_size": nnodes * nproc,
            "original_median_s": sa.median, "tuned_median_s": sb.median, "speedup": sp.value, "speedup_low": sp.low,
            "speedup_high": sp.high, "proven": sp.proven, "loss_gap": gap, "loss_ok": loss_ok,
            "text": f"layout {names.get('original')} -> {names.get('tuned')} ({nnodes * nproc} ranks, under torchrun): "
                    f"the proposed layout is {verdict}: {sa.median * 1e3:.1f} -> {sb.median * 1e3:.1f} ms per step, "
                    f"{sp.text()} (measured side by side, {turns} alternating turns); final loss "
                    + (f"{gap:.1e} from the original's, " + ("within" if loss_ok else "OUTSIDE") +
                       f" loss_tolerance {job.loss_tolerance:.0%}" if gap is not None else "not compared")}
    if not (sp.low > 1 and loss_ok):  # not faster beyond the noise, or the loss left the tolerance: not adopted
        _withdraw(job, chosen, keys, "step 7: " + out["text"])
        out["withdrawn"] = True
    return out


def _withdraw(job: Job, chosen: list, keys: dict[str, Any], evidence: str) -> None:
    """Step 7's own finding against a proposed layout: each key back to the job's value (analysis.tuning reads step
    7's adopted changes last, and a change back to the job's value removes the earlier one from tuned.yaml)."""
    from mfu_lab.analysis.tuning import WITHDRAWN, Change

    for key, new in keys.items():
        chosen.append(Change("layout", "verify", key, new, getattr(job, key), evidence, "measured",
                             reason=f"{WITHDRAWN}: the proposed layout was not verified faster beside the original"))
