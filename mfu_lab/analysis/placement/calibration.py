"""Step 6's model inputs calibrated from the job's earlier results (steps 1, 2 and 4), each with its value and
its source: ``measured`` on the cluster's GPU, else the cluster file's or a vendor's ``datasheet`` figure, else
a stated ``modelled`` assumption. Pure: it reads the earlier results' JSON dicts, never files.
"""

from __future__ import annotations

import dataclasses

from mfu_lab.analysis.placement.cluster_files import Cluster
from mfu_lab.analysis.placement.collectives import fit_alpha_beta
from mfu_lab.analysis.placement.model import Calibration
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.registry import BY_KEY

DDP_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb
CALIBRATED_FROM = ("baseline", "attention_comm", "compile")  # the earlier steps whose results calibrate the model


def same_chip(result: dict, cluster: Cluster) -> bool:
    """Whether an earlier step's result was measured on the cluster's GPU."""
    chip = dev.lookup_chip(result["environment"].get("device_name", ""))
    return chip is not None and chip.name == cluster.gpu


def recommended_comm(step2: dict) -> dict | None:
    """Step 2's row of the DDP configuration it recommends, or None."""
    rec = step2.get("recommendation", {}).get("comm")
    if not rec:
        return None
    if rec.get("kind") == "fsdp":  # an FSDP2 pick: DDP's own figures are its defaults' row
        rec = {"hook": "none", "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False}
    return next((c for c in step2["comm"] if c["status"] == "ok" and c["hook"] == rec["hook"]
                 and float(c["bucket_mb"]) == float(rec["bucket_cap_mb"])
                 and c["grad_as_bucket_view"] == rec["gradient_as_bucket_view"]), None)


def calibrate(job: Job, cluster: Cluster, earlier: dict[str, dict]) -> tuple[Cluster, Calibration, list[dict]]:
    """The model's inputs, each with its value and where it came from (a row per input for the report).

    ``earlier`` maps the keys of :data:`CALIBRATED_FROM` to those steps' result.json dicts (absent: not run).
    Returns the cluster (its intra-node link refitted from step 2 where it ran on the cluster's GPU), the
    calibration and the rows."""
    rows: list[dict] = []
    peak = cluster.peak_flops(job.dtype)
    rows.append({"input": f"peak FLOP/s per {cluster.gpu} ({peak.precision})", "value": peak.flops_per_s,
                 "unit": "FLOP/s", "source": "datasheet", "from": peak.note})

    eff, eff_src, eff_from = job.assumed_mfu, "modelled", (
        f"assumed (job key assumed_mfu): no step has measured a {cluster.gpu}")
    measured = []
    for key in CALIBRATED_FROM:  # each step's measured MFU
        r = earlier.get(key)
        if r and same_chip(r, cluster) and (r["metrics"].get("mfu") or {}).get("value"):
            measured.append((r["metrics"]["mfu"]["value"], BY_KEY[key]))
    die_runs = []  # the same compute die, another board (an H200's MFU for an H100 cluster: both GH100)
    for key in CALIBRATED_FROM:
        r = earlier.get(key)
        chip = dev.lookup_chip((r or {}).get("environment", {}).get("device_name", "")) if r else None
        if chip is not None and chip.name != cluster.gpu and dev.same_die(chip.name, cluster.gpu) and \
                (r["metrics"].get("mfu") or {}).get("value"):
            die_runs.append((r["metrics"]["mfu"]["value"], BY_KEY[key], chip.name))
    if measured:
        eff, info = max(measured, key=lambda t: t[0])
        eff_src, eff_from = "measured", f"step {info.number} ({info.folder}) on {cluster.gpu}: the best MFU measured"
    elif die_runs:
        eff, info, chip = max(die_runs, key=lambda t: t[0])
        eff_src = "measured"
        eff_from = (f"step {info.number} ({info.folder}) on an {chip}, the same {dev.same_die(chip, cluster.gpu)} "
                    f"compute die as the cluster's {cluster.gpu} (same-die calibration): its best MFU measured, in "
                    f"place of the assumed {job.assumed_mfu:.0%}; memory bandwidth and clocks differ between the "
                    "boards, so the cluster's GPUs may reach less")
    else:
        ran = {r["environment"].get("device_name") for r in earlier.values()}
        if ran:
            eff_from += f" (steps ran on {', '.join(sorted(ran))}, whose efficiency does not transfer)"
    rows.append({"input": "single-GPU efficiency (MFU)", "value": eff, "unit": "fraction", "source": eff_src,
                 "from": eff_from})

    step2 = earlier.get("attention_comm")
    row = recommended_comm(step2) if step2 else None
    overlap, ov_src, ov_from = 1.0, "modelled", ("assumed: DDP hides all but its last bucket behind backward "
                                                 "(step 2 has not run)")
    bucket_mb = DDP_BUCKET_MB
    if row and row.get("comm_s"):
        overlap = max(0.0, min(1.0, 1 - (row["exposed_s"] or 0.0) / row["comm_s"]))
        ov_src, ov_from = "measured", (f"step 2, {row['hook']} / {row['bucket_mb']} MB: 1 - exposed / all-reduce "
                                       f"time ({(row['exposed_s'] or 0) * 1e3:.0f} / {row['comm_s'] * 1e3:.0f} ms)")
        bucket_mb = float(row["bucket_mb"])
    rows.append({"input": "DP all-reduce hidden behind backward", "value": overlap, "unit": "fraction",
                 "source": ov_src, "from": ov_from + "; never more than the last micro-batch's backward, never the "
                                                    "last bucket"})
    rows.append({"input": "DDP bucket", "value": bucket_mb * 2 ** 20, "unit": "bytes",
                 "source": "measured" if row else "datasheet",
                 "from": "step 2's recommended bucket_cap_mb" if row else "DDP's default bucket_cap_mb (25)"})

    fit = None
    if step2 and step2["comm_layout"].get("backend") == "nccl" and same_chip(step2, cluster):
        fit = fit_alpha_beta(step2["allreduce"], step2["comm_layout"]["world_size"])
    if fit and step2["comm_layout"].get("nnodes", 1) == 1:
        cluster = dataclasses.replace(cluster, intra_node_gbps=fit[1], intra_node_latency_us=fit[0] * 1e6,
                                      sources={**cluster.sources, "intra_node_gbps": "step 2 all-reduce fit",
                                               "intra_node_latency_us": "step 2 all-reduce fit"})
        why = "step 2's NCCL all-reduce benchmark on this GPU (least-squares alpha-beta fit)"
        rows.append({"input": "intra-node bus bandwidth", "value": fit[1], "unit": "GB/s", "source": "measured",
                     "from": why})
        rows.append({"input": "intra-node latency", "value": fit[0] * 1e6, "unit": "µs", "source": "measured",
                     "from": why})
    else:
        why = ("step 2 has not run" if not step2 else
               f"step 2 ran on {step2['environment'].get('device_name')} over "
               f"{step2['comm_layout'].get('backend')}, not on the cluster's {cluster.gpu} links")
        rows.append({"input": "intra-node bus bandwidth", "value": cluster.intra_node_gbps, "unit": "GB/s",
                     "source": "datasheet", "from": f"{cluster.sources.get('intra_node_gbps')} (not recalibrated: "
                                                    f"{why})"})
        rows.append({"input": "intra-node latency", "value": cluster.intra_node_latency_us, "unit": "µs",
                     "source": "datasheet", "from": cluster.sources.get("intra_node_latency_us", "")})
    for key, unit in (("node_network_gbps", "GB/s"), ("oversubscription", "x"), ("inter_node_latency_us", "µs")):
        rows.append({"input": key.replace("_", " "), "value": getattr(cluster, key), "unit": unit,
                     "source": "datasheet", "from": cluster.sources.get(key, "")})
    cal = Calibration(peak.flops_per_s, eff, overlap, bucket_mb * 2 ** 20,
                         {r["input"]: r["source"] for r in rows})
    return cluster, cal, rows
