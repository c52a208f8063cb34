"""The DDP sweep for real: two gloo processes through torchrun on CPU."""

import dataclasses

import pytest

from mfu_lab.workers.launch import config_key, run_sweep, sweep_configs

pytestmark = pytest.mark.e2e


def small(job, **kw):
    base = dict(comm_hooks=["none", "fp16_compress", "bf16_compress"], comm_bucket_mb=[0.05, 25],
                comm_grad_as_bucket_view=[False], comm_steps=2, comm_warmup_steps=1, comm_timeout_s=60.0)
    return dataclasses.replace(job, **(base | kw))


def test_sweep_runs_records_refusals_and_keeps_ranks_in_sync(tiny_job, tmp_path):
    job = small(tiny_job)
    r = run_sweep(job, "cpu", None, tmp_path, allreduce_max_bytes=1 << 16)
    assert r.layout == {"nnodes": 1, "nproc_per_node": 2, "world_size": 2, "backend": "gloo"}
    assert r.launches[-1]["finished"] and len(r.launches) == 1
    for cfg in sweep_configs(job):
        ev = r.outcomes[config_key(cfg)]
        if cfg["hook"] == "bf16_compress":  # gloo refuses it; the sweep goes on
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
    from mfu_lab.steps.attention_comm import _comm_rows

    job = small(tiny_job, nproc_per_node=1)
    seen = []
    r = run_sweep(job, "cpu", None, tmp_path, progress=seen.append)
    assert r.launches == [] and r.allreduce == [] and "one rank" in r.layout["skipped"]
    assert all(r.outcomes[config_key(c)]["event"] == "skipped" for c in sweep_configs(job))
    assert len(seen) == len(sweep_configs(job))  # the progress lines still say what happened to each
    rows = _comm_rows(sweep_configs(job), r, 1e9, 1e12, 1)
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
