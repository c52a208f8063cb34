"""Step 2's DDP half as a table: one :class:`CommRow` per configuration the sweep measured (its step times, the
all-reduce time of one profiled step, the exposed part against the same steps under ``no_sync``, the ranks' drift
and the loss), the loss check that decides which rows step 2 may pick (:mod:`mfu_lab.analysis.dp_family`'s rule),
and the ledger of the picked row."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from mfu_lab.analysis.dp_family import loss_gap, loss_verdict
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.ledger import HardwareFlops, Ledger, ddp_ledger
from mfu_lab.core.measure.timed import stats
from mfu_lab.core.thresholds import DDP_SYNC_TOLERANCE
from mfu_lab.workers.comm_configs import config_key, config_name, is_fsdp

DDP_DEFAULT = ("none", 25.0, False)  # DDP's own defaults: built-in all-reduce, 25 MB buckets


@dataclass
class CommRow:
    hook: str
    bucket_mb: float
    grad_as_bucket_view: bool
    status: str  # ok | unsupported | failed | hung | skipped | out of sync
    error: str = ""
    stderr: str = ""
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    comm_s: float | None = None  # all-reduce time in one profiled step (union of bucket spans, slowest rank)
    no_sync_step_s: float | None = None  # median of the same steps under no_sync, measured right after
    exposed_s: float | None = None  # step time with communication - without (no_sync)
    comm_share: float | None = None
    exposed_share: float | None = None
    param_diff: float | None = None
    mfu: float | None = None
    kind: str = "ddp"  # ddp | fsdp (an FSDP2 candidate: hook holds its name, bucket_mb 0; see fsdp)
    fsdp: dict | None = None  # FSDP2: {reshard, prefetch, reduce_dtype}
    loss: float | None = None  # rank 0's last timed step, same batches and steps as every candidate
    loss_gap: float | None = None  # relative to DDP's defaults' loss (analysis.dp_family)
    loss_note: str = ""  # why the loss check refused it


def comm_rows_of(configs: list[dict], sweep, flops_per_step: float, peak_total: float, world: int) -> list[CommRow]:
    rows = []
    for cfg in configs:
        ev = sweep.outcomes.get(config_key(cfg))
        if ev is None:
            continue
        row = _row(cfg, ev)
        if ev["event"] == "dropped" and ev.get("wall_s"):  # the race's first round only, said in the table
            s = stats(ev["wall_s"])
            row.step_median_s, row.step_p10_s, row.step_p90_s = s.median, s.p10, s.p90
        if ev["event"] == "done":
            s = stats(ev["wall_s"])
            local = statistics.median(ev["no_sync_wall_s"])
            exposed = max(0.0, s.median - local)
            diff = ev["param_checksum_max_diff"]  # None under FSDP2: one sharded copy, nothing to drift
            row.status = "ok" if (diff or 0.0) <= DDP_SYNC_TOLERANCE else "out of sync"
            row.loss = ev.get("loss")
            row.step_median_s, row.step_p10_s, row.step_p90_s = s.median, s.p10, s.p90
            row.comm_s, row.no_sync_step_s, row.exposed_s, row.param_diff = ev["comm_s"], local, exposed, diff
            row.comm_share = min(1.0, ev["comm_s"] / ev["profiled_step_s"])  # both from the profiled step
            row.exposed_share = exposed / s.median
            row.mfu = fl.mfu(world * flops_per_step, len(ev["wall_s"]) / sum(ev["wall_s"]), peak_total)
        rows.append(row)
    return rows


def _row(cfg: dict, ev: dict) -> CommRow:
    if is_fsdp(cfg):
        return CommRow(config_name(cfg), 0.0, False, ev["event"], ev.get("error", ""), ev.get("stderr", ""),
                       kind="fsdp", fsdp={k: cfg[k] for k in ("reshard", "prefetch", "reduce_dtype")})
    return CommRow(cfg["hook"], cfg["bucket_mb"], cfg["grad_as_bucket_view"], ev["event"], ev.get("error", ""),
                   ev.get("stderr", ""))


def loss_check(rows: list[CommRow], reference: CommRow | None, tolerance: float) -> list[CommRow]:
    """The rows step 2 may pick: each row's loss compared with DDP's defaults' (analysis.dp_family's rule, which the
    worker's own pick obeys too); a refused row keeps its figures and says why."""
    ok = []
    for r in rows:
        r.loss_gap = loss_gap(r.loss, reference.loss) if reference else None
        fine, why = loss_verdict(config_of(r), r.loss, reference.loss if reference else None, tolerance)
        if fine:
            ok.append(r)
        else:
            r.loss_note = why
    return ok


def ddp_ledger_of(row: CommRow, ev: dict, world: int, hw: HardwareFlops | None, why_not: str) -> Ledger:
    """Shares of the median step (medians, as the table's: one slow step, a loader starting, moves no bar):
    data waits, and exposed communication as the step with communication less the same step under no_sync."""
    wall = statistics.median(ev["wall_s"])
    data = statistics.median(ev["data_s"]) / wall
    exposed = max(0.0, wall - statistics.median(ev["no_sync_wall_s"])) / wall
    return ddp_ledger(row.mfu, exposed, data, world, hw, why_not)


def config_of(row: CommRow) -> dict:
    if row.kind == "fsdp":
        return {"kind": "fsdp", **(row.fsdp or {})}
    return {"hook": row.hook, "bucket_mb": row.bucket_mb, "grad_as_bucket_view": row.grad_as_bucket_view}
