"""The collective counter against the closed forms, layout by layout.

One torchrun launch (gloo, world 2, tests/fixtures/count_ranks.py) trains a tiny GPT three steps in each of 14
layouts built directly with PyTorch's APIs (fully_shard, parallelize_module, pipelining); each rank's third step
(the steady state) is held against mfu_lab.analysis.layouts.terms EXACTLY. The launch takes about 30 s on this
2-core machine (35 s for the whole file); the in-process test with the fake process group under a second.
The launch runs in its own session and is killed with its ranks when the test ends, however it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mfu_lab.analysis.layouts import terms as lt
from mfu_lab.core.measure.commcount import CollectiveCounter

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "fixtures" / "count_ranks.py"
LAYOUTS = ("ddp", "fsdp", "fsdp-noreshard", "fsdp-rootreshard", "fsdp-bf16", "tp", "tp-sp", "tp-ckpt",
           "tp-ckpt-full", "tp-sp-ckpt", "tp-sp-ckpt-full", "pp-gpipe", "pp-1f1b", "pp-interleaved")


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """{layout: [rank 0's, rank 1's] {"facts", "steps"}} from one launch."""
    out = tmp_path_factory.mktemp("counts")
    log = out / "launch.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--log-dir={out / 'logs'}", str(SCRIPT), str(out), ",".join(LAYOUTS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:  # torchrun and every rank: none outlives the test, even when it timed out or failed
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    assert rc == 0, log.read_text()[-4000:]
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)] for name in LAYOUTS}


def steady(counted: dict, layout: str, rank: int) -> dict:
    return counted[layout][rank]["steps"][-1]["summary"]


def facts(counted: dict, layout: str) -> dict:
    return counted[layout][0]["facts"]


def test_ddp_all_reduces_every_gradient_once(counted):
    f = facts(counted, "ddp")
    for rank in range(2):
        assert steady(counted, "ddp", rank) == {"allreduce": {"count": 1, "bytes": lt.ddp_all_reduce_bytes(
            f["params"], 4)}}  # one bucket: 222 kB is under DDP's 1 MB first bucket
    # the second step's forward rebuilds the buckets in gradient order: two small broadcasts, once
    assert counted["ddp"][0]["steps"][1]["summary"]["broadcast"]["count"] == 2


@pytest.mark.parametrize("layout, param_bytes, reshard, root_explicit", [
    ("fsdp", 4, True, False), ("fsdp-noreshard", 4, False, True), ("fsdp-rootreshard", 4, True, True),
    ("fsdp-bf16", 2, True, False)])
def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(counted, layout, param_bytes, reshard,
                                                               root_explicit):
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    f = facts(counted, layout)
    # torch 2.13 reshards the root only when told explicitly; older releases never do
    root_reshards = root_explicit and hasattr(FSDPState(), "_auto_reshard_after_forward")
    groups = f["layers"] + 1  # a group per block and the root's own (embeddings, final norm, head)
    gathers = groups * 2 if reshard and root_reshards else f["layers"] * 2 + 1 if reshard else groups
    for rank in range(2):
        assert steady(counted, layout, rank) == {
            "allgather": {"count": gathers, "bytes": lt.fsdp_all_gather_bytes(
                f["params"], param_bytes, reshard, f["root_params"], root_reshards)},
            "reduce_scatter": {"count": groups, "bytes": lt.fsdp_reduce_scatter_bytes(f["params"], 4)}}


@pytest.mark.parametrize("layout, sp, ckpt, early_stop", [
    ("tp", False, False, True), ("tp-ckpt", False, True, True), ("tp-ckpt-full", False, True, False),
    ("tp-sp", True, False, True), ("tp-sp-ckpt", True, True, True), ("tp-sp-ckpt-full", True, True, False)])
def test_tensor_parallel_per_layer(counted, layout, sp, ckpt, early_stop):
    f = facts(counted, layout)
    b, s, h, layers = f["b"], f["s"], f["h"], f["layers"]
    per_layer = lt.tp_bytes_per_layer(b, s, h, 4, sp, ckpt, early_stop)
    calls = lt.tp_collectives_per_layer(sp, ckpt, early_stop)
    expected = {k: {"count": layers * calls[k], "bytes": layers * per_layer[k]} for k in per_layer}
    if sp:
        # entering and leaving the sequence-parallel region: one all-gather of b*s*h each
        edge = lt.sp_boundary_bytes(b, s, h, 4)["allgather"]
        expected["allgather"] = {"count": expected["allgather"]["count"] + 2,
                                 "bytes": expected["allgather"]["bytes"] + edge}
        # the partial LayerNorm gradients (ln1, ln2: weight and bias, h each per layer) all-reduced in opt.step
        norms = lt.sp_norm_grad_all_reduces(4 * layers, 4 * layers * h, 4)
        expected["allreduce"] = {"count": norms["count"], "bytes": norms["bytes"]}
    for rank in range(2):
        assert steady(counted, layout, rank) == expected


def test_tensor_parallel_by_hand(counted):
    """The same figures worked by hand: b=4, s=16, h=32, float32, 4 layers."""
    bsh = 4 * 16 * 32 * 4  # 8192 bytes per collective
    assert steady(counted, "tp", 0) == {"allreduce": {"count": 16, "bytes": 16 * bsh}}
    assert steady(counted, "tp-ckpt", 0)["allreduce"]["count"] == 20  # 5 per layer
    assert steady(counted, "tp-ckpt-full", 0)["allreduce"]["count"] == 24  # 6 per layer: Megatron's
    sp = steady(counted, "tp-sp", 0)
    assert sp["reduce_scatter"] == {"count": 16, "bytes": 16 * bsh}
    assert sp["allgather"] == {"count": 18, "bytes": 18 * bsh}
    assert sp["allreduce"] == {"count": 48, "bytes": 48 * 32 * 4}


@pytest.mark.parametrize("layout, v", [("pp-gpipe", 1), ("pp-1f1b", 1), ("pp-interleaved", 2)])
def test_pipeline_sends_per_rank(counted, layout, v):
    f = facts(counted, layout)
    p, m = f["p"], f["m"]
    one = lt.p2p_send_bytes(f["b"] // m, f["s"], f["h"], 4)
    sends = [lt.p2p_sends_of_rank(r, p, m, v) for r in range(p)]
    assert sum(sends) / p == lt.p2p_sends_per_rank(p, m, v)
    for rank in range(2):
        n = sends[rank]
        assert steady(counted, layout, rank) == {"send": {"count": n, "bytes": n * one},
                                                 "recv": {"count": n, "bytes": n * one}}
    assert sends == ([12, 12] if v == 2 else [4, 4])  # 2*m*(p*v-1)/p at p=2, m=4
    # the first step also sends the stages' shapes (metadata objects): more sends than the steady state
    assert counted[layout][0]["steps"][0]["summary"]["send"]["count"] > sends[0]


@pytest.fixture
def fake_world():
    """An in-process world of 4 ranks on torch's fake backend (collectives do nothing): the byte rules without a
    launch."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_byte_convention_in_process(fake_world):
    import torch.distributed._functional_collectives as fc
    t = torch.ones(8)  # 32 bytes
    with CollectiveCounter() as c:
        dist.all_gather_into_tensor(torch.empty(32), t)  # output: 4 x 32
        dist.reduce_scatter_tensor(torch.empty(2), t)  # input: 32
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.send(t, 1)
        dist.recv(t, 1)
        pending = [fc.all_gather_tensor(t, 0, dist.group.WORLD),  # functional: input x group size
                   fc.reduce_scatter_tensor(t, "sum", 0, dist.group.WORLD)]
        for x in pending:
            x.wait()
        dist.all_to_all_single(torch.empty(8), t)
    assert c.summary() == {"allgather": {"count": 2, "bytes": 256}, "reduce_scatter": {"count": 2, "bytes": 64},
                           "allreduce": {"count": 1, "bytes": 32}, "broadcast": {"count": 1, "bytes": 32},
                           "send": {"count": 1, "bytes": 32}, "recv": {"count": 1, "bytes": 32},
                           "alltoall": {"count": 1, "bytes": 32}}
    assert {r.group_size for r in c.records} == {4}
    assert c.summary(group="no such group") == {}
    with CollectiveCounter() as quiet:
        (t * 2).sum()
    assert quiet.summary() == {} and quiet.records == []


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_all_reduce_taking_a_max_is_counted_apart(fake_world):
    """FP8 scales' amax under tensor parallel are max all-reduces: through c10d (torch.distributed's eager API) and
    the functional collectives (torchao's tensor_to_amax, DTensor's Partial("max")) alike, each with its reduce op."""
    import torch.distributed._functional_collectives as fc
    t = torch.ones(2, dtype=torch.float64)  # 16 bytes
    with CollectiveCounter() as c:
        dist.all_reduce(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        fc.all_reduce(t, "MAX", dist.group.WORLD).wait()
        fc.all_reduce(t, "sum", dist.group.WORLD).wait()
    assert c.summary() == {"allreduce": {"count": 3, "bytes": 48}, "allreduce_max": {"count": 2, "bytes": 32}}
    assert [r.reduce_op for r in c.records] == ["sum", "max", "min", "max", "sum"]
