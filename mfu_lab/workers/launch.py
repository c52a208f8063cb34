"""Launching step 2's DDP sweep through torchrun, and surviving workers that crash or hang.

All configurations run inside one launch, so start-up is paid once. A watchdog
reads the workers' progress file; when a launch makes no progress for
``comm_timeout_s`` it is ended, the configuration it was in is recorded as hung
(with each rank's stderr), and a new launch takes the configurations left. A
crash is handled the same way. A hook that hung or crashed at one bucket size
is not retried at smaller ones (more buckets), which are recorded as skipped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.device import release_device_memory
from mfu_lab.core.process import procs
from mfu_lab.core.process.progress import GAP_S
from mfu_lab.workers.comm_configs import config_key, is_fsdp, sweep_configs


def world_layout(job: Job, device_type: str) -> tuple[int, int]:
    """(nnodes, nproc_per_node): the job's, or one process per visible GPU, or 2 on CPU. A ``nproc_per_node`` this
    node cannot hold (above its GPUs; CPU ranks beyond its cores or memory) is a JobError (:func:`check_nproc`),
    before any launch."""
    if job.nproc_per_node:
        check_nproc(job, device_type)
        return job.nnodes, job.nproc_per_node
    if device_type == "cuda":
        import torch

        return job.nnodes, max(1, torch.cuda.device_count())
    return job.nnodes, 2


CPU_RANKS_PER_CORE = 4  # CPU ranks share the cores: beyond this many a core, the ranks only wait on each other
RANK_HOST_BYTES = 300e6  # a CPU rank's own memory before the model: the interpreter, torch, gloo (an estimate)


def check_nproc(job: Job, device_type: str, source: str | None = None, cgroup_root: Path | None = None,
                meminfo: Path | None = None) -> None:
    """Refuse, naming ``nproc_per_node``, ranks this node cannot hold (JobError from ``source``, by default the job
    layout), before any launch (:func:`world_layout` and ``mfu-lab validate`` both call it).

    CUDA: each rank takes a GPU of its own (``cuda:LOCAL_RANK``): not more ranks than this node's visible GPUs,
    instead of ranks that crash on an invalid device ordinal or NCCL's "Duplicate GPU detected". CPU: the ranks
    share the cores and the memory: not more than :data:`CPU_RANKS_PER_CORE` a core (:func:`host.usable_cores`,
    the cgroup's quota included), nor more than the memory available (:func:`host.available_memory`, the cgroup's
    limit included) holds at an estimated :data:`RANK_HOST_BYTES` a rank plus its share of the reference model's
    state (16 B a parameter over tp x pp, and over the FSDP ranks; a factory model is not imported here: step 1's
    fit check sizes it)."""
    if not job.nproc_per_node:
        return
    from mfu_lab.core.engine.layout_check import LAYOUT_SOURCE
    from mfu_lab.core.errors import JobError, JobProblem

    n, where = job.nproc_per_node, source or LAYOUT_SOURCE
    if device_type != "cuda":
        from mfu_lab.core.measure import host

        cores, how = host.usable_cores(cgroup_root)
        if n > CPU_RANKS_PER_CORE * cores:
            raise JobError(where, [JobProblem("nproc_per_node", n, (
                f"must be at most {CPU_RANKS_PER_CORE * cores} CPU ranks on this node ({CPU_RANKS_PER_CORE} a core "
                f"x {how}): CPU ranks share the cores, so more only wait on each other and take memory; use "
                f"nproc_per_node: 0 (2 on CPU) or {CPU_RANKS_PER_CORE * cores} or fewer"))])
        avail = host.available_memory(cgroup_root, meminfo)
        model, said = 0.0, "a factory model's state not counted here (step 1's fit check sizes it)"
        if job.uses_reference_model:
            params = job.n_layers * (12 * job.d_model ** 2 + 13 * job.d_model) + (
                job.vocab_size + job.seq_len + 2) * job.d_model
            split = job.tp * job.pp * (max(1, n * job.nnodes // (job.tp * job.pp)) if job.dp_mode == "fsdp" else 1)
            model = 16.0 * params / split
            said = f"+ {model / 1e6:,.1f} MB of model state (16 B x {params:,} parameters / {split})"
        need = n * (RANK_HOST_BYTES + model)
        if need > avail.bytes:
            most = max(1, int(avail.bytes // (RANK_HOST_BYTES + model)))
            raise JobError(where, [JobProblem("nproc_per_node", n, (
                f"{n} CPU ranks need about {need / 2 ** 30:.1f} GiB (an estimate: {RANK_HOST_BYTES / 1e6:.0f} MB "
                f"a rank for the interpreter and torch {said}, before activations), more than the "
                f"{avail.bytes / 2 ** 30:.2f} GiB available ({avail.how}); use nproc_per_node: {most} or fewer, "
                "or run where more memory is free"))])
        return
    import torch

    count = torch.cuda.device_count()
    if n > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise JobError(where, [JobProblem("nproc_per_node", n, (
            f"must be at most the {count} GPU(s) this node sees (torch.cuda.device_count() = {count}{seen}): each "
            f"rank takes a GPU of its own; use nproc_per_node: 0 (one per visible GPU) or {count} or fewer"))])


def full_factor(job: Job) -> float:
    """A full measurement's steps (warm-up, timed, profiled, no_sync) over a race's screening steps."""
    return (job.comm_warmup_steps + 2 * job.comm_steps + 1) / (job.comm_warmup_steps + job.race_steps)


@dataclass
class Launch:
    returncode: int | None  # None: ended by the watchdog
    events: list[dict]
    rank_stderr: dict[str, str]
    launcher_stderr: str
    seconds: float
    stalled: str = ""  # on a hang: which rank stopped where, from the ranks' heartbeats
    free_memory: dict | None = None  # the GPU memory free when the launch started (after the launcher let go)


def stalled_ranks(beats_dir: Path, now: float | None = None) -> str:
    """Name the rank(s) furthest behind from their heartbeat files (``ddp_worker.heartbeat``): the lowest
    (configuration, step) reached, with how long ago each last moved."""
    now = now or time.time()
    beats = []
    for p in sorted(Path(beats_dir).glob("rank*.json")):
        try:
            beats.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not beats:
        return "no rank reported a heartbeat (stuck before its first configuration: start-up or rendezvous)"
    low = min((b["config"], b["step"]) for b in beats)
    behind = [b for b in beats if (b["config"], b["step"]) == low]
    ahead = [b for b in beats if (b["config"], b["step"]) != low]
    def point(b):
        what = {-1: "starting it", 0: "building DDP / before its first step"}.get(b["step"], f"step {b['step']}")
        return f"configuration {b['config'] + 1}, {what}"

    text = "; ".join(f"rank {b['rank']} ({b['host']}) stopped at {point(b)}, last heard {now - b['t']:.0f} s ago"
                     for b in sorted(behind, key=lambda b: b["rank"]))
    if ahead:
        text += "; " + ", ".join(f"rank {b['rank']} reached {point(b)}" for b in sorted(ahead, key=lambda b: b["rank"]))
    elif len(beats) > 1:
        text += " (every rank stopped at the same point: a collective that never completed)"
    return text


STARTUP_S = 120.0  # the watchdog's allowance before the ranks' first event (torch's import and rendezvous)
RDZV_JOIN_S = 900.0  # several nodes: how long a node waits in rendezvous for the others (torchrun's join_timeout)


def startup_allowance(nnodes: int) -> float:
    """Seconds the watchdog allows before the ranks' first event: the no-progress clock (``comm_timeout_s``) starts
    at that event, not at the launch. One node: torch's imports on a busy host. Several: the rendezvous too, which
    waits for the slowest node (a cold compile, a node still in its NCCL timeout after a crash)."""
    return RDZV_JOIN_S + STARTUP_S if nnodes > 1 else STARTUP_S


def _torchrun_cmd(job: Job, nnodes: int, nproc: int, log_dir: Path, spec: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           f"--log-dir={log_dir}", "--redirects=3"]
    if nnodes == 1 and not job.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={job.rdzv_endpoint}", f"--rdzv_id=mfu-lab-{job.job_name}",
                f"--rdzv_conf=join_timeout={RDZV_JOIN_S:.0f}"]
    return cmd + ["-m", "mfu_lab.workers.ddp_rank", "--spec", str(spec)]


NOISE = ("[W", "W1", "I1", "USDT:")  # torch's warnings and the profiler's trace markers


def _rank_stderr(log_dir: Path, limit: int = 3000) -> dict[str, str]:
    out = {}
    for p in sorted(log_dir.rglob("stderr.log")):
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if not ln.startswith(NOISE)]
        out[f"rank {p.parent.name}"] = "\n".join(lines)[-limit:]
    return out


def error_lines(rank_stderr: dict[str, str]) -> str:
    """The last error line of each rank's stderr, e.g. 'rank 0: RuntimeError: ...'."""
    found = []
    for rank, text in rank_stderr.items():
        hits = [ln.strip() for ln in text.splitlines()
                if re.search(r"(Error|Exception|EnforceNotMet)", ln) and not ln.startswith(" ")
                or ln.strip().startswith("what():")]  # a C++ exception's message
        if hits:
            found.append(f"{rank}: {hits[-1][:400]}")
    return "; ".join(found)


def launch(job: Job, spec: dict, work: Path, attempt: int, nnodes: int, nproc: int, progress=None) -> Launch:
    """Run one torchrun launch of the worker; end it when it stalls for ``job.comm_timeout_s``."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(work), "timeout_s": job.comm_timeout_s}
    spec_path = work / f"spec_{attempt}.json"
    spec_path.write_text(json.dumps(spec))
    progress_file = work / "progress.jsonl"
    progress_file.unlink(missing_ok=True)
    for old in (work / "beats").glob("rank*.json"):  # this launch's heartbeats only
        old.unlink()
    log_dir = work / f"logs_{attempt}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": str(work / f"error_{attempt}.json")}
    env.setdefault("OMP_NUM_THREADS", "1")
    stderr_path = work / f"launcher_{attempt}.log"
    free = release_device_memory(spec.get("device_type", "cpu"))
    t0 = time.perf_counter()
    with open(stderr_path, "w") as err, procs.group():  # torchrun and its ranks end with this call, however it ends
        # SIGTERM first: torchrun then ends its ranks (each in a session of its own) before it exits; the ranks
        # also die with torchrun (procs.die_with_parent) and torchrun with this process (PDEATHSIG SIGTERM)
        proc = procs.popen(_torchrun_cmd(job, nnodes, nproc, log_dir, spec_path), stdout=err, stderr=err,
                           env={**env, **procs.launcher_env()}, cwd=os.getcwd(), death_signal=signal.SIGTERM,
                           grace_s=20.0)
        hung, seen, _ = watch(proc, progress_file, progress, job.comm_timeout_s, startup_allowance(nnodes))
        if hung:
            procs.kill(proc)  # SIGTERM, 20 s for torchrun to end its ranks, then SIGKILL
    events = _read(progress_file)
    if progress:
        for ev in events[seen:]:
            progress(ev)
    rc = None if hung else proc.returncode
    stalled = stalled_ranks(work / "beats") if rc is None else ""
    return Launch(rc, events, _rank_stderr(log_dir), stderr_path.read_text(errors="replace")[-3000:],
                  time.perf_counter() - t0, stalled, free)


def watch(proc, progress_file: Path, progress, timeout_s: float, startup_s: float = 0.0) -> tuple[bool, int, float]:
    """Follow a launch's progress file (the ranks' events, one JSON line each) until the process exits or makes no
    progress for ``timeout_s`` (at least ``startup_s`` before its first event: imports and rendezvous on a busy
    host), handing each new event to ``progress``; returns (hung, events handed on, the allowance in force).
    While no event comes for ``GAP_S`` seconds, ``progress`` also gets ``{"event": "quiet", "quiet_s": s}`` once per
    ``GAP_S`` (not counted in the events handed on), so a caller can say the launch is still alive. Once the ranks
    have written their ``finished`` event, no step is left to stall: their exit (gloo's or NCCL's teardown, torchrun's
    own) gets the start-up allowance too, as a busy host can take longer than ``timeout_s`` over it."""
    last_size, last_change, seen, allowed, ended = -1, time.monotonic(), 0, timeout_s, False
    last_quiet = last_change
    while proc.poll() is None:
        size = progress_file.stat().st_size if progress_file.exists() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
            events = _read(progress_file)
            ended = any(ev.get("event") == "finished" for ev in events)
            if progress:
                for ev in events[seen:]:
                    progress(ev)
                seen = len(events)
        elif progress and now - max(last_change, last_quiet) >= GAP_S:
            last_quiet = now
            progress({"event": "quiet", "quiet_s": now - last_change})
        allowed = timeout_s if size and not ended else max(timeout_s, startup_s)
        if time.monotonic() - last_change > allowed:
            return True, seen, allowed
        time.sleep(0.2)
    return False, seen, allowed


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written when the launch died
    return out


def one_rank_reason(nnodes: int, nproc: int, device_type: str) -> str:
    """Why a world of one rank has no data parallelism to tune, and how to run step 2 where it has."""
    where = ("this node shows one GPU" if device_type == "cuda" and nproc == 1 and nnodes == 1 else
             f"nnodes x nproc_per_node = {nnodes} x {nproc}")
    return (f"one rank ({where}): no gradient is all-reduced, so the DDP sweep and the all-reduce benchmark would "
            "measure noise. Run step 2 on a node with 2 or more GPUs (nproc_per_node: 0 takes every visible GPU) or "
            "across nodes (nnodes: N, launched by srun on each node; README, 'On a GPU node, and across nodes')")


@dataclass
class SweepOutcome:
    layout: dict
    allreduce: list[dict]
    outcomes: dict[tuple, dict] = field(default_factory=dict)  # config key -> event (done/unsupported/failed...)
    launches: list[dict] = field(default_factory=list)
    screened: dict[tuple, dict] = field(default_factory=dict)  # config key -> its screening's done event (a race)
    rounds: list[dict] = field(default_factory=list)  # a worker's own race decisions ("round" events), in order
    confirm: dict | None = None  # the worker's confirmation: what it confirmed, or why not ("confirm" event)
    turns: list[dict] = field(default_factory=list)  # the confirmation's turns ("turn" events), in the order run


def run_sweep(job: Job, device_type: str, attention: str | None, work: Path, progress=None,
              allreduce_max_bytes: int | None = None, fault: dict | list | None = None,
              configs: list[dict] | None = None,
              screen: int = 0, allreduce: bool = True, race: dict | None = None,
              confirm: dict | None = None, force_one_rank: bool = False) -> SweepOutcome:
    """Every configuration given (default: the job's whole sweep), relaunching past ones that hang or crash.

    ``screen``: a race's first round, each configuration timed for this many steps and nothing else (no profiled
    step, no sync check, no no_sync steps). ``race`` (with ``screen``): the worker then picks the finalists itself
    (:func:`mfu_lab.analysis.racing.finalists`; ``{"references": [names], "deadline": epoch seconds or None}``) and
    measures them in full in the same launch, so the race pays one start-up. Only the first launch races: after a
    crash or hang the relaunch screens what is left, and the caller picks and measures the finalists.
    ``confirm`` (``{"reference": name, "turns": n, "deadline": epoch seconds or None}``): after the full
    measurements the worker takes the step's pick by its rule (:func:`mfu_lab.workers.ddp_rank.pick_to_confirm`) and,
    when it is not the reference, alternates the two for ``turns`` turns in the same launch (first launch only).
    ``allreduce``: run the all-reduce benchmark in this launch. ``fault`` (tests only) makes one rank crash or hang
    at one configuration of the first launch: its index in ``configs`` (a race measures its references first, in full,
    at their own index), then the final round's finalists not measured yet and the confirmation's turns count on
    from ``len(configs)``.
    ``force_one_rank`` (benchmarks/gpu_check only): launch a world of one rank anyway. Its figures are not DDP's,
    but it takes every path of a launch (``set_device``, ``broadcast_object_list``, ``DDP(device_ids)``, the race,
    the confirmation, barrier and teardown) on a machine with one GPU, where two NCCL ranks cannot share it.
    """
    nnodes, nproc = world_layout(job, device_type)
    remaining = sweep_configs(job) if configs is None else list(configs)
    max_bytes = allreduce_max_bytes or (256 << 20 if device_type == "cuda" else 16 << 20)
    result = SweepOutcome({"nnodes": nnodes, "nproc_per_node": nproc, "world_size": nnodes * nproc,
                           "backend": "nccl" if device_type == "cuda" else "gloo"}, [])
    if nnodes * nproc < 2 and not force_one_rank:  # one rank: nothing to all-reduce, every figure would be noise
        why = one_rank_reason(nnodes, nproc, device_type)
        result.layout["skipped"] = why
        for cfg in remaining:
            result.outcomes[config_key(cfg)] = {"event": "skipped", "config": cfg, "error": why}
            if progress:
                progress(result.outcomes[config_key(cfg)])
        return result
    need_allreduce = allreduce
    attempt = 0
    while remaining or need_allreduce:
        spec = {"job": job.to_dict(), "device_type": device_type, "attention": attention, "configs": remaining,
                "allreduce_max_bytes": max_bytes if need_allreduce else None,
                "fault": fault if attempt == 0 else None, "screen": screen,
                "race": race if attempt == 0 and screen else None, "confirm": confirm if attempt == 0 else None}
        run = launch(job, spec, work / "screen" if screen else work, attempt, nnodes, nproc, progress)
        attempt += 1
        started, confirming = None, False
        for ev in run.events:
            kind = ev["event"]
            if kind == "allreduce":
                result.allreduce, need_allreduce = ev["rows"], False
            elif kind == "fp8":  # the job's fp8_layers in the ranks: converted, or why not (core.engine.fp8)
                result.layout["fp8"] = {k: v for k, v in ev.items() if k != "event"}
            elif kind == "memory":  # what each rank found free on its GPU
                result.layout.setdefault("free_memory", {})[str(ev["rank"])] = ev["free_bytes"]
            elif kind == "start":
                started = ev["config"]
            elif kind in ("done", "unsupported", "error", "dropped"):  # dropped: ruled out untimed (the bound)
                result.outcomes[config_key(ev["config"])] = ev
                if kind == "done" and ev.get("screen"):
                    result.screened[config_key(ev["config"])] = ev
                started = ev["config"] if kind == "error" else None  # an error ends its launch: that one failed
            elif kind == "round":
                result.rounds.append(ev)
            elif kind == "confirm":
                result.confirm, confirming = ev, not ev.get("done") and not ev.get("skipped")
            elif kind == "turn":
                result.turns.append(ev)
                started = None
        # finished: every measurement is in (workers.ddp_rank writes it after the last collective); an exit code or
        # a hang after it is the process group's teardown (gloo's, NCCL's), recorded beside the launch, not a failure
        finished = any(e["event"] == "finished" for e in run.events)
        result.launches.append({"attempt": attempt, "returncode": run.returncode, "seconds": run.seconds,
                                "finished": finished, "free_memory": run.free_memory})
        if finished:
            if run.returncode != 0:
                detail = error_lines(run.rank_stderr)
                result.launches[-1]["teardown"] = ("hung" if run.returncode is None else
                                                   f"exited with code {run.returncode}") + (
                    f" after every rank finished ({detail})" if detail else " after every rank finished")
            break
        why = (f"no progress (no finished step) for {job.comm_timeout_s:.0f} s: the launch was ended; {run.stalled}"
               if run.returncode is None
               else f"the launch exited with code {run.returncode}")
        stderr = "\n".join(f"--- {r} ---\n{t}" for r, t in run.rank_stderr.items() if t.strip()) or run.launcher_stderr
        if confirming:  # it ended in a confirmation's turn: every configuration was measured; the turns are not
            detail = error_lines(run.rank_stderr)
            result.confirm = dict(result.confirm, error=why + (f" ({detail})" if detail else ""))
            break
        if started is None:  # failed outside any configuration (start-up, rendezvous...): stop here
            for cfg in remaining:
                result.outcomes.setdefault(config_key(cfg), {"event": "failed", "config": cfg,
                                                             "error": f"{why} before this configuration ran",
                                                             "stderr": stderr})
            need_allreduce = False
            break
        status = "hung" if run.returncode is None else "failed"
        previous = result.outcomes.get(config_key(started), {})
        detail = error_lines(run.rank_stderr)
        result.outcomes[config_key(started)] = {"event": status, "config": started,
                                                "error": previous.get("error") or why + (f" ({detail})" if detail
                                                                                         else ""),
                                                "stderr": stderr}
        new = [result.outcomes[config_key(started)]]
        done = set(result.outcomes)
        rest = [c for c in remaining if config_key(c) not in done]
        for cfg in rest:  # smaller buckets of a hook that already hung or failed would only be worse
            if not is_fsdp(cfg) and cfg["hook"] == started.get("hook") and cfg["bucket_mb"] <= started["bucket_mb"]:
                result.outcomes[config_key(cfg)] = {
                    "event": "skipped", "config": cfg,
                    "error": f"not tried: {cfg['hook']} {status} at bucket {started['bucket_mb']} MB, and this "
                             "configuration has as many buckets or more"}
                new.append(result.outcomes[config_key(cfg)])
        if progress:
            for ev in new:
                progress(ev)
        remaining = [c for c in rest if config_key(c) not in result.outcomes]
    return result
