"""Step 6's two measured checks as records, and the model's prediction of step 2's data-parallel step: a
single-process step time (step 1's, or this step's co-location copies') plus the gradient all-reduce costed
with the latency and bandwidth fitted to step 2's benchmark, against what step 2 measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mfu_lab.analysis.placement.calibration import recommended_comm
from mfu_lab.analysis.placement.collectives import fit_alpha_beta, ring_allreduce_s
from mfu_lab.analysis.placement.model import Shape
from mfu_lab.core.measure import device as dev


@dataclass
class Coloc:
    """The job alone against two copies at once on this device (measured)."""

    status: str  # ok | failed
    reason: str = ""
    device: str = ""
    threads: int | None = None
    alone_s: list[float] = field(default_factory=list)
    pair_s: list[list[float]] = field(default_factory=list)
    alone_median_s: float | None = None
    pair_median_s: float | None = None  # median over both copies' steps
    alone_p10_s: float | None = None
    alone_p90_s: float | None = None
    pair_p10_s: float | None = None
    pair_p90_s: float | None = None
    slowdown: float | None = None  # pair median / alone median


@dataclass
class Check:
    """The model's prediction of step 2's data-parallel step on this machine, against the measurement."""

    available: bool
    reason: str = ""
    world: int | None = None
    backend: str = ""
    config: str = ""
    grad_bytes: float | None = None
    buckets: int | None = None
    alpha_s: float | None = None
    busbw_gbps: float | None = None
    allreduce_s: float | None = None
    last_bucket_s: float | None = None
    measured_s: float | None = None
    measured_p10_s: float | None = None
    measured_p90_s: float | None = None
    measured_no_sync_s: float | None = None
    rows: list[dict] = field(default_factory=list)  # name, compute_s, compute_from, comm_s, predicted_s, error
    headline: str = ""  # the row the cluster predictions use: step 1's compute with the model's overlap rule

    def used(self) -> dict | None:
        """The row whose inputs the cluster model itself uses (its headline), not the luckiest of the rows."""
        return next((r for r in self.rows if r["name"] == self.headline), None)


def model_check(shape: Shape, earlier: dict[str, dict], coloc: Coloc, device: dev.DeviceInfo) -> Check:
    """Predict step 2's data-parallel step time from single-process times plus step 2's all-reduce benchmark."""
    step2 = earlier.get("attention_comm")
    if not step2:
        return Check(False, "step 2 has not run: no data-parallel step time to check against")
    if step2["environment"].get("device_name") != device.name:
        return Check(False, f"step 2 ran on {step2['environment'].get('device_name')}, not on this device")
    if (step2.get("comm_layout") or {}).get("skipped"):
        return Check(False, "step 2 ran one rank, so it measured no data-parallel step: "
                     + step2["comm_layout"]["skipped"].split(": ", 1)[-1])
    row = recommended_comm(step2)
    if not row:
        return Check(False, "step 2 found no DDP configuration that ran in sync")
    world = step2["comm_layout"]["world_size"]
    fit = fit_alpha_beta(step2["allreduce"], world)
    if not fit:
        return Check(False, "step 2's all-reduce benchmark has too few sizes to fit latency and bandwidth")
    alpha, bw = fit
    grad = shape.params * shape.grad_bytes
    bucket = float(row["bucket_mb"]) * 2 ** 20
    k = max(1, math.ceil(grad / bucket))
    # DDP reduces its buckets one all-reduce each: k calls, each paying the latency
    ar = sum(ring_allreduce_s(min(bucket, grad - i * bucket), world, bw, alpha) for i in range(k))
    last = ring_allreduce_s(grad - (k - 1) * bucket, world, bw, alpha)
    chk = Check(True, "", world, step2["comm_layout"].get("backend", ""),
                f"{row['hook']}, {row['bucket_mb']} MB buckets", grad, k, alpha, bw, ar, last, row["step_median_s"],
                row["step_p10_s"], row["step_p90_s"], row.get("no_sync_step_s"))
    shares_device = device.type == "cpu"  # CPU ranks share one CPU; GPU ranks have a GPU each
    sources = []
    step1 = earlier.get("baseline")
    if step1 and step1["environment"].get("device_name") == device.name:
        sources.append(("step 1 single process", step1["metrics"]["step_time_median_s"]["value"],
                        f"step 1's median step ({step1['environment'].get('torch_threads')} threads, the device "
                        "to itself)"))
    if coloc.status == "ok":
        sources.append(("alone, as a rank", coloc.alone_median_s,
                        f"this step's co-location run: one copy alone ({coloc.threads} thread(s), as a rank gets)"))
        sources.append(("two at once, as ranks", coloc.pair_median_s,
                        "this step's co-location run: two copies sharing the device, as step 2's ranks do"
                        if shares_device else "two copies on one GPU (DDP gives each rank its own GPU)"))
    if row.get("no_sync_step_s"):
        sources.append(("step 2 no_sync steps", row["no_sync_step_s"],
                        "step 2's DDP steps under no_sync (no all-reduce): the compute each rank got beside the "
                        "others"))
    for name, compute, origin in sources:
        hidden = min(ar - last, 2 / 3 * compute)  # the model's rule: all but the last bucket, within backward
        variants = [("model's overlap rule", ar - hidden)] + ([("no overlap", ar)] if hidden > 0 else [])
        for variant, comm in variants:
            pred = compute + comm
            chk.rows.append({"name": f"{name}, {variant}", "compute_s": compute, "compute_from": origin,
                             "comm_s": comm, "predicted_s": pred,
                             "error": (pred - row["step_median_s"]) / row["step_median_s"]})
    # the headline takes the compute a rank really gets and hides communication by the model's rule: where ranks
    # share a device (always on a CPU) the co-location run with as many copies as ranks, else step 2's no_sync
    # steps; a rank with a device to itself, step 1's single process (issue 29: step 1's compute had both cores)
    ruled = [r["name"] for r in chk.rows if r["name"].endswith("model's overlap rule")]
    order = (["two at once" if world == 2 else "-", "step 2 no_sync", "step 1"] if shares_device
             else ["step 1", "step 2 no_sync"])
    chk.headline = next((n for o in order for n in ruled if n.startswith(o)), ruled[0] if ruled else "")
    return chk
