"""Issue 48, the fourth round of attacks: the data's side. A damaged peak cache, unbounded cluster files, caches
that outlive the code they came from, later batches and losses nobody checked, and the monitor across threads and
forks. Each test is an attack that got through; each asserts what a user sees now."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import textwrap
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from mfu_lab.core.errors import StepError
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import peak_cache

from .conftest import TINY, in_process

CPU = dev.DeviceInfo("cpu", "test cpu", None, None, 1)


# ------------------------------------------------------------------ Medium 6: a damaged peak cache
@pytest.fixture
def fake_peak(tmp_path, monkeypatch):
    """A cache in tmp_path; a full measurement that reads 10 GFLOP/s and counts its calls; steady probes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    state = {"measures": 0}

    def measure(dtype, device="cpu", **kw):
        state["measures"] += 1
        return 10e9, f"fake measurement of {dtype}"

    monkeypatch.setattr(dev, "measure_matmul_peak", measure)
    monkeypatch.setattr(peak_cache, "probe_rates", lambda dtype, device_type="cpu": [5e9] * 5)
    return state


def _damaged_entry(**bad):
    cond = peak_cache.conditions("cpu", CPU.name, "float32")
    entry = {"flops_per_s": 10e9, "how": "fake", "probe_flops_per_s": 5e9, "probe_n": peak_cache.probe_n("float32"),
             "measured_at": "2024-01-01T00:00:00+00:00", "date": "2024-01-01", "conditions": cond, **bad}
    return peak_cache.key_of(cond), entry


@pytest.mark.parametrize("bad", [{"flops_per_s": "fast"}, {"flops_per_s": float("nan")},
                                 {"flops_per_s": float("inf")}, {"probe_flops_per_s": "x"},
                                 {"probe_flops_per_s": float("inf")}, {"flops_per_s": -1.0},
                                 {"flops_per_s": True}, {"date": None}],
                         ids=["string", "nan", "infinity", "probe-string", "probe-infinity", "negative", "bool",
                              "no-date"])
def test_a_damaged_peak_cache_entry_is_measured_again_and_rewritten(fake_peak, bad):
    key, entry = _damaged_entry(**bad)
    path = peak_cache.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"peaks": {key: entry}}))  # json writes NaN and Infinity as such
    peak = dev.resolve_peak(CPU, "float32", None)
    assert peak.flops_per_s == 10e9 and fake_peak["measures"] == 1
    assert str(path) in peak.note and "damaged" in peak.note
    kept = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} left in the cache"))
    assert kept["peaks"][key]["flops_per_s"] == 10e9 and math.isfinite(kept["peaks"][key]["probe_flops_per_s"])
    assert peak_cache.recheck_now("cpu", CPU.name, "float32").verdict == "steady"  # the rewritten entry is used


@pytest.mark.parametrize("text", ["[" * 100_000, "\xff\xfe not json"], ids=["deep", "binary"])
def test_an_unreadable_peak_cache_file_is_measured_again(fake_peak, text):
    path = peak_cache.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("latin-1"))
    assert dev.resolve_peak(CPU, "float32", None).flops_per_s == 10e9
    assert peak_cache.recheck_now("cpu", CPU.name, "float32") is not None  # rewritten whole


# ------------------------------------------------------------------ Medium 10: cluster files read with no bound
BASE = "gpu: H100 SXM\ngpus_per_node: 8\nintra_node_gbps: 360\nnode_network_gbps: 400\n"


def _validate(cluster):
    return in_process("validate", TINY, "-p", f"cluster={cluster}")


def test_a_binary_topology_conf_exits_2_naming_the_key_and_utf8(tmp_path):
    (tmp_path / "t.conf").write_bytes(b"SwitchName=s0 Nodes=gpu\xff\xfe[1-2]\n")
    (tmp_path / "c.yaml").write_text(BASE + "topology_conf: t.conf\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2, p.stderr
    assert "'topology_conf'" in p.stderr and "UTF-8" in p.stderr and "t.conf" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_binary_nvidia_smi_matrix_exits_2_naming_the_key(tmp_path):
    (tmp_path / "topo.txt").write_bytes(b"\x00\x81GPU0\n")
    (tmp_path / "c.yaml").write_text(BASE + "switches: 1\nnodes_per_switch: 2\nnvidia_smi_topo: topo.txt\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2 and "'nvidia_smi_topo'" in p.stderr and "UTF-8" in p.stderr, p.stderr


@pytest.mark.parametrize("size", [2_000_000, 3 * 2**30], ids=["2MB", "3GiB-sparse"])
def test_an_oversized_topology_conf_is_refused_before_it_is_read(tmp_path, size):
    conf = tmp_path / "t.conf"
    with open(conf, "wb") as f:
        f.write(b"# a comment line\n" * 1000 + b"SwitchName=s0 Nodes=gpu[1-2]\n")
        f.truncate(size)  # the rest a hole: nothing written, nothing read
    (tmp_path / "c.yaml").write_text(BASE + "topology_conf: t.conf\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2, p.stderr
    assert "'topology_conf'" in p.stderr and f"{size:,} bytes" in p.stderr and "at most" in p.stderr


@pytest.mark.parametrize("switches, per", [(1000, 1000), (100_000, 100_000)], ids=["1e6", "1e10"])
def test_switches_times_nodes_per_switch_is_bounded(tmp_path, switches, per):
    (tmp_path / "c.yaml").write_text(BASE + f"switches: {switches}\nnodes_per_switch: {per}\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2, p.stderr
    assert "'switches'" in p.stderr and "nodes_per_switch" in p.stderr and "at most 100,000 nodes" in p.stderr


def test_a_topology_conf_expanding_to_too_many_nodes_is_refused(tmp_path):
    (tmp_path / "t.conf").write_text("".join(f"SwitchName=s{i} Nodes=n{i}x[0-99999]\n" for i in range(3)))
    (tmp_path / "c.yaml").write_text(BASE + "topology_conf: t.conf\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2, p.stderr
    assert "'Nodes'" in p.stderr and "at most 100,000 nodes" in p.stderr and "t.conf, line 2" in p.stderr


def test_nodes_times_gpus_per_node_is_bounded(tmp_path):
    (tmp_path / "c.yaml").write_text(BASE.replace("gpus_per_node: 8", "gpus_per_node: 100000")
                                     + "switches: 10\nnodes_per_switch: 10\n")
    p = _validate(tmp_path / "c.yaml")
    assert p.returncode == 2 and "'gpus_per_node'" in p.stderr and "GPUs" in p.stderr, p.stderr


# ------------------------------------------------------------------ Medium 11: stale caches
def _module(folder, name, text):
    """Write a module of the job's own and forget any earlier import of it: a later process imports the file."""
    (folder / f"{name}.py").write_text(textwrap.dedent(text))
    sys.modules.pop(name, None)


DATA = """
    import torch
    from torch.utils.data import DataLoader

    def data():
        return DataLoader([torch.full((32,), {fill}) for _ in range(8)], batch_size=4)
"""


def test_cached_batches_are_drawn_again_after_the_data_factorys_code_changed(tiny_job, tmp_path):
    from mfu_lab.core.engine.work import same_batches

    name = "attacks4_batches"
    _module(tmp_path, name, DATA.format(fill=1))
    job = dataclasses.replace(tiny_job, data=f"{name}:data", factory_paths=[str(tmp_path)])
    assert all(int(b[0].max()) == 1 for b in same_batches(job, 2, "cpu"))
    _module(tmp_path, name, DATA.format(fill=2))  # the factory edited between two runs
    assert all(int(b[0].max()) == 2 for b in same_batches(job, 2, "cpu"))


LOSS = """
    def heavy(output, batch):
        out = output.float()
        for _ in range({times}):
            out = out @ out.transpose(-1, -2) / 1000
        return out.mean()
"""


def _count(job):
    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.measure.flops import count_step_flops, job_key_extra

    model = build_model(job)
    x, y = next(iter(build_loader(job, 1, "cpu")))
    return count_step_flops(model, build_train_step(job, model, "cpu"), x, y, cache_dir=job.output_root(),
                            key_extra=job_key_extra(job)).counted_flops_per_step


def test_the_flop_cache_is_keyed_on_the_loss_and_its_source(tiny_job, tmp_path):
    name = "attacks4_loss"
    plain = _count(tiny_job)
    _module(tmp_path, name, LOSS.format(times=1))
    job = dataclasses.replace(tiny_job, loss=f"{name}:heavy", factory_paths=[str(tmp_path)])
    once = _count(job)
    assert once > plain  # the loss's own matmul counted, not the cross-entropy job's count served from the cache
    _module(tmp_path, name, LOSS.format(times=2))
    assert _count(job) > once  # its source edited: counted again


# ------------------------------------------------------------------ Low 14: later batches
BATCHES = """
    import torch

    def _pair(x):
        x = torch.as_tensor(x).long()
        return x, x.clone()

    good = lambda: _pair(torch.arange(32).repeat(4, 1))

    def negative():
        x, y = good()
        x[1, 3] = -7
        return [good(), (x, y)]

    def past_vocab():
        x, y = good()
        x[0, 0] = 500
        return [good(), good(), (x, y)]

    def target_past_vocab():
        x, y = good()
        y[2, 5] = 128
        return [good(), (x, y)]

    def too_long():
        return [good(), _pair(torch.arange(40).repeat(4, 1))]

    def empty():
        return [good(), _pair(torch.zeros(4, 0))]

    def vector(output, batch):
        return output.float().mean(dim=-1)

    def nothing(output, batch):
        return None
"""


@pytest.fixture
def batches_module(tmp_path):
    _module(tmp_path, "attacks4_batches_bad", BATCHES)
    return tmp_path


@pytest.mark.parametrize("factory, index, key, words", [
    ("negative", 2, "data", "token id -7"),
    ("past_vocab", 3, "vocab_size", "token id 500"),
    ("target_past_vocab", 2, "vocab_size", "target 128"),
    ("too_long", 2, "seq_len", "40 tokens"),
    ("empty", 2, "data", "empty"),
])
def test_a_bad_later_batch_names_its_index_and_the_key(tiny_job, batches_module, factory, index, key, words):
    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.measure.timed import run_steps

    job = dataclasses.replace(tiny_job, data=f"attacks4_batches_bad:{factory}", factory_paths=[str(batches_module)])
    model = build_model(job)
    with pytest.raises(StepError) as e:
        run_steps(build_train_step(job, model, "cpu"), build_loader(job, 4, "cpu"), torch.device("cpu"), 0, 4)
    msg = str(e.value)
    assert f"batch {index} " in msg and f"'{key}'" in msg and words in msg, msg


@pytest.mark.parametrize("loss, words", [("vector", "shape (4, 32)"), ("nothing", "NoneType")])
def test_a_loss_that_is_not_one_number_names_the_key(tiny_job, batches_module, loss, words):
    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step

    job = dataclasses.replace(tiny_job, loss=f"attacks4_batches_bad:{loss}", factory_paths=[str(batches_module)])
    model = build_model(job)
    x, y = next(iter(build_loader(job, 1, "cpu")))
    with pytest.raises(StepError) as e:
        build_train_step(job, model, "cpu")(x, y)
    msg = str(e.value)
    assert "'loss'" in msg and "attacks4_batches_bad:" + loss in msg and words in msg and "one number" in msg, msg


# ------------------------------------------------------------------ Low 15: the monitor across threads and forks
def _records(folder):
    return [json.loads(line) for f in folder.glob("*.jsonl") for line in f.read_text().splitlines()]


def test_step_on_two_threads_leaves_no_counting_mode_on_either(tmp_path):
    from mfu_lab.monitor import Monitor

    hooks_before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    model = torch.nn.Linear(8, 8)
    mon = Monitor(tmp_path / "mon", model=model, peak_flops=1e12, profile_every_s=None, every=2)

    def train():
        model(torch.randn(4, 8)).sum().backward()
        mon.step(tokens=4)

    opened, moved, seen = threading.Event(), threading.Event(), {}

    def first_thread():
        train()  # step 1: the FLOP window opens on this thread
        opened.set()
        moved.wait(30)
        model(torch.randn(4, 8))  # this thread's next forward: what it left is taken off its stack
        seen["after"] = list(_get_current_dispatch_mode_stack())

    t = threading.Thread(target=first_thread)
    t.start()
    opened.wait(30)
    for _ in range(4):
        train()  # step 2 onwards on this thread
    seen["main"] = list(_get_current_dispatch_mode_stack())
    moved.set()
    t.join(30)
    mon.close()
    assert seen == {"main": [], "after": []}
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == hooks_before  # no tracker hook left
    assert "flops" not in mon.errors, mon.errors
    flops = [r for r in _records(tmp_path / "mon") if r["kind"] == "flops"]
    assert [r["source"] for r in flops] == ["counted"] and "another thread" in flops[0]["rejected_windows"][0]["why"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_records_nothing_and_keeps_no_counting_mode(tmp_path):
    from mfu_lab.monitor import Monitor

    model = torch.nn.Linear(8, 8)
    mon = Monitor(tmp_path / "mon", model=model, peak_flops=1e12, profile_every_s=None, every=2)

    def train():
        model(torch.randn(4, 8)).sum().backward()
        mon.step(tokens=4)

    train()  # step 1: the FLOP window is open when the process forks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child goes on with the loop
        try:
            left = len(_get_current_dispatch_mode_stack())
            for _ in range(5):
                train()
            mon.close()
            os.write(write, json.dumps([left, len(_get_current_dispatch_mode_stack())]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = json.loads(f.read() or "null")
    os.waitpid(pid, 0)
    for _ in range(5):
        train()
    mon.close()
    assert child == [0, 0]  # the child's thread held no counting mode, right after the fork and at its end
    recs = _records(tmp_path / "mon")
    assert len(list((tmp_path / "mon").glob("*.jsonl"))) == 1
    assert [r["kind"] for r in recs].count("end") == 1 and [r["kind"] for r in recs].count("start") == 1
    assert sum(r["steps"] for r in recs if r["kind"] == "interval") == 4  # the parent's 6 steps less 2 untimed
