"""One rank of a job run in its layout (FSDP2, TP/SP, PP, DDP); started by ``torchrun`` through
mfu_lab.workers.layout_launch, never by hand:

    python -m torch.distributed.run ... -m mfu_lab.workers.layout_rank --spec SPEC.json

The spec holds the job and a list of layouts (job overrides), so one launch pays torchrun's start-up once.
For each layout, every rank:

1. checks correctness before timing: the layout's loss over CHECK_STEPS steps against a reference on the same
   seed, batches and dtype: the single-process job on the global batch (every rank computes it alone), or,
   where one process cannot hold the model, another layout that fits; a gap above TOLERANCE refuses the layout;
2. runs warm-up steps, then timed steps (CUDA events on a GPU; a barrier, then perf_counter, on a CPU);
3. runs one step under :class:`mfu_lab.core.measure.commcount.CollectiveCounter` (collective kinds and bytes);
4. reads its memory: the peak (torch.cuda.max_memory_allocated; on a CPU one step under torch's MemTracker) and
   the bytes of its local shards (parameters, gradients, optimizer state);
5. under PP, times each stage's fill and drain in every timed step (:class:`StageClock`);
6. with ``profile``, traces one more step with torch.profiler (one file per rank).

Local rank 0 of each node appends the events to ``<out>/progress.jsonl`` (rank_events.emit), every rank its
heartbeat; the per-rank figures are gathered to every rank first, so each node's file holds them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mfu_lab.analysis.layouts.terms import memory_per_rank, memory_shape
from mfu_lab.core.engine.batches import IGNORE, to_device
from mfu_lab.core.engine.layout import Layout, build_mesh
from mfu_lab.core.engine.layout_check import check_layout
from mfu_lab.core.engine.meta_shape import job_shape
from mfu_lab.core.engine.parallelize import Parallelized, convert_fp8, parallelize, untie_head
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step, eager
from mfu_lab.core.errors import JobError, StepError
from mfu_lab.core.job.schema import Job, validate
from mfu_lab.core.measure.commcount import CollectiveCounter
from mfu_lab.core.measure.timed import profile_steps
from mfu_lab.core.process.procs import die_with_parent
from mfu_lab.workers.rank_events import emit, heartbeat, step_beat
from mfu_lab.workers.stage_clock import StageClock, slow_last_backward

CHECK_STEPS = 3
# Relative loss gap a layout may show against its reference. Measured here (tests/test_layouts.py, gloo, torch 2.13):
# float32 layouts differ by at most 1.7e-7 (summation order: a float32 ulp is 1.2e-7), so 1e-5 leaves room for
# larger models and other kernels while catching any real error (a wrong shard moves the loss by 1e-3 or more);
# the bf16 MixedPrecisionPolicy against one process's bf16 autocast differed by 2.5e-5, and 5e-3 is about one
# bfloat16 ulp of the loss (2^-8 = 3.9e-3), the scale at which GPU kernels' bf16 roundings may move it.
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3}


def threads_per_rank(local_world: int) -> int:
    """Intra-op threads per rank: the cores this process may use, shared by the node's ranks (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world)


def global_batches(job: Job, dp: int, n: int, device_type: str) -> list:
    """``n`` global batches (dp x micro_batch samples each): the single process trains on them whole, data-parallel
    rank r on rows [r * micro_batch, (r + 1) * micro_batch)."""
    return list(build_loader(dataclasses.replace(job, micro_batch=dp * job.micro_batch), n, device_type))


def rows(batch, dp_rank: int, mb: int, device: torch.device):
    x, y = batch
    return x[dp_rank * mb:(dp_rank + 1) * mb].to(device), y[dp_rank * mb:(dp_rank + 1) * mb].to(device)


def fits_one_process(job: Job, dp: int, device: torch.device, local_world: int) -> tuple[bool, str]:
    """Whether one process can train the job on the global batch (dp x micro_batch samples): parameters,
    gradients, AdamW's state and activations by analysis.layouts.terms.memory_per_rank (the model sized on the
    meta device), against free GPU memory or this rank's share of the host's available memory."""
    try:
        shape = job_shape(job)
    except Exception as e:  # noqa: BLE001 - a factory that cannot build on the meta device: assume it fits, say so
        return True, f"not estimated ({type(e).__name__} on the meta device)"
    ms = memory_shape(shape.params, shape.n_layers or job.n_layers, shape.n_heads or job.n_heads,
                      shape.d_model or job.d_model, job.seq_len, dp * job.micro_batch,
                      4 if job.dtype == "float32" else 2, job.activation_checkpointing, job.attention == "unfused",
                      checkpoint_policy=job.checkpoint_policy)
    need = memory_per_rank(ms, Layout(world=1, dp=1))["total"].value
    if device.type == "cuda":  # pragma: no cover - GPU only
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available // local_world
    return need <= free, f"needs about {need / 2**30:.2f} GiB (analytic), {free / 2**30:.2f} GiB free to this rank"


def reference_losses(job: Job, layout: Layout, batches: list, device: torch.device) -> tuple[list[float], bool]:
    """The single-process job (its own training step, autocast in its dtype) on the global batches, and whether
    its fp8_layers trained in FP8."""
    model = build_model(job).to(device).train()
    if layout.pp > 1:
        untie_head(model)  # as the layout does: a tied head trains differently
    if layout.tp > 1:  # FP8 as the layout converts it: q, k, v apart, the shards scaled_mm refuses left out
        convert_fp8(job, model, layout, device)
    ts = build_train_step(eager(job), model, device.type)
    return [float(ts(to_device(x, device), to_device(y, device))) for x, y in batches], bool(ts.fp8.layers)


def global_losses(local: list, layout: Layout, device: torch.device) -> list[float]:
    """The layout's loss per step: the mean over data-parallel ranks of the ranks that compute it (every rank, or
    the last pipeline stage's), from one all-reduce of the whole series."""
    t = torch.tensor([0.0 if v is None else float(v) for v in local], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / (layout.world // layout.pp)).tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def timed_steps(par: Parallelized, batches: list, device: torch.device, beat) -> tuple[list[float], list]:
    """Seconds and local loss of each optimizer step, ``batches`` holding each step's micro-batches. CPU: every
    rank leaves a barrier, then perf_counter brackets the step
    (it runs synchronously). GPU: CUDA events around each step, no synchronisation inside the loop."""
    cuda = device.type == "cuda"
    times, losses, events = [], [], []
    if cuda:  # pragma: no cover - GPU only
        torch.cuda.synchronize(device)
        dist.barrier()
    for i, parts in enumerate(batches):
        if cuda:  # pragma: no cover - GPU only
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            losses.append(par.accumulate(parts))
            b.record()
            events.append((a, b))
        else:
            dist.barrier()  # the ranks start the step together; the barrier is outside the timed span
            t0 = time.perf_counter()
            losses.append(par.accumulate(parts))
            times.append(time.perf_counter() - t0)
        beat(i + 1, len(batches))
    if cuda:  # pragma: no cover - GPU only
        torch.cuda.synchronize(device)  # sync point: read the events once every step has finished
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
    return times, [None if v is None else float(v) for v in losses]


def peak_memory(par: Parallelized, x, y, device: torch.device) -> tuple[int, str, dict]:
    """The step's peak: max_memory_allocated over the timed steps on a GPU (reset before them). On a CPU, one
    more step under torch.distributed._tools.mem_tracker.MemTracker: the peak of the tensor bytes alive
    (parameters, gradients, optimizer state, activations, buffers), which a CPU's allocator does not report.
    Under PP its module hooks are left out (they refuse a module called once per micro-batch)."""
    if device.type == "cuda":  # pragma: no cover - GPU only
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated (timed steps)", {}
    from torch.distributed._tools.mem_tracker import MemTracker

    class TensorsOnly(MemTracker):  # the tensors, without the per-module breakdown
        def _pre_fw_hook(self, *a):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

    mt = (TensorsOnly if par.schedule is not None else MemTracker)()
    mt.track_external(*par.modules, par.optimizer)
    with mt:
        par.step(x, y)
    snap = max(mt.get_tracker_snapshot("peak").values(), key=lambda v: v.get("Total", 0))  # by kind at the peak
    return (int(snap.get("Total", 0)), "MemTracker (torch.distributed._tools), 1 step"
            + (", tensors only" if par.schedule else ""), {k: int(v) for k, v in snap.items()})


def counted_step(par: Parallelized, x, y) -> dict:
    """One step under core.measure.commcount's counter: {kind: {"count", "bytes"}} of this rank's collectives."""
    with CollectiveCounter() as counter:
        par.step(x, y)
    return counter.summary()


LAYOUT_KEYS = ("dp_mode", "fsdp_reshard_after_forward", "fsdp_prefetch", "fsdp_param_dtype", "fsdp_reduce_dtype",
               "tp", "sp", "pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages", "tp_plan")


def reference_check(job: Job, layout: Layout, item: dict, base: dict, batches: list, ctx: dict,
                    notes: list[str]) -> dict:
    """The loss check's reference and its losses on ``batches``: ``item["reference"]`` is "single" (one process),
    a dict of layout keys (another layout, on the same job otherwise and the same global batches), or "auto":
    one process where it can hold the model (``item["one_process_fits"]: false`` says it cannot), else FSDP over
    every rank, else TP over every rank."""
    world, device = ctx["world"], ctx["device"]
    # a MixedPrecisionPolicy in a lower precision than the job's dtype trains in that precision: its tolerance
    low = max((job.dtype, layout.param_dtype if layout.fsdp else job.dtype), key=lambda d: TOLERANCE[d])
    check = {"steps": len(batches), "tolerance": TOLERANCE[low], "reference_losses": [], "max_rel_gap": None,
             "passed": None}
    ref = item.get("reference", "auto")
    if ref == "auto":
        ok, why = fits_one_process(job, layout.dp, device, ctx["local_world"])
        ok = ok and item.get("one_process_fits", True)
        if ok:
            ref = "single"
        else:
            ref = {"dp_mode": "fsdp"} if not (layout.fsdp and layout.dp == world) else {"tp": world}
            why = why if item.get("one_process_fits", True) else "as the spec says"
            notes.append(f"one process cannot hold the model ({why}): the loss is checked against layout {ref}")
    if ref == "single":  # the same job, batches and tied head give the same losses: computed once per launch
        check["reference"] = "single process, global batch"
        key = json.dumps([{k: v for k, v in job.to_dict().items() if k not in LAYOUT_KEYS}, layout.dp,
                          layout.pp > 1, layout.tp == 1, len(batches)], sort_keys=True, default=str)
        cache = ctx.setdefault("references", {})
        if key not in cache:
            cache[key] = reference_losses(job, layout, batches, device)
        check["reference_losses"], check["reference_fp8"] = list(cache[key][0]), cache[key][1]
        return check
    values = {**job.to_dict(), **{k: Job.__dataclass_fields__[k].default for k in LAYOUT_KEYS if k != "tp_plan"},
              "tp_plan": job.tp_plan, **ref}
    rjob = validate(values, "the loss check's reference layout")
    try:
        rlayout = Layout.from_job(rjob, world)
        check_layout(rjob, world, device.type)
    except (StepError, JobError) as e:
        check["reference"] = f"none: the reference layout {ref} cannot run here ({e})"
        notes.append("loss not checked: no reference layout fits")
        return check
    # the same global batches, split over the reference's data-parallel ranks
    rjob = validate({**values, "micro_batch": job.micro_batch * layout.dp // rlayout.dp}, "reference layout")
    rmesh = build_mesh(rlayout, device.type)
    model = build_model(rjob).to(device).train()
    if layout.pp > 1:
        untie_head(model)  # as the layout does
    rpar = parallelize(model, rjob, rlayout, rmesh, device)
    rmine = [rows(b, rmesh["dp"].get_local_rank(), rjob.micro_batch, device) for b in batches]
    check["reference"] = f"layout {rlayout.name}"
    check["reference_losses"] = global_losses([rpar.step(x, y) for x, y in rmine], rlayout, device)
    check["reference_fp8"] = bool(rpar.fp8.layers)
    return check


def fp8_tolerance(check: dict, layout: Layout, converted: bool, notes: list[str]) -> None:
    """Loosen the loss check to bf16's tolerance where FP8 makes the layout's losses differ from its reference's
    by FP8's rounding, and say why in ``notes``: torchao's scales (tensorwise: a tensor's largest magnitude) are
    taken over what a rank or a pipeline micro-batch holds, not the global batch the reference sees (2 gloo ranks,
    float32: 6.5e-5 relative against 4.9e-8 without FP8); under tensor parallel, torchao's float8 styles and the
    rowwise recipes do not round as one process does (tp 2 on gloo, float32, 3 steps: 4.2e-5 and 5.8e-5 relative);
    or one of the two trained with FP8 and the other not."""
    why = []
    if converted and (layout.dp > 1 or layout.pp > 1):
        why.append("FP8 scales are taken over each rank's or micro-batch's rows, not the global batch")
    if converted and layout.tp > 1:
        why.append("under tensor parallel, FP8 does not round exactly as in one process")
    if check.get("reference_fp8") is not None and converted != check["reference_fp8"]:
        why.append(f"the reference ({check.get('reference')}) trained {'without' if converted else 'with'} FP8")
    if not why:
        return
    check["tolerance"] = max(check["tolerance"], TOLERANCE["bfloat16"])
    notes.append(f"FP8 in the loss check: {'; '.join(why)}, so the losses are compared at tolerance "
                 f"{check['tolerance']:g}")


def measure(index: int, item: dict, base: dict, spec: dict, ctx: dict) -> dict:
    """One layout: check, time, count, read memory, trace; the record every rank gathered (emitted by local
    rank 0). A StepError (the same on every rank, before any collective) refuses the layout."""
    rank, world, device, out = ctx["rank"], ctx["world"], ctx["device"], ctx["out"]
    job = validate({**base, **item.get("overrides", {})}, f"layout {index + 1} of the worker spec")
    layout = Layout.from_job(job, world)
    check_layout(job, world, device.type)
    notes = list(ctx["notes"])
    if layout.dp > 1 and (job.data != "synthetic" or job.last_batch == "pad"):
        notes.append("padded batches: data-parallel ranks average their own mean losses (and gradients), which "
                     "weighs tokens unlike one process's mean over the global batch; the loss check may show it")
    emit(out, {"event": "start", "index": index, "name": layout.name})
    heartbeat(out, rank, index, -1)
    # tests only: {"layout": index, "rank": r, "kind": "crash" | "hang"}, {"layout": index, "kind": "perturb"}
    # (every rank scales its first parameter after the layout is built: a layout whose loss differs), or
    # {"layout": index, "rank": r, "kind": "slow_backward", "seconds": s} (the last micro-batch's backward of
    # rank r's first module's first block sleeps s in every step: an idle the other pipeline ranks must show)
    faults = [f for f in spec.get("fault") or [] if f.get("layout") == index]
    for fault in faults:
        if fault.get("rank") == rank and fault["kind"] in ("crash", "hang"):
            if fault["kind"] == "crash":
                raise RuntimeError(f"injected crash on rank {rank} (test fault)")
            time.sleep(10_000)  # injected hang

    beat = step_beat(out, rank, {"config": index}, {"index": index})  # at most once a second, not fsynced

    mesh = build_mesh(layout, device.type)
    dp_rank = mesh["dp"].get_local_rank()
    warm, steps = spec["warmup"], spec["steps"]
    extra = 2 + bool(spec.get("profile"))  # counted step, memory step, profiled step
    checks = int(spec.get("check_steps") or CHECK_STEPS)  # the spec may ask for fewer (step 6: 2)
    k = job.grad_accum  # the timed steps are optimizer steps of k micro-batches; the loss check compares micro-batches
    batches = global_batches(job, layout.dp, checks + (warm + steps) * k + extra, device.type)
    mine = [rows(b, dp_rank, job.micro_batch, device) for b in batches]
    check = reference_check(job, layout, item, base, batches[:checks], ctx, notes)
    par = parallelize(build_model(job).to(device).train(), job, layout, mesh, device)
    notes += par.notes
    fp8_tolerance(check, layout, bool(par.fp8.layers), notes)
    if any(f["kind"] == "perturb" for f in faults):
        with torch.no_grad():
            par.parameters()[0].mul_(1.5)
    for f in faults:
        if f["kind"] == "slow_backward" and f.get("rank") == rank:
            slow_last_backward(par.modules[0], float(f["seconds"]), layout.pp_microbatches)
    check["layout_losses"] = global_losses([par.step(x, y) for x, y in mine[:checks]], layout, device)
    if check["reference_losses"]:
        check["max_rel_gap"] = gap(check["layout_losses"], check["reference_losses"])
        check["passed"] = check["max_rel_gap"] <= check["tolerance"]
    record = {"index": index, "layout": layout.to_dict() | {"name": layout.name}, "loss_check": check,
              "notes": notes, "fp8": par.fp8.record(),
              "tokens_per_step": int(k * sum(int((b[1] != IGNORE).sum()) for b in batches) / len(batches))}
    if check["passed"] is False:
        return record | {"status": "refused", "reason": f"loss differs from the reference ({check['reference']}) by "
                         f"{check['max_rel_gap']:.2e} relative, above the tolerance {check['tolerance']:g}"}
    clock = StageClock(par, device.type == "cuda") if par.schedule is not None else None
    if device.type == "cuda":  # pragma: no cover - GPU only
        torch.cuda.reset_peak_memory_stats(device)
    run = mine[checks:checks + (warm + steps) * k]
    times, losses = timed_steps(par, [run[i:i + k] for i in range(0, len(run), k)], device, beat)
    times, losses = times[warm:], losses[warm:]
    stages = clock.rows(skip=warm) if clock else []
    rest = mine[checks + (warm + steps) * k:]
    mine_rank = {"rank": rank, "step_times_s": times, "stages": stages}
    mine_rank["shard_bytes"] = par.shard_bytes()  # after a step: its gradients are still held
    mine_rank["collectives"] = counted_step(par, *rest[0])
    if spec.get("profile"):
        path = Path(spec["out"]) / f"trace_{index}_rank{rank}.json.gz"
        def step(x, y):  # a loss on every rank (run_steps reads it): 0 on the stages that hold none
            loss = par.step(x, y)
            return torch.zeros(()) if loss is None else loss

        profile_steps(step, [rest[2]], device, 0, 1, path)
        mine_rank["trace"] = str(path)
    mine_rank["peak_bytes"], mine_rank["peak_source"], mine_rank["peak_by_kind"] = peak_memory(par, *rest[1],
                                                                                                device)  # last
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine_rank)
    record |= {"status": "ok", "reason": "", "losses": global_losses(losses, layout, device),
               "step_times_s": [r["step_times_s"] for r in everyone],
               "collectives": [r["collectives"] for r in everyone],
               "memory": [{"peak_bytes": r["peak_bytes"], "peak_source": r["peak_source"],
                           "peak_by_kind": r["peak_by_kind"], "shard_bytes": r["shard_bytes"]} for r in everyone],
               "trace_paths": [r["trace"] for r in everyone if r.get("trace")]}
    if clock:
        p, v, m = layout.pp, layout.pp_virtual_stages, layout.pp_microbatches
        per_stage = sorted((s for r in everyone for s in r["stages"]), key=lambda s: s["stage"])
        per_rank = []  # a pipeline rank idles until its earliest stage starts and after its latest one ends
        for r in range(p):
            mine = [s for s in per_stage if s["stage"] % p == r]
            if mine:
                fill, drain = min(s["fill_s"] for s in mine), min(s["drain_s"] for s in mine)
                step = statistics.median(s["step_s"] for s in mine)
                per_rank.append({"pp_rank": r, "fill_s": fill, "drain_s": drain, "step_s": step,
                                 "fraction": (fill + drain) / step if step else 0.0})
        record["bubble"] = {"per_stage": per_stage, "per_pp_rank": per_rank, "analytic": (p - 1) / (v * m),
                            "analytic_of_step": (p - 1) / (v * m + p - 1)}
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(Path(ap.parse_args().spec).read_text())
    die_with_parent()  # torchrun started this rank in a session of its own: it must not outlive torchrun
    out = Path(spec["out"])
    cuda = torch.cuda.is_available() and spec["device_type"] == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    notes = []
    if cuda:  # pragma: no cover - GPU only
        torch.cuda.set_device(local)  # before the process group: NCCL binds this rank to its GPU
    else:
        threads = threads_per_rank(local_world)
        torch.set_num_threads(threads)
        notes.append(f"{threads} intra-op thread(s) per rank: this host's cores shared by its {local_world} rank(s)")
        notes.append("gloo has no reduce-scatter: it runs an all-reduce of the whole tensor")
        notes.append("CPU timings of collectives do not transfer to GPUs; counts and bytes do")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        emit(out, {"event": "launch", "world_size": world, "backend": backend, "threads": torch.get_num_threads()})
        ctx = {"rank": rank, "world": world, "device": device, "out": out, "notes": notes, "local_world": local_world}
        for index, item in enumerate(spec["layouts"]):
            try:
                record = measure(index, item, spec["job"], spec, ctx)
            except (StepError, JobError) as e:  # raised alike on every rank before any collective of this layout
                record = {"index": index, "status": "refused", "reason": str(e)}
            emit(out, {"event": "done"} | record)
        emit(out, {"event": "finished"})
        dist.barrier()
    finally:
        _end_group()


def _end_group(wait_s: float = 10.0) -> None:
    """destroy_process_group, given ``wait_s`` seconds: on a failed rank its peers may sit in a collective and
    the teardown may block, and this process must still exit so torchrun learns of it."""
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(wait_s)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: torchrun then ends the other ranks
