"""The DDP sweep for real: two gloo processes through torchrun on CPU."""

import dataclasses

import pytest

from mfu_lab.workers.comm_configs import bf16_hook_allowed, config_key, config_name, is_fsdp, sweep_configs
from mfu_lab.workers.launch import run_sweep

pytestmark = pytest.mark.e2e


def small(job, **kw):
    base = dict(comm_hooks=["none", "fp16_compress", "bf16_compress"], comm_bucket_mb=[0.05, 25],
                comm_grad_as_bucket_view=[False], comm_steps=2, comm_warmup_steps=1, comm_timeout_s=60.0)
    return dataclasses.replace(job, **(base | kw))


def test_sweep_runs_records_refusals_and_keeps_ranks_in_sync(tiny_job, tmp_path):
    """With fp8_layers, the ranks say once what the conversion did (on a CPU: trained without it, and why)."""
    job = small(tiny_job, fp8_layers=["mlp_up"])
    r = run_sweep(job, "cpu", None, tmp_path, allreduce_max_bytes=1 << 16)
    fp8 = r.layout.pop("fp8")
    assert fp8["groups"] == ["mlp_up"] and fp8["layers"] == [] and fp8["why_not"].startswith("a CPU has no FP8")
    assert fp8["text"].startswith("fp8_layers [mlp_up] not applied: a CPU has no FP8 matmul units")
    assert r.layout == {"nnodes": 1, "nproc_per_node": 2, "world_size": 2, "backend": "gloo"}
    assert r.launches[-1]["finished"] and len(r.launches) == 1
    for cfg in sweep_configs(job):
        ev = r.outcomes[config_key(cfg)]
        if cfg["hook"] == "bf16_compress" and not bf16_hook_allowed():  # a CPU build refuses it; the sweep goes on
            assert ev["event"] == "unsupported" and "NCCL" in ev["error"]
        else:
            assert ev["event"] == "done", ev
            assert ev["param_checksum_max_diff"] == 0.0
            assert len(ev["wall_s"]) == 2 and len(ev["no_sync_wall_s"]) == 2 and ev["comm_s"] > 0
    sizes = [row["bytes"] for row in r.allreduce]
    assert sizes == [4096, 16384, 65536]
    for row in r.allreduce:  # nccl-tests: busbw = algbw x 2(n-1)/n, n = 2
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_a_crashing_or_hanging_rank_is_recorded_and_the_sweep_goes_on(tiny_job, tmp_path, kind):
    job = small(tiny_job, comm_hooks=["none", "fp16_compress"], comm_timeout_s=8.0)
    configs = sweep_configs(job)  # none 25, none 0.05, fp16 25, fp16 0.05
    r = run_sweep(job, "cpu", None, tmp_path, allreduce_max_bytes=4096,
                  fault={"config": 0, "rank": 1, "kind": kind})
    bad = r.outcomes[config_key(configs[0])]
    assert bad["event"] == ("failed" if kind == "crash" else "hung")
    if kind == "crash":
        assert "injected crash on rank 1" in bad["stderr"]
        assert "rank 1: RuntimeError: injected crash on rank 1" in bad["error"]
        assert r.launches[0]["seconds"] < 30  # ended by torchrun, not by the watchdog
    else:
        assert "for 8 s" in bad["error"]
        # the heartbeats name the rank that hung, and where the other one waited
        assert "rank 1 (" in bad["error"] and "stopped at configuration 1, starting it" in bad["error"]
        assert "rank 0 reached configuration 1, building DDP" in bad["error"]
    skipped = r.outcomes[config_key(configs[1])]  # same hook, smaller bucket
    assert skipped["event"] == "skipped" and "none" in skipped["error"]
    assert [r.outcomes[config_key(c)]["event"] for c in configs[2:]] == ["done", "done"]  # in a new launch
    assert len(r.launches) == 2 and r.launches[-1]["finished"]


def test_two_nodes_rendezvous_through_an_endpoint(tiny_job, tmp_path):
    """nnodes=2 as under srun: two launchers (here on one machine) meet at rdzv_endpoint."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = small(tiny_job, comm_hooks=["none"], comm_bucket_mb=[25], nnodes=2, nproc_per_node=1,
                rdzv_endpoint=f"127.0.0.1:{port}")
    results = {}

    def node(i):
        results[i] = run_sweep(job, "cpu", None, tmp_path / f"node{i}", allreduce_max_bytes=4096)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in results.values():
        assert r.layout["world_size"] == 2
        ev = r.outcomes[("none", 25.0, False)]
        assert ev["event"] == "done" and ev["param_checksum_max_diff"] == 0.0
    assert len(results) == 2


def test_one_rank_skips_the_sweep_and_the_benchmark_without_a_launch(tiny_job, tmp_path):
    from mfu_lab.steps.attention_comm.comm_rows import comm_rows_of

    job = small(tiny_job, nproc_per_node=1)
    seen = []
    r = run_sweep(job, "cpu", None, tmp_path, progress=seen.append)
    assert r.launches == [] and r.allreduce == [] and "one rank" in r.layout["skipped"]
    assert all(r.outcomes[config_key(c)]["event"] == "skipped" for c in sweep_configs(job))
    assert len(seen) == len(sweep_configs(job))  # the progress lines still say what happened to each
    rows = comm_rows_of(sweep_configs(job), r, 1e9, 1e12, 1)
    assert {row.status for row in rows} == {"skipped"} and "nproc_per_node" in rows[0].error


class _Recorded(Exception):
    pass


def test_every_collective_of_the_ddp_worker_gets_the_ranks_device(monkeypatch):
    """NCCL has no CPU backend: a tensor made on the CPU (or moved there) before a collective crashes step 2 on
    GPUs. Here the rank's device is 'meta', so any tensor the worker forgot to place shows up as 'cpu'."""
    import torch

    from mfu_lab.workers import ddp_rank as dr

    seen = []

    def record(*tensors):
        for t in tensors:
            seen.extend(x.device for x in (t if isinstance(t, list) else [t]))
        raise _Recorded

    monkeypatch.setattr(dr.dist, "all_reduce", lambda t, op=None: record(t))
    monkeypatch.setattr(dr.dist, "all_gather", lambda out, t: record(out, t))
    monkeypatch.setattr(dr.dist, "get_world_size", lambda: 2)
    meta = torch.device("meta")
    for call in (lambda: dr.reduce_max(1.0, meta), lambda: dr.in_sync(torch.nn.Linear(2, 2, device="meta"), meta),
                 lambda: dr.allreduce_benchmark(meta, 4096)):
        with pytest.raises(_Recorded):
            call()
    assert len(seen) >= 4 and set(seen) == {meta}


def test_the_worker_never_rebinds_the_local_rank_it_gives_ddp():
    """On CUDA, DDP(model, device_ids=[local]) runs once per configuration: the worker once stored the no_sync
    timings under the same name, so every configuration after the first got device_ids=[<Timings>] and crashed
    (CPU runs pass device_ids=None, so only a GPU would see it). The name keeps the local rank for the whole run."""
    import ast
    import inspect

    from mfu_lab.workers import ddp_rank as dr

    tree = ast.parse(inspect.getsource(dr.main))
    main = tree.body[0]
    bound = [n for n in ast.walk(main) if isinstance(n, ast.Name) and n.id == "local" and isinstance(n.ctx, ast.Store)]
    assert len(bound) == 1, [n.lineno for n in bound]  # local = int(os.environ.get("LOCAL_RANK", 0)), and only that


def _race(job, tmp_path, fault=None):
    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.attention_comm import comm_race

    return comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 16,
                              reference=("none", 25.0, False), clock=Clock(None), fault=fault)


# DDP's default with 30 ms of communication exposed in each synced step (a test fault): the bound
# (racing.exposure_bound) cannot rule the others out, so these tests see the race whatever the machine's gloo does
EXPOSED = {"kind": "slow", "name": "none/25MB/copy", "where": "sync", "ms": 30}


def test_a_race_screens_and_measures_its_finalists_in_one_launch(tiny_job, tmp_path):
    """Issue 20, one start-up per kind of worker: the worker picks the finalists itself, by the launcher's rule."""
    job = small(tiny_job, comm_hooks=["none", "allreduce", "fp16_compress"], comm_bucket_mb=[1, 25])
    # and rank 0 fails after its finished event (a test fault): the launch's teardown, recorded, not a failed launch
    sweep, log, configs = _race(job, tmp_path, fault=[EXPOSED, {"kind": "teardown", "rank": 0}])
    assert len(sweep.launches) == 1 and sweep.launches[0]["finished"], sweep.launches
    assert sweep.launches[0]["teardown"].startswith("exited with code 1 after every rank finished")
    assert "injected teardown failure" in sweep.launches[0]["teardown"]
    screened, final = log.rounds
    # the factor screen: the job's own none/25MB, the two other hooks at 25 MB, none at 1 MB (not their product, 6)
    assert len(screened.medians) == len(configs) == 4 and "none/25MB/copy" in final.medians  # the reference stays
    assert set(final.medians) == set(screened.kept) and set(screened.dropped) | set(screened.kept) == set(
        screened.medians)
    for name in screened.kept:  # measured in full in the same launch: the timed, no_sync and profiled steps
        ev = sweep.outcomes[config_key(next(c for c in configs if config_name(c) == name))]
        assert ev["event"] == "done" and not ev.get("screen") and len(ev["no_sync_wall_s"]) == job.comm_steps
    for name in screened.dropped:
        ev = sweep.outcomes[config_key(next(c for c in configs if config_name(c) == name))]
        assert ev["event"] == "dropped" and len(ev["wall_s"]) == job.race_steps  # its screening figures, kept


def test_a_crash_in_the_final_round_is_recorded_and_the_other_finalists_still_measured(tiny_job, tmp_path):
    # the job's own configuration is a second reference: at least two finalists, whatever the screen measured
    job = small(tiny_job, comm_hooks=["none", "allreduce"], comm_bucket_mb=[1, 25], ddp_hook="allreduce",
                ddp_bucket_mb=1.0, comm_screen="product")
    n = 4  # screened configurations: the finalists' indices count on from here
    slow = [dict(EXPOSED, name=ref) for ref in ("none/25MB/copy", "allreduce/1MB/copy")]  # the leader: not a reference
    sweep, log, configs = _race(job, tmp_path, fault=[{"config": n, "rank": 1, "kind": "crash"}, *slow])
    assert len(configs) == n
    first, *others = log.rounds[0].kept
    assert others and {"none/25MB/copy", "allreduce/1MB/copy"} <= set(log.rounds[0].kept)
    crashed = sweep.outcomes[config_key(next(c for c in configs if config_name(c) == first))]
    assert crashed["event"] == "failed" and "injected crash" in crashed["stderr"]
    # the references were measured first, in the racing launch: a relaunch only for a finalist after the crash
    unreached = [k for k in others if k not in ("none/25MB/copy", "allreduce/1MB/copy")]
    assert len(sweep.launches) == 1 + bool(unreached)
    for name in others:
        ev = sweep.outcomes[config_key(next(c for c in configs if config_name(c) == name))]
        assert ev["event"] == "done" and not ev.get("screen"), ev


def test_a_race_confirms_its_pick_in_the_same_launch(tiny_job, tmp_path):
    """Screen, final round and confirmation: one start-up. DDP's default is made 40 ms slower per step (a test
    fault), so the race's pick clears it and is measured again beside it, alternating, in that launch."""
    job = small(tiny_job, comm_hooks=["none", "allreduce"], comm_bucket_mb=[1, 25])
    sweep, log, configs = _race(job, tmp_path, fault=dict(EXPOSED, ms=40))
    assert len(sweep.launches) == 1 and sweep.launches[0]["finished"], sweep.launches
    assert sweep.confirm["reference"] == "none/25MB/copy" and sweep.confirm["done"]
    ref, pick = "none/25MB/copy", sweep.confirm["candidate"]
    assert [config_name(ev["config"]) for ev in sweep.turns] == [ref, pick, pick, ref, ref, pick]  # ABBA


def test_when_the_references_communication_is_hidden_no_ddp_configuration_is_screened(tiny_job, tmp_path):
    """The bound (racing.exposure_bound): DDP's default steps no faster without communication (its no_sync steps
    sleep 30 ms more, a test fault), so no bucket size, hook or view can be picked over it: none is screened, the
    FSDP2 candidates (which also shard the optimizer's work) still are, and one launch does it all."""
    job = small(tiny_job, comm_hooks=["none", "allreduce"], comm_bucket_mb=[1, 25], comm_fsdp_reshard=[True],
                comm_fsdp_prefetch=[0], comm_fsdp_reduce_dtype=["float32"])
    sweep, log, configs = _race(job, tmp_path, fault=dict(EXPOSED, where="no_sync"))
    assert len(sweep.launches) == 1 and sweep.launches[0]["finished"], sweep.launches
    ddp = [config_name(c) for c in configs if not is_fsdp(c)]
    fsdp = [config_name(c) for c in configs if is_fsdp(c)]
    assert len(ddp) == 3 and len(fsdp) == 1
    first = log.rounds[0]
    for other in ddp[1:]:  # not the reference: ruled out untimed, with the figures that rule it out
        why = first.dropped[other]
        assert why.startswith("cannot be faster here") and "no_sync" in why and first.medians[other] is None
        assert sweep.outcomes[config_key(next(c for c in configs if config_name(c) == other))]["event"] == "dropped"
    assert first.medians["none/25MB/copy"] is not None and first.medians[fsdp[0]] is not None
    ref = sweep.outcomes[config_key(configs[0])]
    assert ref["event"] == "done" and len(ref["no_sync_wall_s"]) == job.comm_steps  # in full, first
    assert "2 DDP configuration(s) not screened: cannot be faster here" in log.text()


def test_an_error_inside_a_references_measurement_fails_it_and_the_race_goes_on(tiny_job, tmp_path):
    """The references are measured first, in full: an exception inside their steps (a test fault on rank 1) is
    that configuration's failure, and a relaunch screens and measures the others, not 'failed before it ran'."""
    # 100 MB: fewer buckets than the failed 25 MB, so the relaunch tries it (smaller ones it would skip, by rule)
    job = small(tiny_job, comm_hooks=["none", "allreduce"], comm_bucket_mb=[25, 100])
    sweep, log, configs = _race(job, tmp_path, fault=[{"kind": "raise", "name": "none/25MB/copy", "rank": 1}])
    ref = sweep.outcomes[config_key(configs[0])]
    assert config_name(configs[0]) == "none/25MB/copy"
    assert ref["event"] == "failed" and "ValueError" in ref["error"] + ref.get("stderr", ""), ref
    assert len(sweep.launches) >= 2
    for c in configs[1:]:
        ev = sweep.outcomes[config_key(c)]
        assert ev["event"] in ("done", "dropped") and "before this configuration ran" not in ev.get("error", ""), ev


def test_the_exposure_bound_is_the_formula_on_the_medians():
    from mfu_lab.analysis.racing import exposure_bound

    assert exposure_bound("ref", [1.00, 1.02, 1.04], [0.99, 1.00, 1.01]) != ""  # 2% exposed: inside the 3% band
    assert exposure_bound("ref", [1.00, 1.02, 1.04], [0.97, 0.98, 0.99]) == ""  # (1.02 - 0.98) / 1.02 = 3.9%
    assert "+2.0%" in exposure_bound("ref", [1.00, 1.02, 1.04], [0.99, 1.00, 1.01])  # (1.02 - 1.00) / 1.02
    assert exposure_bound("ref", [1.0], []) == ""  # nothing measured without communication: no bound


@pytest.mark.parametrize("finished", [True, False])
def test_a_launch_whose_ranks_have_finished_may_take_longer_to_exit_than_a_step(tmp_path, finished):
    """After the ranks' ``finished`` event no step is left to stall: a slow exit (1.5 s here, against a 0.5 s
    no-progress limit) is waited out, not ended as hung; the same pause before that event is a hang."""
    import subprocess
    import sys

    from mfu_lab.workers.launch import watch

    progress = tmp_path / "progress.jsonl"
    last = '{"event": "finished"}' if finished else '{"event": "done"}'
    code = (f"import time; f = open({str(progress)!r}, 'a'); f.write('{{\"event\": \"start\"}}\\n' + {last!r} + '\\n');"
            " f.close(); time.sleep(1.5)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        hung, _, allowed = watch(proc, progress, None, timeout_s=0.5, startup_s=60.0)
    finally:
        proc.kill()
        proc.wait()
    assert hung is (not finished)
    assert allowed == (60.0 if finished else 0.5)
