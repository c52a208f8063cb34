"""One rank of step 2's DDP sweep (and of step 3's per-rank profile); started by ``torchrun`` (see
mfu_lab.workers.launch), never by hand.

    python -m torch.distributed.run ... -m mfu_lab.workers.ddp_rank --spec SPEC.json

Local rank 0 of each node appends one JSON line per event to ``<out>/progress.jsonl``
(``out`` belongs to that node's launcher) as soon as it happens: "start", "done",
"unsupported", "error" per configuration, "step" per finished step, "allreduce" for
the bandwidth benchmark. Whatever finished survives a crash or a hang of a later
configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mfu_lab.analysis import racing
from mfu_lab.analysis.dp_family import loss_ok
from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.work import same_batches
from mfu_lab.core.engine.workload import GPT, build_loader, build_model, build_train_step, eager
from mfu_lab.core.job.schema import validate
from mfu_lab.core.measure.timed import run_steps, stats
from mfu_lab.core.process.procs import die_with_parent
from mfu_lab.core.thresholds import DDP_SYNC_TOLERANCE
from mfu_lab.workers import fsdp_candidate
from mfu_lab.workers.comm_configs import config_name, hook_of, is_fsdp
from mfu_lab.workers.launch import full_factor
from mfu_lab.workers.rank_events import emit, heartbeat, step_beat

BUS_FACTOR = "2 (n - 1) / n"  # nccl-tests' all-reduce bus bandwidth factor (PERFORMANCE.md)
POWERSGD_START_ITER = 2  # torch's powerSGD_hook all-reduces uncompressed below this iteration; at it, it allocates P, Q
DDP_REBUILD_STEPS = 2  # DDP rebuilds its buckets in the second forward (Reducer::rebuild_buckets)


def ddp_warmup(job_warmup: int, hook: str) -> int:
    """Untimed steps before any timed DDP step (screen, full measurement, no_sync, confirmation turn, step 3's trace,
    step 7's alternation): the job's warm-up, but at least DDP's bucket rebuild and, for PowerSGD, its
    uncompressed steps and its first compression (``start_powerSGD_iter + 1``), so that neither is timed."""
    return max(job_warmup, DDP_REBUILD_STEPS, POWERSGD_START_ITER + 1 if hook == "powersgd" else 0)


def register_hook(ddp: DDP, hook: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if hook == "none":
        return  # DDP's built-in C++ all-reduce
    if hook == "powersgd":
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                 start_powerSGD_iter=POWERSGD_START_ITER)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        return
    ddp.register_comm_hook(None, {"allreduce": dh.allreduce_hook, "fp16_compress": dh.fp16_compress_hook,
                                  "bf16_compress": dh.bf16_compress_hook}[hook])


def comm_time_from_profile(prof, device_type: str) -> float:
    """Seconds spent in all-reduce during the profiled step, from the profiler's events.

    GPU: NCCL kernels' device time. CPU: gloo's all-reduce events (the work as it runs
    on gloo's threads). Overlapping buckets are counted by their union, not their sum.
    """
    return fsdp_candidate.comm_seconds(prof, device_type, ("gloo:all_reduce", "gloo:allreduce"))


def params_checksum(model: torch.nn.Module) -> torch.Tensor:
    """Three sums over every parameter, in float64, on the parameters' own device."""
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    return torch.stack([flat.sum(), flat.abs().sum(), (flat * flat).sum()])


# Every collective of this worker goes through the three functions below, with the rank's device: a process group
# initialised with NCCL has no CPU backend ("No backend type associated with device type cpu").
def reduce_max(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks (a float64 all-reduce on ``device``)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every rank's ``t`` (moved to ``device`` for the collective)."""
    t = t.to(device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def in_sync(model: torch.nn.Module, device: torch.device) -> float:
    """Largest difference of parameter checksums between ranks (0.0: bitwise-equal sums)."""
    allv = gather(params_checksum(model), device)
    return float(max((a - allv[0]).abs().max() for a in allv).item())


def allreduce_benchmark(device: torch.device, max_bytes: int) -> list[dict]:
    """All-reduce time per message size; algbw = bytes / time, busbw = algbw x 2(n-1)/n (nccl-tests).

    CUDA (as nccl-tests does): after a barrier, ``k`` all-reduces back to back between two CUDA events, the mean
    per call one sample, so launch and host latency do not inflate small messages. CPU (gloo): one call per sample
    between host clocks. Every rank takes the slowest rank's figure: a collective is as slow as its slowest rank.
    """
    n = dist.get_world_size()
    cuda = device.type == "cuda"
    rows, size = [], 4096
    while size <= max_bytes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(x)  # warm-up: connection set-up and allocation

        def timed(samples, x=x, burst=20 if cuda else 1):
            out = []
            for _ in range(samples):
                dist.barrier()
                if cuda:  # pragma: no cover - GPU only
                    torch.cuda.synchronize(device)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(burst):
                        dist.all_reduce(x)
                    b.record()
                    b.synchronize()  # sync point: read the events once the burst has finished
                    out.append(a.elapsed_time(b) / 1e3 / burst)
                else:
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    out.append(time.perf_counter() - t0)
            return out

        times = timed(3)
        # Every rank must run the same number of collectives: agree on the count from the slowest rank.
        probe = reduce_max(statistics.median(times), device)
        times += timed(int(min(47, max(2, 0.3 / max(probe, 1e-9)))))
        sec = reduce_max(statistics.median(times), device)  # the collective is as slow as its slowest rank
        rows.append({"bytes": size, "time_s": sec, "algbw_gbps": size / sec / 1e9,
                     "busbw_gbps": size / sec / 1e9 * 2 * (n - 1) / n,
                     "method": "CUDA events around 20 back-to-back calls" if cuda else "perf_counter per call"})
        size *= 4
    return rows


def profile_ranks(p: dict, fresh_model, loader, device, local, cuda, job, rank, beat, out: Path) -> None:
    """Step 3: a few DDP steps under torch.profiler with one configuration; every rank writes its own trace."""
    from mfu_lab.core.measure.timed import profile_steps

    cfg = p["config"]
    ddp = DDP(fresh_model(), device_ids=[local] if cuda else None, bucket_cap_mb=cfg["bucket_mb"],
              gradient_as_bucket_view=cfg["grad_as_bucket_view"])
    register_hook(ddp, cfg["hook"])
    emit(out, {"event": "start", "config": cfg, "profile": True})
    ts = build_train_step(job, ddp, device.type)
    warm = ddp_warmup(p["warmup"], cfg["hook"])
    timings = profile_steps(ts, loader(warm + p["steps"]), device, warm, p["steps"],
                            Path(p["dir"]) / f"trace_rank{rank}.json.gz", beat)
    emit(out, {"event": "profiled", "config": cfg, "wall_s": timings.measured("wall_s"), "warmup_steps": warm})


def _inside(step, context):
    """``step`` with each optimizer step run inside ``context()``; it takes ``grad_accum`` micro-batches a step as
    ``step`` does (core.measure.timed feeds them to ``accumulate``)."""
    def run(x, y, **kw):
        with context():
            return step(x, y, **kw)

    def accumulate(parts):
        with context():
            return step.accumulate(parts)
    run.grad_accum, run.accumulate = getattr(step, "grad_accum", 1), accumulate
    return run


def kept_local(ddp, step):
    """``step`` with its gradients kept local (DDP's ``no_sync`` around the whole optimizer step): the same step
    with no communication at all."""
    return _inside(step, ddp.no_sync)


@contextlib.contextmanager
def _sleep_first(seconds: float):
    time.sleep(seconds)
    yield


def slowed(step, seconds: float):
    """``step`` with a sleep before each optimizer step (tests only: a configuration known to be slower)."""
    return _inside(step, lambda: _sleep_first(seconds))


def pick_to_confirm(full: dict[str, dict | None], confirm: dict, steps_per_turn: int) -> dict | None:
    """What to confirm after the full measurements: the step's pick (:func:`mfu_lab.analysis.racing.beyond_noise`
    over the configurations whose ranks stayed in sync) when it is not the reference; with ``skipped`` set when the
    turns would end past ``confirm["deadline"]``. None when the reference stands or was not measured."""
    figures = {}
    for name, ev in full.items():
        if ev and ev.get("event") == "done" and (ev.get("param_checksum_max_diff") or 0.0) <= DDP_SYNC_TOLERANCE \
                and loss_ok(ev, full.get(confirm["reference"]), confirm.get("loss_tolerance")):  # dp_family's rule
            st = stats(ev["wall_s"])
            figures[name] = (st.median, st.p10, st.p90)
    ref = confirm["reference"]
    pick = racing.beyond_noise(figures, ref) if ref in figures else None
    if pick is None or pick == ref:
        return None
    need = racing.confirm_seconds(confirm["turns"], steps_per_turn, max(figures[ref][0], figures[pick][0]))
    left = None if confirm.get("deadline") is None else confirm["deadline"] - time.time()
    skipped = "" if left is None or need <= left else (f"budget: {left:.0f} s of the step's share left, the "
                                                      f"confirmation needs about {need:.0f} s")
    return {"candidate": pick, "reference": ref, "turns": confirm["turns"], "skipped": skipped}


def one_pick(mine, world: int):
    """Rank 0's value of ``mine`` on every rank (``broadcast_object_list``): what each node's launcher chose on its
    own (its attention kernel) must be one choice across the launch, or the ranks would train different kernels."""
    if world < 2:
        return mine
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    die_with_parent()  # torchrun started this rank in a session of its own: it must not outlive torchrun
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(Path(ap.parse_args().spec).read_text())
    out = Path(spec["out"])
    cuda = torch.cuda.is_available() and spec["device_type"] == "cuda"
    backend = "nccl" if cuda else "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:  # pragma: no cover - GPU only: what this rank found free, once the launcher let go
        free, total = torch.cuda.mem_get_info(device)
        emit(out, {"event": "memory", "rank": rank, "free_bytes": free, "total_bytes": total})
    job = eager(validate(spec["job"], "step 2 worker spec"))  # DDP is measured eager
    # One attention kernel for every rank: each node's launcher raced attention on its own, so rank 0's pick holds
    own = spec.get("attention")
    spec["attention"] = one_pick(own, world)
    emit(out, {"event": "launch", "world_size": world, "backend": backend, "threads": torch.get_num_threads(),
               "attention": spec["attention"]} | ({"own_attention": own} if own != spec["attention"] else {}))

    said_fp8: list[bool] = []  # the fp8 event, once a launch

    def fresh_model():
        model = build_model(job).to(device).train()  # same seed on every rank: same initial weights
        if isinstance(model, GPT) and spec.get("attention"):
            from mfu_lab.analysis.attention import candidates

            impl = next(i for i in candidates(device.type, job.dtype) if i.name == spec["attention"])
            model.set_attention(impl.fn)
        applied = fp8_layers.apply(job, model, device.type)  # fp8_layers before the DDP or FSDP2 wrapper (torchao)
        if applied.asked and not said_fp8:  # what the job's fp8_layers did in these ranks, once a launch
            said_fp8.append(True)
            emit(out, {"event": "fp8", **applied.record()})
        return model

    # each rank its own shard: synthetic data by a seed of its own, the job's data split (core.engine.data)
    def loader(n):
        if job.data in ("synthetic", "synthetic_varlen"):
            return build_loader(dataclasses.replace(job, seed=job.seed + 7919 * (rank + 1)), n, device.type)
        return same_batches(job, n, device.type, rank=rank, world=world)

    if spec.get("allreduce_max_bytes"):
        emit(out, {"event": "allreduce", "rows": allreduce_benchmark(device, spec["allreduce_max_bytes"]),
                   "world_size": world, "backend": backend})

    steps, warm = job.comm_steps, job.comm_warmup_steps

    where = {"config": -1}

    beat = step_beat(out, rank, where, {})  # the launcher's watchdog sees progress, at most once a second

    # tests only, one fault or a list: {"config": index, "rank": r, "kind": "crash" | "hang"}, or {"kind": "slow",
    # "name": config name, "ms": m, "where": "both" (default) | "sync" | "no_sync"}: every such step of that
    # configuration sleeps m ms first (one the tests know is slower, or whose communication they know is exposed);
    # {"kind": "raise", "name": config name, "rank": r}: its steps raise on rank r (an error inside a measurement)
    faults = spec.get("fault") or []
    faults = faults if isinstance(faults, list) else [faults]

    def measure(index: int, cfg: dict, screen: int, tag: dict | None = None) -> dict | None:
        """One configuration: a fresh DDP model, then ``screen`` timed steps (a race's first round, or with ``tag``
        a confirmation's turn: its event kind and turn) or the full protocol (timed steps, a profiled step, the
        sync check, the same steps under no_sync). The event it emitted, or None when the backend refused it."""
        emit(out, {"event": "start", "config": cfg})
        where["config"] = index
        heartbeat(out, rank, index, -1)  # -1: starting the configuration
        for fault in faults:
            if fault.get("config") == index and fault.get("rank") == rank:
                if fault["kind"] == "crash":
                    raise RuntimeError(f"injected crash on rank {rank} (test fault)")
                time.sleep(10_000)  # injected hang
        heartbeat(out, rank, index, 0)  # 0: building DDP (its constructor waits for every rank), then the steps
        if is_fsdp(cfg):  # FSDP2, laid out by the job's own machinery (core.engine.parallelize), measured as DDP is
            ddp = fsdp_candidate.build(job, cfg, fresh_model(), device, world)
            ts = ddp.step
        else:
            ddp = DDP(fresh_model(), device_ids=[local] if cuda else None, bucket_cap_mb=cfg["bucket_mb"],
                      gradient_as_bucket_view=cfg["grad_as_bucket_view"])
            try:
                register_hook(ddp, cfg["hook"])
            except Exception as e:  # refused by this backend: record and go on
                emit(out, {"event": "unsupported", "config": cfg, "error": f"{type(e).__name__}: {e}"})
                return None
            ts = build_train_step(job, ddp, device.type)
        w = ddp_warmup(warm, hook_of(cfg))  # never the bucket rebuild nor PowerSGD's uncompressed steps
        slow = {f.get("where", "both"): f["ms"] / 1e3 for f in faults  # where: both | sync | no_sync steps
                if f.get("kind") == "slow" and f["name"] == config_name(cfg)}
        plain = ts = slowed(ts, slow["both"]) if "both" in slow else ts  # the step no_sync runs
        ts = slowed(ts, slow["sync"]) if "sync" in slow else ts
        if any(f.get("kind") == "raise" and f["name"] == config_name(cfg) and f.get("rank", rank) == rank
               for f in faults):
            ts = slowed(ts, -1.0)  # a negative sleep raises inside the timed steps: the error path, for real
        if screen:  # a race's first round or a confirmation's turn: the timed steps alone (analysis.racing)
            t = run_steps(ts, loader(w + screen), device, w, screen, beat)
            ev = {"event": "done", "config": cfg, "screen": True, "wall_s": t.measured("wall_s"),
                  "data_s": t.measured("data_s"), "warmup_steps": w}
            ev = ev if tag is None else {k: v for k, v in ev.items() if k != "screen"} | tag
            emit(out, ev)
            return ev
        try:
            t = run_steps(ts, loader(w + steps + 1), device, w, steps, beat)
            x, y = next(iter(loader(1)))
            with torch.profiler.profile() as prof:  # one extra step, profiled, for communication time
                t0 = time.perf_counter()
                ts(to_device(x, device), to_device(y, device))
                if cuda:
                    torch.cuda.synchronize()  # sync point: the step's kernels are inside the profile
                profiled_s = time.perf_counter() - t0
            comm = reduce_max((fsdp_candidate.comm_seconds if is_fsdp(cfg) else comm_time_from_profile)(
                prof, device.type), device)
            diff = None if is_fsdp(cfg) else in_sync(ddp.module, device)  # FSDP2 holds one copy, sharded

            local_step = kept_local(ddp, plain)  # bound now: the loop rebinds both names

            local_step = slowed(local_step, slow["no_sync"]) if "no_sync" in slow else local_step

            # Side by side with the timed steps above, after the sync check (local updates diverge the ranks); warmed
            # up like them: a fresh loader's first steps start its workers and pin-memory thread (issue 33, item 8)
            alone = run_steps(local_step, loader(w + steps), device, w, steps, beat)
        except Exception as e:
            emit(out, {"event": "error", "config": cfg, "error": f"{type(e).__name__}: {e}"})
            raise
        ev = {"event": "done", "config": cfg, "wall_s": t.measured("wall_s"), "data_s": t.measured("data_s"),
              "no_sync_wall_s": alone.measured("wall_s"), "comm_s": float(comm), "profiled_step_s": profiled_s,
              "param_checksum_max_diff": diff, "loss": t.loss[-1], "warmup_steps": w, "no_sync_warmup_steps": w}
        emit(out, ev)
        return ev

    def decide(choose):  # rank 0 decides, every rank acts on the same decision
        decision: list = [choose() if rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    configs, screen = spec["configs"], spec.get("screen") or 0
    by_name = {config_name(cfg): cfg for cfg in configs}
    race = spec.get("race") if screen else None
    full, bound = {}, ""  # a race measures its references in full first: it keeps them whatever their times
    refs = [i for i, cfg in enumerate(configs) if race and config_name(cfg) in race["references"]]
    for i in refs:
        full[config_name(configs[i])] = measure(i, configs[i], 0)
    if race and race.get("bound") in full:  # DDP's default: what the step's pick must beat beyond the noise
        ev = full[race["bound"]] or {}  # the same keys on every rank, so every rank takes part in decide()
        bound = decide(lambda: racing.exposure_bound(race["bound"], ev.get("wall_s") or [],
                                                     ev.get("no_sync_wall_s") or []))
    ruled = {name: bound for name, cfg in by_name.items() if bound and name not in full and not is_fsdp(cfg)}
    for name in ruled:  # an outcome of its own: a relaunch after a crash does not screen it again
        emit(out, {"event": "dropped", "config": by_name[name], "error": bound})
    t_screen = time.perf_counter()  # the screening alone: the final round's estimate is per screened candidate
    first = {config_name(cfg): measure(i, cfg, screen) for i, cfg in enumerate(configs)
             if i not in refs and config_name(cfg) not in ruled}
    full, index = (full if screen else first), len(configs)
    if race:  # the race's final round in this launch
        spent = time.perf_counter() - t_screen
        left = None if race.get("deadline") is None else race["deadline"] - time.time()
        samples = {k: ev["wall_s"] for k, ev in (first | full).items() if ev}
        kept, dropped, cut = decide(lambda: racing.finalists(samples, race["references"], spent, full_factor(job),
                                                             left, measured=set(full)))
        emit(out, {"event": "round", "number": 1, "kept": kept, "dropped": dropped | ruled, "cut": cut,
                   "seconds": spent, "bound": bound})
        t_final = time.perf_counter()
        for name in kept:
            if name not in full:
                full[name], index = measure(index, by_name[name], 0), index + 1
        emit(out, {"event": "round", "number": 2, "kept": kept, "dropped": {}, "cut": [],
                   "seconds": time.perf_counter() - t_final})
    confirm = spec.get("confirm")
    if confirm and full:  # the step's pick by its own rule, measured again beside the reference, alternating
        d = decide(lambda: pick_to_confirm(full, confirm, max(ddp_warmup(warm, hook_of(c)) for c in configs) + steps))
        if not d:  # the reference stands: said, so every node's step follows this decision, not its own figures
            emit(out, {"event": "confirm", "candidate": None, "reference": confirm["reference"], "done": True})
        else:
            emit(out, {"event": "confirm"} | d)
            if not d["skipped"]:
                t_confirm = time.perf_counter()
                for turn in range(1, d["turns"] + 1):  # ABBA: R P, P R, R P... so a steady drift lands on both
                    pair = (d["reference"], d["candidate"])
                    for name in pair if turn % 2 else pair[::-1]:
                        measure(index, by_name[name], steps, {"event": "turn", "turn": turn})
                        index += 1
                emit(out, {"event": "confirm", "done": True, "seconds": time.perf_counter() - t_confirm} | d)
    if spec.get("profile"):
        profile_ranks(spec["profile"], fresh_model, loader, device, local, cuda, job, rank, beat, out)
    # finished: rank 0 did all its work, and every other rank passed the last collective it takes part in (a
    # decision's broadcast), so what fails after this line is the process group's teardown, not a measurement
    emit(out, {"event": "finished"})
    dist.barrier()
    dist.destroy_process_group()
    if any(f.get("kind") == "teardown" and f.get("rank") == rank for f in faults):  # tests: a failing teardown
        raise RuntimeError(f"injected teardown failure on rank {rank} (test fault)")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # Exit at once: a normal exit waits on the process group's teardown, which hangs while the
        # other ranks sit in a collective, and torchrun would never learn that this rank died.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
