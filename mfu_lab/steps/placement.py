"""Step 6, placement: how should this job be placed on a shared cluster, at what size does it stop
paying, and what should the scheduler be told?

No cluster is at hand, so the cluster figures are ``modelled`` (mfu_lab.analysis.placement_model) and every one says
what it was calibrated from: the job's FLOPs (counted here), its single-GPU efficiency (measured in
steps 1, 2 and 4 when they ran on the cluster's GPU, else the job's ``assumed_mfu``), its overlap of
gradient all-reduce (step 2), link bandwidths (the cluster file, or step 2's all-reduce benchmark on
the cluster's GPU). Two things are measured here: the job alone against two copies of it at once on
this device (co-location), and the model's prediction of step 2's two-process data-parallel step
against what step 2 measured. Writes ``<out>/<job>/06_placement/result.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis import placement_model as pl
from mfu_lab.analysis.cluster_files import Cluster, QueueEntry, load_cluster
from mfu_lab.core import device as dev
from mfu_lab.core import store
from mfu_lab.core.advice import Advice
from mfu_lab.core.faults import guarded
from mfu_lab.core.files import RESULT_FILE, read_json
from mfu_lab.core.job import Job, find_workbook_root
from mfu_lab.core.measure import stats
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.results import Metric, StepResult, environment
from mfu_lab.core.workload import build_loader, build_model, build_train_step
from mfu_lab.steps.baseline import count_step_flops

INFO = BY_KEY["placement"]
DDP_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb
READY_TIMEOUT_S = 600.0  # a co-location copy that has not finished its warm-up by then is ended


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


@dataclass
class PlacementResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    cluster: dict[str, Any]
    shape: dict[str, Any]
    calibration: list[dict]  # input, value, unit, source, from
    coloc: Coloc
    check: Check
    sweep: list[dict]
    efficient_size: int | None
    chosen: dict | None
    strategies: list[dict]
    shared: list[dict]
    gang: list[dict]
    hints: dict[str, str]
    advice: list[Advice]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlacementResult:
        return cls(d["step"], d["job"], d["environment"], {k: Metric(**v) for k, v in d["metrics"].items()},
                   d["cluster"], d["shape"], d["calibration"], Coloc(**d["coloc"]), Check(**d["check"]), d["sweep"],
                   d["efficient_size"], d["chosen"], d["strategies"], d["shared"], d["gang"], d["hints"],
                   [Advice(**a) for a in d["advice"]], **cls.tail(d))


# ------------------------------------------------------------------ inputs
def cluster_path(job: Job) -> Path:
    p = Path(job.cluster).expanduser()
    return p if p.is_absolute() else find_workbook_root() / p


def _earlier(job: Job) -> dict[str, dict]:
    out = {}
    for key in ("baseline", "attention_comm", "compile"):
        path = job.step_dir(BY_KEY[key].folder) / RESULT_FILE
        if path.is_file():
            out[key] = read_json(path)
    return out


def job_shape(job: Job, device: dev.DeviceInfo) -> tuple[pl.Shape, str]:
    """The job's shape for the model; FLOPs per sample counted here (one forward and backward)."""
    model = build_model(job).to(device.torch_device).train()
    x, y = next(iter(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, device.type)))
    fl = count_step_flops(model, build_train_step(job, model, device.type), x.to(device.torch_device),
                          y.to(device.torch_device))
    params = float(sum(p.numel() for p in model.parameters()))
    # a user model is described by the job's shape keys as far as the placement model needs
    shape = pl.Shape(job.n_layers, job.n_heads, job.d_model, job.seq_len, job.micro_batch, params,
                     fl.model_flops_per_step / job.micro_batch, 4 if job.dtype == "float32" else 2, 4,
                     job.attention == "unfused", job.activation_checkpointing)
    return shape, f"{fl.model_flops_source} model FLOPs of one micro-batch / micro_batch; {params:.4g} parameters"


def _same_chip(result: dict, cluster: Cluster) -> bool:
    chip = dev.lookup_chip(result["environment"].get("device_name", ""))
    return chip is not None and chip.name == cluster.gpu


def _recommended_comm(step2: dict) -> dict | None:
    rec = step2.get("recommendation", {}).get("comm")
    if not rec:
        return None
    return next((c for c in step2["comm"] if c["status"] == "ok" and c["hook"] == rec["hook"]
                 and float(c["bucket_mb"]) == float(rec["bucket_cap_mb"])
                 and c["grad_as_bucket_view"] == rec["gradient_as_bucket_view"]), None)


def calibrate(job: Job, cluster: Cluster, earlier: dict[str, dict]) -> tuple[Cluster, pl.Calibration, list[dict]]:
    """The model's inputs, each with its value and where it came from (a row per input for the report)."""
    rows: list[dict] = []
    peak = cluster.peak_flops(job.dtype)
    rows.append({"input": f"peak FLOP/s per {cluster.gpu} ({peak.precision})", "value": peak.flops_per_s,
                 "unit": "FLOP/s", "source": "datasheet", "from": peak.note})

    eff, eff_src, eff_from = job.assumed_mfu, "modelled", (
        f"assumed (job key assumed_mfu): no step has measured a {cluster.gpu}")
    measured = []
    for key, metric in (("baseline", "mfu"), ("attention_comm", "mfu"), ("compile", "mfu")):
        r = earlier.get(key)
        if r and _same_chip(r, cluster) and (r["metrics"].get(metric) or {}).get("value"):
            measured.append((r["metrics"][metric]["value"], BY_KEY[key]))
    if measured:
        eff, info = max(measured, key=lambda t: t[0])
        eff_src, eff_from = "measured", f"step {info.number} ({info.folder}) on {cluster.gpu}: the best MFU measured"
    else:
        ran = {r["environment"].get("device_name") for r in earlier.values()}
        if ran:
            eff_from += f" (steps ran on {', '.join(sorted(ran))}, whose efficiency does not transfer)"
    rows.append({"input": "single-GPU efficiency (MFU)", "value": eff, "unit": "fraction", "source": eff_src,
                 "from": eff_from})

    step2 = earlier.get("attention_comm")
    row = _recommended_comm(step2) if step2 else None
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
    if step2 and step2["comm_layout"].get("backend") == "nccl" and _same_chip(step2, cluster):
        fit = pl.fit_alpha_beta(step2["allreduce"], step2["comm_layout"]["world_size"])
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
    cal = pl.Calibration(peak.flops_per_s, eff, overlap, bucket_mb * 2 ** 20,
                         {r["input"]: r["source"] for r in rows})
    return cluster, cal, rows


# ------------------------------------------------------------------ co-location (measured)
def colocate(job: Job, work: Path, device_type: str, say) -> Coloc:
    """Run the job alone, then two copies at once, each in its own process; measured steps start together.

    On a CPU each copy gets the thread count DDP's ranks get under torchrun (OMP_NUM_THREADS, 1 unless
    set), so the pair reproduces how step 2's two ranks share this CPU.
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")

    def launch(n: int, tag: str) -> list[dict]:
        go = work / f"{tag}.go"
        go.unlink(missing_ok=True)
        procs, specs = [], []
        for i in range(n):
            spec = {"job": job.to_dict(), "warmup": max(1, job.warmup_steps), "steps": job.coloc_steps,
                    "ready": str(work / f"{tag}{i}.ready"), "go": str(go), "out": str(work / f"{tag}{i}.json"),
                    "wait_s": READY_TIMEOUT_S}
            for k in ("ready", "out"):
                Path(spec[k]).unlink(missing_ok=True)
            path = work / f"{tag}{i}.spec.json"
            path.write_text(json.dumps(spec))
            err = open(work / f"{tag}{i}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-m", "mfu_lab.workers.coloc", "--spec", str(path)],
                                           stdout=err, stderr=err, env=env, cwd=os.getcwd()), err))
            specs.append(spec)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not all(Path(s["ready"]).exists() for s in specs):
                dead = [i for i, (p, _) in enumerate(procs) if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"copy {dead[0] if dead else '?'} ended or stalled before its measured steps")
                time.sleep(0.05)
            go.write_text("go")
            for p, _ in procs:
                p.wait(timeout=READY_TIMEOUT_S)
            if any(p.returncode for p, _ in procs):
                raise RuntimeError("a copy exited with an error")
            return [read_json(Path(s["out"])) for s in specs]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            tail = "".join((work / f"{tag}{i}.log").read_text(errors="replace")[-800:] for i in range(n))
            raise RuntimeError(f"{e}; its log ends: {tail.strip()[-800:]}") from None
        finally:
            for _, f in procs:
                f.close()

    try:
        say(f"co-location: the job alone ({job.coloc_steps} steps)")
        alone = launch(1, "alone")[0]
        say(f"co-location: two copies at once ({job.coloc_steps} steps each)")
        pair = launch(2, "pair")
    except RuntimeError as e:
        return Coloc("failed", str(e))
    a = stats(alone["wall_s"])
    both = [w for r in pair for w in r["wall_s"]]
    b = stats(both)
    return Coloc("ok", "", alone["device"], alone["threads"], alone["wall_s"], [r["wall_s"] for r in pair],
                 a.median, b.median, a.p10, a.p90, b.p10, b.p90, b.median / a.median)


# ------------------------------------------------------------------ the model against step 2
def model_check(shape: pl.Shape, earlier: dict[str, dict], coloc: Coloc, device: dev.DeviceInfo) -> Check:
    """Predict step 2's data-parallel step time from single-process times plus step 2's all-reduce benchmark."""
    step2 = earlier.get("attention_comm")
    if not step2:
        return Check(False, "step 2 has not run: no data-parallel step time to check against")
    if step2["environment"].get("device_name") != device.name:
        return Check(False, f"step 2 ran on {step2['environment'].get('device_name')}, not on this device")
    row = _recommended_comm(step2)
    if not row:
        return Check(False, "step 2 found no DDP configuration that ran in sync")
    world = step2["comm_layout"]["world_size"]
    fit = pl.fit_alpha_beta(step2["allreduce"], world)
    if not fit:
        return Check(False, "step 2's all-reduce benchmark has too few sizes to fit latency and bandwidth")
    alpha, bw = fit
    grad = shape.params * shape.grad_bytes
    bucket = float(row["bucket_mb"]) * 2 ** 20
    k = max(1, math.ceil(grad / bucket))
    # DDP reduces its buckets one all-reduce each: k calls, each paying the latency
    ar = sum(pl.ring_allreduce_s(min(bucket, grad - i * bucket), world, bw, alpha) for i in range(k))
    last = pl.ring_allreduce_s(grad - (k - 1) * bucket, world, bw, alpha)
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
    for name, compute, origin in sources:
        hidden = min(ar - last, 2 / 3 * compute)  # the model's rule: all but the last bucket, within backward
        variants = [("model's overlap rule", ar - hidden)] + ([("no overlap", ar)] if hidden > 0 else [])
        for variant, comm in variants:
            pred = compute + comm
            chk.rows.append({"name": f"{name}, {variant}", "compute_s": compute, "compute_from": origin,
                             "comm_s": comm, "predicted_s": pred,
                             "error": (pred - row["step_median_s"]) / row["step_median_s"]})
    return chk


# ------------------------------------------------------------------ scheduler hints
def hints(job: Job, cluster: Cluster, pred: pl.Prediction, health: dict | None) -> dict[str, str]:
    lay = pred.layout
    g = cluster.gpus_per_node
    nodes = sorted({x // g for x in pred.gpus})
    per_node = min(lay.gpus, g)
    switches = len({cluster.node_switch[n] for n in nodes})
    name = job.job_name
    gate = (f"srun --ntasks-per-node=1 python -m mfu_lab gate --max-temp-c {GATE_MAX_TEMP_C:g} "
            "|| { echo 'health gate failed: drain the node named above'; exit 1; }")
    trainer = (f"train.py --tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp}"
               + (f" --num-layers-per-virtual-pipeline-stage {job.n_layers // lay.pp // lay.v}" if lay.v > 1 else "")
               + f" --micro-batch-size {job.micro_batch} --global-batch-size {job.global_batch}")
    slurm = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={len(nodes)}",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --switches={switches}@00:30:00   # at most {switches} leaf switch(es); wait up to 30 min for them",
        "#SBATCH --exclusive                  # no neighbour on these nodes' NICs",
        "",
        "# health gate: every node's GPUs cool and unthrottled before the gang starts",
        gate,
        "",
        "head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        f"srun torchrun --nnodes=\"$SLURM_NNODES\" --nproc-per-node={per_node} --rdzv-backend=c10d \\",
        "    --rdzv-endpoint=\"$head:29500\" --rdzv-id=\"$SLURM_JOB_ID\" \\",
        f"    {trainer}",
        "# (Megatron-LM's argument names for the layout; map them to your trainer's)",
    ])
    pods = len(nodes)
    level = "cloud.provider.com/topology-rack" if switches == 1 else "cloud.provider.com/topology-block"
    kueue = "\n".join([
        "# Kueue topology-aware scheduling (a JobSet / Job pod template); the label names are your",
        "# cluster's Topology levels (these are Kueue's examples)",
        "metadata:",
        "  labels:",
        "    kueue.x-k8s.io/queue-name: training",
        "spec:",
        f"  parallelism: {pods}",
        f"  completions: {pods}",
        "  template:",
        "    metadata:",
        "      annotations:",
        f"        kueue.x-k8s.io/podset-required-topology: \"{level}\""
        + ("   # the whole gang in one rack" if switches == 1 else "   # within one block of racks"),
        "        kueue.x-k8s.io/podset-slice-required-topology: \"kubernetes.io/hostname\"",
        "        kueue.x-k8s.io/podset-slice-size: \"1\"   # one pod per node, holding its TP group",
        "    spec:",
        "      containers:",
        "      - name: trainer",
        "        resources:",
        f"          limits: {{nvidia.com/gpu: {per_node}}}",
    ])
    ref = ""
    if health and health.get("sampled"):
        ref = (f"Step 1 ran at {health.get('temperature_c_max')} °C peak, SM clock "
               f"{(health.get('sm_clock_mhz_mean') or 0):.0f} of {health.get('sm_clock_mhz_max_supported')} MHz.")
    gate_text = (f"mfu-lab gate reads every GPU through NVML and fails (exit 1) when one is above "
                 f"{GATE_MAX_TEMP_C:g} °C or shows a thermal, power-brake or hardware slowdown reason, naming the "
                 "GPU so the node can be drained before it slows the whole gang. " + ref)
    return {"slurm": slurm, "kueue": kueue, "gate": gate_text}


GATE_MAX_TEMP_C = 80.0


# ------------------------------------------------------------------ the step
def _pred_row(p: pl.Prediction, extra: dict | None = None) -> dict:
    d = dataclasses.asdict(p)
    d["label"] = p.layout.label()
    d["tokens_per_gpu_hour"] = p.tokens_per_gpu_hour
    return d | (extra or {})


def strategy_rows(cluster: Cluster, shape: pl.Shape, layout: pl.Layout, cal: pl.Calibration, seed: int,
                  neighbours: list[list[int]] | None = None, neighbour_weight: float = 1.0) -> list[dict]:
    """The layout placed by every strategy and predicted there: one row each, with its slowdown against
    topology-aware (``vs_aware``) when both fit. Step 6's table and the notebook's what-if both use it."""
    rows = []
    for strat in pl.STRATEGIES:
        where = pl.place(cluster, strat, layout, seed)
        if not where:
            rows.append({"strategy": strat, "status": "does not fit"})
            continue
        p = pl.predict(cluster, shape, layout, where, cal, neighbours, neighbour_weight)
        nodes, switches = _nodes_used(cluster, where)
        rows.append(_pred_row(p, {"strategy": strat, "status": "ok", "nodes": nodes, "switches": switches}))
    aware = rows[0]
    for r in rows:
        if r.get("status") == "ok" and aware.get("status") == "ok":
            r["vs_aware"] = r["step_s"] / aware["step_s"]
    return rows


def _nodes_used(cluster: Cluster, gpus: list[int]) -> tuple[int, int]:
    nodes = {x // cluster.gpus_per_node for x in gpus}
    return len(nodes), len({cluster.node_switch[n] for n in nodes})


def _synthetic_queue(cluster: Cluster, seed: int) -> list[QueueEntry]:
    import random

    rng = random.Random(seed)
    n = cluster.n_gpus
    sizes = [max(1, n // d) for d in (2, 8, 4, 1, 16, 4)]
    return [QueueEntry(f"job{i}", round(i * rng.uniform(0.2, 1.0), 2), min(s, n), round(rng.uniform(1, 6), 1))
            for i, s in enumerate(sizes)]


@guarded("placement")
def run(job: Job, progress=None, write: bool = True) -> PlacementResult:
    t_start = time.perf_counter()
    say = progress or (lambda msg: print(msg, flush=True))
    cluster = load_cluster(cluster_path(job))  # a bad cluster file stops here, before any work
    device = dev.resolve_device(job.device)
    skipped: list[dict[str, str]] = []
    earlier = _earlier(job)

    say("counting the job's FLOPs")
    shape, shape_from = job_shape(job, device)
    cluster, cal, cal_rows = calibrate(job, cluster, earlier)

    coloc = colocate(job, job.step_dir(INFO.folder) / "coloc", device.type, say)
    if coloc.status != "ok":
        skipped.append({"what": "co-location experiment", "reason": coloc.reason})
    check = model_check(shape, earlier, coloc, device)
    if not check.available:
        skipped.append({"what": "model check against step 2", "reason": check.reason})

    say("size sweep")
    sweep, points = [], []
    for n in pl.sweep_sizes(cluster):
        best = pl.best_layout(cluster, shape, n, job.global_batch, cal, job.tp, job.pp, job.interleave)
        if best is None:
            sweep.append({"gpus_n": n, "status": "no layout", "reason": "no (tp, pp, dp) divides the model and "
                          f"global_batch {job.global_batch} at this size, or none fits in memory"})
            continue
        nodes, switches = _nodes_used(cluster, best.gpus)
        sweep.append(_pred_row(best, {"status": "ok", "nodes": nodes, "switches": switches}) | {"gpus_n": n})
        points.append((n, best.tokens_per_s))
    size, marg = pl.efficient_size(points, job.min_marginal_efficiency)
    for row, e in zip([r for r in sweep if r["status"] == "ok"], marg):
        row["marginal_efficiency"] = e

    gpus = job.gpus or size
    chosen = (pl.best_layout(cluster, shape, gpus, job.global_batch, cal, job.tp, job.pp, job.interleave)
              if gpus else None)
    strategies, shared, hint = [], [], {}
    if chosen is None:
        skipped.append({"what": "placement comparison", "reason": f"no layout of {gpus} GPUs fits the job "
                        f"(global_batch {job.global_batch}, micro_batch {job.micro_batch}, tp {job.tp}, pp {job.pp})"})
    else:
        say(f"placing {gpus} GPUs ({chosen.layout.label()}) four ways")
        strategies = strategy_rows(cluster, shape, chosen.layout, cal, job.seed)
        empty = dataclasses.replace(cluster, occupied_gpus=0)
        per_job = max((n for n in pl.sweep_sizes(empty) if n * job.placement_jobs <= empty.n_gpus), default=0)
        per_job = min(per_job, gpus)
        lay = pl.best_layout(empty, shape, per_job, job.global_batch, cal, job.tp, job.pp, job.interleave)
        if job.placement_jobs < 2:
            skipped.append({"what": "several jobs sharing the cluster", "reason": "placement_jobs is 1"})
        elif lay is None:
            skipped.append({"what": "several jobs sharing the cluster",
                            "reason": f"no layout of {per_job} GPUs per copy fits"})
        else:
            for name, sets in (("whole racks", pl.partition_whole_racks(empty, job.placement_jobs)),
                               ("interleaved nodes", pl.partition_interleaved(empty, job.placement_jobs))):
                preds = pl.shared_predictions(empty, shape, lay.layout, cal, sets)
                if preds is None:
                    shared.append({"partition": name, "status": "does not fit"})
                    continue
                for k, p in enumerate(preds):
                    nodes, switches = _nodes_used(empty, p.gpus)
                    shared.append(_pred_row(p, {"partition": name, "job": k, "status": "ok", "nodes": nodes,
                                                "switches": switches}))
        health = (earlier.get("baseline") or {}).get("health")
        hint = hints(job, cluster, chosen, health)

    say("gang-scheduling simulation")
    queue = cluster.queue or _synthetic_queue(cluster, job.seed)
    q_from = "the cluster file's queue" if cluster.queue else f"a seeded synthetic queue (seed {job.seed})"
    gang_run = pl.simulate(queue, cluster.n_gpus, "gang")
    horizon = gang_run.makespan_h
    gang = []
    for policy in ("gang", "greedy"):
        r = pl.simulate(queue, cluster.n_gpus, policy, horizon_h=horizon)
        gang.append({"policy": policy, "idle_gpu_hours": r.idle_gpu_hours, "makespan_h": r.makespan_h,
                     "mean_completion_h": r.mean_completion_h, "deadlock_h": r.deadlock_h, "queue_from": q_from,
                     "horizon_h": horizon, "jobs": [dataclasses.asdict(j) for j in r.jobs],
                     "timeline": r.timeline})

    chosen_row = None
    if chosen:
        nodes, switches = _nodes_used(cluster, chosen.gpus)
        chosen_row = _pred_row(chosen, {"nodes": nodes, "switches": switches})
    result = PlacementResult(
        "placement", job.to_dict(), environment(device.name, device.type), {}, cluster.to_dict(),
        dataclasses.asdict(shape) | {"from": shape_from}, cal_rows, coloc, check, sweep, size, chosen_row,
        strategies, shared, gang, hint, [], skipped=skipped)
    result.metrics = _metrics(result, cal)
    result.advice = _advice(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def _metrics(r: PlacementResult, cal: pl.Calibration) -> dict[str, Metric]:
    cal_note = "modelled: " + "; ".join(f"{k} {v}" for k, v in cal.sources.items())
    c = r.chosen or {}
    ok = [s for s in r.strategies if s.get("status") == "ok"]
    worst = max(ok, key=lambda s: s["step_s"]) if ok else None
    best_err = min((abs(x["error"]) for x in r.check.rows), default=None)
    m = {
        "predicted_mfu": Metric(c.get("mfu"), "fraction", "modelled",
                                f"chosen layout {c.get('label', '-')}; {cal_note}"),
        "predicted_step_s": Metric(c.get("step_s"), "s", "modelled", "one optimizer step of global_batch samples"),
        "predicted_tokens_per_s": Metric(c.get("tokens_per_s"), "tokens/s", "modelled", "global_batch x seq_len / "
                                         "predicted step time"),
        "placement_gpus": Metric(float(c["layout"]["tp"] * c["layout"]["pp"] * c["layout"]["dp"]) if c else None,
                                 "GPUs", "modelled", "the job's gpus key, or the efficient size"),
        "efficient_size": Metric(float(r.efficient_size) if r.efficient_size else None, "GPUs", "modelled",
                                 f"largest size whose marginal efficiency stays >= "
                                 f"{r.job['min_marginal_efficiency']:.0%}"),
        "worst_placement_slowdown": Metric(worst.get("vs_aware") if worst else None, "x", "modelled",
                                           f"{worst['strategy'] if worst else '-'} step time / topology-aware"),
        "coloc_slowdown": Metric(r.coloc.slowdown, "x", "measured", "two copies at once on this device: median step "
                                 "/ the job alone, measured side by side"),
        "check_error": Metric(best_err, "fraction", "modelled", "smallest |predicted - measured| / measured of step "
                              "2's data-parallel step over the compute sources tried"),
        "ddp_step_measured_s": Metric(r.check.measured_s, "s", "measured", "step 2, recommended configuration"),
    }
    return m


def _advice(r: PlacementResult) -> list[Advice]:
    out = []
    ok = {s["strategy"]: s for s in r.strategies if s.get("status") == "ok"}
    if "topology-aware" in ok:
        a = ok["topology-aware"]
        worse = [(n, s["vs_aware"]) for n, s in ok.items() if n != "topology-aware" and s["vs_aware"] > 1.02]
        if worse:
            out.append(Advice("act", f"Place topology-aware: each TP group inside one node, the job under "
                              f"{a['switches']} leaf switch(es). Other placements are predicted slower: "
                              + ", ".join(f"{n} {x:.2f}x" for n, x in worse) + ".",
                              f"modelled on {r.cluster['name']}; see the strategy table"))
        else:
            out.append(Advice("info", "The placement strategies are predicted within 2% of each other for this "
                              "layout: its communication is small against compute.", "modelled"))
    if r.efficient_size:
        sw = [s for s in r.sweep if s["status"] == "ok"]
        nxt = next((s for s in sw if s["gpus_n"] > r.efficient_size), None)
        tail = (f"; at {nxt['gpus_n']} GPUs the added GPUs bring {nxt['marginal_efficiency']:.0%} of the per-GPU "
                f"throughput (MFU {nxt['mfu']:.1%})" if nxt else "; the cluster's free GPUs end the sweep")
        out.append(Advice("act", f"Run at {r.efficient_size} GPUs: the largest size whose added GPUs still bring "
                          f"{r.job['min_marginal_efficiency']:.0%} of the per-GPU throughput{tail}.",
                          "modelled size sweep with the fastest layout per size"))
    sh = [s for s in r.shared if s.get("status") == "ok"]
    if sh:
        by = {}
        for s in sh:
            by.setdefault(s["partition"], []).append(s["step_s"])
        if len(by) == 2:
            racks, inter = statistics.fmean(by["whole racks"]), statistics.fmean(by["interleaved nodes"])
            if inter > racks * 1.01:
                out.append(Advice("act", f"Give each job whole racks: interleaving nodes between jobs is predicted "
                                  f"{inter / racks - 1:.1%} slower per step, as their traffic shares uplinks.",
                                  "modelled, jobs sharing links split their bandwidth"))
            else:
                out.append(Advice("info", "Whole racks and interleaved nodes are predicted alike here: the copies' "
                                  "cross-switch traffic stays under the uplinks' capacity.",
                                  f"mean step {racks * 1e3:.2f} vs {inter * 1e3:.2f} ms"))
    g = {x["policy"]: x for x in r.gang}
    if g.get("greedy", {}).get("deadlock_h") is not None:
        out.append(Advice("act", "Gang-schedule: with partial starts, jobs holding parts of the cluster waited on each "
                          f"other from hour {g['greedy']['deadlock_h']:g} on (a deadlock); all-or-nothing starts "
                          "finished the whole queue.", f"idle GPU-hours {g['greedy']['idle_gpu_hours']:.0f} vs "
                          f"{g['gang']['idle_gpu_hours']:.0f} over the same {g['gang']['horizon_h']:g} h"))
    elif g:
        out.append(Advice("info", "Gang against partial starts on this queue: see the table.",
                          f"idle GPU-hours {g['greedy']['idle_gpu_hours']:.0f} vs {g['gang']['idle_gpu_hours']:.0f}"))
    if r.coloc.status == "ok" and r.coloc.slowdown and r.coloc.slowdown > 1.2:
        out.append(Advice("look", f"Sharing this device with a copy of itself slowed the job {r.coloc.slowdown:.2f}x "
                          "(measured): do not pack two jobs onto one device.", "co-location experiment"))
    if r.check.available and r.check.rows:
        best = min(r.check.rows, key=lambda x: abs(x["error"]))
        out.append(Advice("info", f"The model's best prediction of step 2's data-parallel step uses '{best['name']}' "
                          f"({best['error']:+.0%}); trust the cluster figures as far as this check goes.",
                          f"predicted {best['predicted_s'] * 1e3:.0f} ms vs measured "
                          f"{r.check.measured_s * 1e3:.0f} ms"))
    if any(row["source"] == "modelled" and row["input"].startswith("single-GPU") for row in r.calibration):
        out.append(Advice("look", "The single-GPU efficiency is an assumption (assumed_mfu): run steps 1 to 4 on the "
                          "cluster's GPU and rerun this step to calibrate it.", "no measurement on the cluster's GPU"))
    return out


def save(job: Job, result: PlacementResult) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)


