"""The verify step's DDP check: the job's original and tuned DDP settings alternated in one torchrun launch.

Bucket size, communication hook and ``gradient_as_bucket_view`` change nothing in one process, so they are
verified where they act: the step-2 worker (mfu_lab.workers.ddp_rank) runs the configurations
``[original, tuned] x min(verify_rounds, 5)`` in that order (:func:`mfu_lab.workers.launch.alternate`), each a fresh
DDP model timed for ``comm_steps`` steps after :func:`mfu_lab.workers.ddp_rank.ddp_warmup` untimed ones (never
DDP's bucket rebuild nor PowerSGD's uncompressed steps; recorded as ``warmup_steps``); the per-step times of all
rounds are pooled per configuration and compared with a bootstrap interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mfu_lab.analysis.tuning import Change
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup
from mfu_lab.core.measure.timed import stats
from mfu_lab.steps.verify.layout import verify_layout_change
from mfu_lab.workers.alternate import alternate, turn_lines
from mfu_lab.workers.comm_configs import config_key
from mfu_lab.workers.ddp_rank import ddp_warmup
from mfu_lab.workers.launch import world_layout

DDP_ROUNDS = 5  # each DDP turn builds a fresh DDP model and warms it up: far dearer than a round
# staircase rungs one process cannot time: each is verified under torchrun below (verify_ddp), and says so
UNDER_TORCHRUN = {"communication": "DDP settings do nothing in one process: verified under DDP below",
                  "layout": "a layout change needs its ranks: verified under torchrun beside the original job below"}


def torchrun_reason(rung, ddp: dict[str, Any]) -> str:
    """A rung's reason once the torchrun checks ran (:func:`verify_ddp`'s record, its ``layout`` inside)."""
    if rung.name == "communication":
        return "DDP settings do nothing in one process; " + (
            ddp["text"] if ddp["status"] == "ok" else f"DDP check {ddp['status']}: {ddp.get('reason', '')}")
    if rung.name == "layout":
        lay = ddp.get("layout") or {}
        said = lay["text"] if lay.get("status") == "ok" else f"layout check {lay.get('status')}: {lay.get('reason')}"
        gone = lay.get("withdrawn") or lay.get("status") == "failed"
        return "a layout change, verified under torchrun; " + said + (
            "; withdrawn: tuned.yaml keeps the job's layout" if gone else "")
    return rung.reason


def ddp_configs(job: Job, chosen: list[Change]) -> tuple[dict, dict] | None:
    """(original, tuned) DDP configurations in the step-2 worker's form, or None when no DDP change is adopted."""
    mine = {c.key: c.new for c in chosen if c.adopted and c.rung == "communication"}
    if not mine:
        return None
    original = {"hook": job.ddp_hook, "bucket_mb": float(job.ddp_bucket_mb),
                "grad_as_bucket_view": job.ddp_grad_as_bucket_view}
    tuned = {"hook": mine.get("ddp_hook", job.ddp_hook), "bucket_mb": float(mine.get("ddp_bucket_mb",
                                                                                    job.ddp_bucket_mb)),
             "grad_as_bucket_view": mine.get("ddp_grad_as_bucket_view", job.ddp_grad_as_bucket_view)}
    return original, tuned


def verify_ddp(job: Job, device_type: str, chosen: list[Change], work: Path, say) -> dict[str, Any]:
    """The DDP check, with the layout change's check (steps.verify.layout) under ``layout``."""
    out = _verify_ddp(job, device_type, chosen, work, say)
    out["layout"] = verify_layout_change(job, device_type, chosen, work, say)
    return out


def _verify_ddp(job: Job, device_type: str, chosen: list[Change], work: Path, say) -> dict[str, Any]:
    configs = ddp_configs(job, chosen)
    if configs is None:
        return {"status": "skipped", "reason": "no DDP change was adopted"}
    nnodes, nproc = world_layout(job, device_type)
    if nnodes * nproc < 2:
        return {"status": "skipped", "reason": f"the job runs {nnodes * nproc} process: no data parallelism to "
                "verify; run the verify step on a node with 2+ GPUs (or nproc_per_node: 2+)"}
    original, tuned = configs
    turns = min(job.verify_rounds, DDP_ROUNDS)
    say(f"DDP: {2 * turns} configurations alternated in one launch of {nnodes * nproc} processes")
    run = alternate(job, device_type, None, [original, tuned], turns, work,
                    turn_lines(say, "DDP turns", 2 * turns))
    warmup = {"original": ddp_warmup(job.comm_warmup_steps, original["hook"]),  # untimed steps of each turn
              "tuned": ddp_warmup(job.comm_warmup_steps, tuned["hook"])}
    if run.error:
        return {"status": "failed", "reason": run.error, "configs": [original, tuned], "warmup_steps": warmup}
    walls = run.walls
    order = ["original" if k == config_key(original) else "tuned" for k in run.order]
    a, b = walls[config_key(original)], walls[config_key(tuned)]
    sp = bootstrap_speedup(a, b)
    sa, sb = stats(a), stats(b)
    verdict = "faster" if sp.low > 1 else "slower" if sp.high < 1 else "not proven (the interval includes 1.0)"
    return {"status": "ok", "configs": [original, tuned], "order": order, "world_size": nnodes * nproc,
            "original_median_s": sa.median, "tuned_median_s": sb.median, "speedup": sp.value, "speedup_low": sp.low,
            "speedup_high": sp.high, "proven": sp.proven, "warmup_steps": warmup,
            "text": f"DDP, {nnodes * nproc} processes: the tuned configuration is {verdict}: {sa.median * 1e3:.1f} -> "
                    f"{sb.median * 1e3:.1f} ms per step, {sp.text()} (measured side by side)"}
