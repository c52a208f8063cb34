"""Issue 33, items 2, 3, 8, 9 and 11: peaks per (dtype, matmul precision), DDP warm-up, exposed-comm medians,
dead verify rungs, nproc_per_node against the visible GPUs."""

from pathlib import Path

import pytest

from mfu_lab.core.errors import DeviceError
from mfu_lab.core.measure import device as dev

T = 1e12
H200 = dev.DeviceInfo("cuda", "NVIDIA H200", 0, "9.0", None)
UNKNOWN_GPU = dev.DeviceInfo("cuda", "NVIDIA GeForce GTX 1080", 0, "6.1", None)
CPU = dev.DeviceInfo("cpu", "test cpu", None, None, 1)


# ------------------------------------------------------------------ item 2: the peak each rung is measured against
def test_a_scalar_override_is_for_the_jobs_own_dtype_only():
    assert dev.resolve_peak(H200, "float32", 5e13, "highest", "float32", "highest").flops_per_s == 5e13
    # a bf16 rung of a float32 job with a float32 override: the datasheet's bf16 row, not the fp32 override
    p = dev.resolve_peak(H200, "bfloat16", 5e13, "highest", "float32", "highest")
    assert p.flops_per_s == 989.4 * T and p.source == "datasheet" and "H200" in p.note
    # without job_dtype a scalar stays what it was: the override for the dtype asked (the job's own)
    assert dev.resolve_peak(H200, "bfloat16", 7e14).flops_per_s == 7e14


def test_a_tf32_rung_gets_the_tf32_peak_not_the_float32_one():
    assert dev.resolve_peak(H200, "float32", None, "high").flops_per_s == 494.7 * T
    assert dev.resolve_peak(H200, "float32", None, "highest").flops_per_s == 67 * T
    # the job's float32 override is for its true float32: a TF32 rung does not carry it
    assert dev.resolve_peak(H200, "float32", 6e13, "high", "float32", "highest").flops_per_s == 494.7 * T


def test_a_mapping_gives_one_peak_per_dtype():
    peaks = {"float32": 6.7e13, "bfloat16": 9.9e14}
    assert dev.resolve_peak(UNKNOWN_GPU, "bfloat16", peaks, "highest", "float32", "highest").flops_per_s == 9.9e14
    assert dev.resolve_peak(UNKNOWN_GPU, "float32", peaks, "highest", "float32", "highest").flops_per_s == 6.7e13
    with pytest.raises(DeviceError, match="peak_flops"):  # no row and no override for float16: asks, never guesses
        dev.resolve_peak(UNKNOWN_GPU, "float16", peaks, "highest", "float32", "highest")


def test_a_cpu_dtype_without_an_override_is_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the measured-peak cache, if any, stays in this test
    monkeypatch.setattr(dev, "measure_matmul_peak", lambda dtype, *a, **k: (1e10, f"stand-in {dtype}"))
    p = dev.resolve_peak(CPU, "bfloat16", {"float32": 5e9}, "highest", "float32", "highest")
    assert p.source == "measured" and p.flops_per_s == pytest.approx(1e10, rel=0.5)
    assert dev.resolve_peak(CPU, "float32", {"float32": 5e9}).flops_per_s == 5e9


def test_peak_flops_per_dtype_from_a_job_file_and_from_the_command_line(tmp_path):
    from mfu_lab.commands.common import parse_overrides
    from mfu_lab.core.errors import JobError
    from mfu_lab.core.job.schema import load_job

    p = tmp_path / "job.yaml"
    p.write_text("peak_flops: {float32: 6.7e13, bfloat16: 9.9e14}\n")
    assert load_job(p).peak_flops == {"float32": 6.7e13, "bfloat16": 9.9e14}  # 6.7e13 is text to YAML 1.1
    p.write_text("peak_flops: 989e12\n")
    over = parse_overrides(["peak_flops={float32: 6.7e13, bfloat16: 9.9e14}"])
    assert load_job(p, over).peak_flops == {"float32": 6.7e13, "bfloat16": 9.9e14}
    with pytest.raises(JobError) as e:
        load_job(p, parse_overrides(["peak_flops={float32: 6.7e13, tf32: 4.9e14}"]))
    msg = str(e.value)
    assert "command line" in msg and "peak_flops" in msg and "'tf32'" in msg and "float32, bfloat16, float16" in msg
    with pytest.raises(JobError, match=r"item bfloat16: -1.*finite number > 0"):
        load_job(p, parse_overrides(["peak_flops={bfloat16: -1}"]))


def _rung(name, dtype, peak, row, speedup=2.0):
    from mfu_lab.steps.verify.rungs import Rung

    return Rung(name, {}, "ok", dtype=dtype, peak_flops_per_s=peak, peak_source="datasheet", peak_precision=row,
                mfu=0.3, speedup=speedup, speedup_low=speedup * 0.9, speedup_high=speedup * 1.1)


def test_step7_keys_peaks_by_dtype_and_matmul_precision_on_a_gpu(tiny_job):
    import dataclasses

    from mfu_lab.steps.verify import rungs, staircase

    job = dataclasses.replace(tiny_job, dtype="float32", matmul_precision="highest", peak_flops=6.0e13)
    wanted = {("float32", "highest"), ("float32", "high"), ("bfloat16", "high")}
    peaks = rungs._peaks(job, H200, wanted, lambda *a: None)
    assert peaks[("float32", "highest")][:2] == (6.0e13, "datasheet")  # the job's own override, for its own peak
    assert peaks[("float32", "high")] == (494.7 * T, "datasheet", "tf32")  # TF32 rung: TF32's row, not the override
    assert peaks[("bfloat16", "high")] == (989.4 * T, "datasheet", "bf16")  # never the fp32 override
    # the same-peak warning shows for the TF32 rung, naming the rows
    before, after = _rung("original", "float32", 6.0e13, "fp32", 1.0), _rung("precision", "float32", 494.7 * T, "tf32")
    text = staircase.headline(before, after, [before, after], {"status": "ok"})["text"]
    assert "own precision's peak (fp32, then tf32)" in text and "8.2x" in text and "compare the speedup" in text


def test_step7_on_a_gpu_without_a_row_takes_the_mapping_and_says_what_it_needs(tiny_job):
    import dataclasses

    from mfu_lab.steps.verify import rungs, staircase

    job = dataclasses.replace(tiny_job, dtype="float32", matmul_precision="highest",
                              peak_flops={"float32": 6.7e13, "bfloat16": 9.9e14})
    peaks = rungs._peaks(job, UNKNOWN_GPU, {("float32", "highest"), ("bfloat16", "highest"),
                                            ("float16", "highest")}, lambda *a: None)
    assert peaks[("float32", "highest")][0] == 6.7e13 and peaks[("bfloat16", "highest")][0] == 9.9e14
    value, source, row = peaks[("float16", "highest")]
    assert value is None and "no peak_flops for float16" in source and "GTX 1080" in source and row == "fp16"
    before, after = _rung("original", "float32", 6.7e13, "fp32", 1.0), _rung("precision", "float16", None, "fp16")
    after.peak_source, after.mfu = source, None
    text = staircase.headline(before, after, [before, after], {"status": "ok"})["text"]
    assert "no MFU without a peak" in text and "float16" in text


# ------------------------------------------------------------------ item 3: DDP's warm-up, wherever DDP is timed
def test_ddp_warmup_covers_the_bucket_rebuild_and_powersgds_uncompressed_steps():
    from mfu_lab.workers.ddp_rank import DDP_REBUILD_STEPS, POWERSGD_START_ITER, ddp_warmup

    assert (DDP_REBUILD_STEPS, POWERSGD_START_ITER) == (2, 2)
    assert ddp_warmup(0, "none") == ddp_warmup(1, "fp16_compress") == 2  # the second forward rebuilds the buckets
    assert ddp_warmup(1, "powersgd") == 3  # iterations 0, 1 all-reduce uncompressed; 2 is the first compression
    assert ddp_warmup(5, "powersgd") == ddp_warmup(5, "none") == 5  # the job's own warm-up when it is longer


def test_a_launch_warms_up_each_configuration_by_the_rule_and_records_it(tiny_job, tmp_path):
    """Two configurations, nothing to race: each measured in full, its timed and no_sync steps after the warm-up
    the rule gives (the job asks for none), recorded in the worker's events."""
    import dataclasses

    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.attention_comm import comm_race
    from mfu_lab.workers.comm_configs import config_key

    job = dataclasses.replace(tiny_job, comm_hooks=["none", "powersgd"], comm_bucket_mb=[25],
                              comm_grad_as_bucket_view=[False], comm_steps=2, comm_warmup_steps=0,
                              comm_timeout_s=60.0)
    sweep, _, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 16,
                                           reference=("none", 25.0, False), clock=Clock(None))
    want = {"none": 2, "powersgd": 3}
    assert any(not sweep.outcomes[config_key(c)].get("screen") for c in configs)  # a full measurement ran
    for cfg in configs:
        ev = sweep.outcomes[config_key(cfg)]
        assert ev["event"] == "done", ev
        assert ev["warmup_steps"] == want[cfg["hook"]] and len(ev["wall_s"]) == job.comm_steps
        if not ev.get("screen"):
            assert ev["no_sync_warmup_steps"] == want[cfg["hook"]] and len(ev["no_sync_wall_s"]) == job.comm_steps


def test_step7s_ddp_check_records_the_warmup_of_each_configuration(tiny_job, monkeypatch, tmp_path):
    import dataclasses

    from mfu_lab.analysis.tuning import Change
    from mfu_lab.steps.verify import ddp as verify_ddp
    from mfu_lab.workers.alternate import Alternation
    from mfu_lab.workers.comm_configs import config_key

    job = dataclasses.replace(tiny_job, comm_warmup_steps=1, verify_rounds=2)
    chosen = [Change("communication", "attention_comm", "ddp_hook", "none", "powersgd", "test", "measured")]
    original, tuned = verify_ddp.ddp_configs(job, chosen)
    walls = {config_key(original): [1.0, 1.1, 1.0, 1.2], config_key(tuned): [0.5, 0.6, 0.5, 0.55]}
    monkeypatch.setattr(verify_ddp, "world_layout", lambda job, device_type: (1, 2))
    monkeypatch.setattr(verify_ddp, "alternate", lambda *a, **k: Alternation(
        walls, [config_key(original), config_key(tuned)] * 2))
    r = verify_ddp.verify_ddp(job, "cpu", chosen, tmp_path, lambda *a: None)
    assert r["status"] == "ok" and r["warmup_steps"] == {"original": 2, "tuned": 3}


# ------------------------------------------------------------------ item 8: exposed communication from medians
def test_the_ddp_ledger_takes_medians_so_a_slow_first_no_sync_step_does_not_hide_communication():
    from mfu_lab.steps.attention_comm.comm_rows import CommRow, ddp_ledger_of

    # with communication: 100 ms steps; under no_sync 80 ms, but the first no_sync step started the loader (400 ms)
    ev = {"wall_s": [0.100, 0.101, 0.099, 0.100, 0.300], "data_s": [0.010, 0.010, 0.011, 0.010, 0.200],
          "no_sync_wall_s": [0.400, 0.080, 0.080, 0.081, 0.079]}
    ledger = ddp_ledger_of(CommRow("none", 25.0, False, "ok", mfu=0.3), ev, 2, None, "test")
    parts = {i.name: i.fraction for i in ledger.items}
    assert parts["structure"] == pytest.approx((0.100 - 0.080) / 0.100)  # medians: 20% exposed
    assert parts["software"] == pytest.approx(0.010 / 0.100)
    # means would have read 0.140 - 0.144 < 0: exposed clamped to 0, communication hidden
    assert parts["mfu"] == 0.3


# ------------------------------------------------------------------ item 9: step 7's rung processes
def test_writing_to_a_dead_rungs_process_is_a_runtime_error_naming_its_exit(tmp_path, tiny_job):
    from mfu_lab.workers.verify_rung import RungProcess

    spec = {"rung": "broken", "job": tiny_job.to_dict() | {"model": "no_such_module:factory"}, "steps_total": 2}
    p = RungProcess(spec, tmp_path, 120)
    try:
        with pytest.raises(RuntimeError, match="no_such_module"):
            p.ready()
        p.proc.wait(timeout=60)  # exited: its stdin's reader is gone
        with pytest.raises(RuntimeError, match=r"rung broken: the process exited \(code 1; (BrokenPipeError|"
                                               r"OSError|ValueError)"):
            p.run(1)
    finally:
        p.close()


def test_a_rung_whose_pipe_breaks_is_recorded_failed_and_the_step_goes_on(tiny_job, monkeypatch):
    import dataclasses

    from mfu_lab.steps.verify import rungs
    from mfu_lab.steps.verify import step as verify

    from .test_verify import _store, step2

    job = dataclasses.replace(tiny_job, verify_rounds=3, verify_steps=1, verify_warmup_steps=0)
    _store(job, "attention_comm", step2(attention="unfused"))
    specs, real_init, real_run = [], rungs.RungProcess.__init__, rungs.RungProcess.run

    def init(self, spec, work, timeout_s, env=None):
        specs.append(spec)
        real_init(self, spec, work, timeout_s, env)

    def run(self, steps):
        if self.name == "attention" and getattr(self, "_seen", False):
            raise BrokenPipeError(32, "Broken pipe")  # its process died: the parent's write finds stdin closed
        self._seen = True
        return real_run(self, steps)

    monkeypatch.setattr(rungs.RungProcess, "__init__", init)
    monkeypatch.setattr(rungs.RungProcess, "run", run)
    r = verify.run(job, write=False)
    orig, att = r.rungs
    assert att.status == "failed" and "during the rounds" in att.reason and "Broken pipe" in att.reason
    assert orig.status == "ok" and len(orig.wall_s) == 3
    # a CPU process gets no share of a device; on CUDA each rung's share is its need's (tests/test_memory_share.py)
    assert [(s["memory_fraction"], s["release"]) for s in specs] == [(None, False), (None, False)]


# ------------------------------------------------------------------ item 11: nproc_per_node against the GPUs
def test_nproc_per_node_above_the_visible_gpus_is_a_job_error_before_any_launch(tiny_job, monkeypatch):
    import dataclasses

    import torch

    from mfu_lab.core.errors import JobError
    from mfu_lab.workers import alternate, launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(alternate, "launch", lambda *a, **k: launched.append(a))
    job = dataclasses.replace(tiny_job, nproc_per_node=4)
    with pytest.raises(JobError) as e:
        launch.world_layout(job, "cuda")
    msg = str(e.value)
    assert "nproc_per_node" in msg and "4" in msg and "2 GPU(s)" in msg
    with pytest.raises(JobError, match="nproc_per_node"):  # step 7's DDP alternation: refused before torchrun
        alternate.alternate(job, "cuda", None, [{"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False}], 1,
                         Path("/nonexistent"))
    assert launched == []
    assert launch.world_layout(dataclasses.replace(tiny_job, nproc_per_node=2), "cuda") == (1, 2)  # up to the count
    assert launch.world_layout(dataclasses.replace(tiny_job, nproc_per_node=0), "cuda") == (1, 2)  # one per GPU
    assert launch.world_layout(job, "cpu") == (1, 4)  # CPU ranks share the CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(JobError, match="CUDA_VISIBLE_DEVICES='0,1'"):
        launch.world_layout(job, "cuda")


def test_step7_refuses_the_job_before_starting_anything(tiny_job, monkeypatch):
    import dataclasses

    import torch

    from mfu_lab.core.errors import JobError
    from mfu_lab.steps.verify import rungs
    from mfu_lab.steps.verify import step as verify

    from .test_verify import _store, step2

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(verify.dev, "resolve_device", lambda requested: H200)
    monkeypatch.setattr(rungs, "_fp8_reason", lambda device: "a stand-in GPU")
    monkeypatch.setattr(rungs, "_peaks", lambda job, device, wanted, say: {k: (1e15, "datasheet", "fp32")
                                                                           for k in wanted})
    started = []
    monkeypatch.setattr(rungs, "RungProcess", lambda *a, **k: started.append(a))
    job = dataclasses.replace(tiny_job, nproc_per_node=2)
    _store(job, "attention_comm", step2(attention="unfused"))
    with pytest.raises(JobError, match=r"nproc_per_node.*at most the 1 GPU"):
        verify.run(job, write=False)
    assert started == []  # no rung process was started


def test_emulated_fp8_matmuls_stay_float32_under_the_callers_autocast():
    """Issue 33 item 14: the emulated FP8 linear's matmuls run in float32 even inside a bf16 autocast region (the
    caller's autocast used to run them in bf16): the output and the gradients are the same bit for bit."""
    import torch

    from mfu_lab.analysis.fp8_numerics import EmulatedFp8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    lin.__class__ = EmulatedFp8Linear
    x = torch.randn(8, 64)

    def run(autocast: bool):
        lin.zero_grad()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = lin(xi)
        y.square().sum().backward()
        return y.detach(), xi.grad, lin.weight.grad.clone()

    plain, under = run(False), run(True)
    assert under[0].dtype == torch.float32
    for a, b in zip(plain, under):
        assert torch.equal(a, b)


def test_interleaved_rounds_alternate_candidates_and_spread_the_steps():
    """Issue 33 item 12: FP8 and bf16 are timed in interleaved rounds (order reversed every other round), not each
    once in turn; every step asked for is timed."""
    from mfu_lab.core.measure.timed import interleaved

    calls = []

    def timer(label):
        def run(n):
            calls.append((label, n))
            return [float(len(calls))] * n
        return run

    walls = interleaved({"bf16": timer("bf16"), "fp8": timer("fp8")}, rounds=3, steps=7)
    assert calls == [("bf16", 3), ("fp8", 3), ("fp8", 2), ("bf16", 2), ("bf16", 2), ("fp8", 2)]
    assert len(walls["bf16"]) == len(walls["fp8"]) == 7
    assert interleaved({"a": timer("a")}, rounds=5, steps=2)["a"] == [7.0, 8.0]  # never more rounds than steps


def test_real_fp8_speed_pads_the_inner_dimension(monkeypatch):
    """Issue 33 item 12: the torchao config pads the inner dimension (micro_batch x seq for grad-weight). torchao
    runs only on FP8 GPUs, so a stand-in torchao.float8 records the config the step converts the model with, and the
    compile and the timed steps are stand-ins too: what is checked is the step's own code."""
    import dataclasses
    import sys
    import types

    import torch

    from mfu_lab.core.job.schema import load_job
    from mfu_lab.steps.fp8 import torchao_speed

    @dataclasses.dataclass
    class Config:
        recipe: str = ""
        pad_inner_dim: bool = False

        @classmethod
        def from_recipe_name(cls, name):
            return cls(recipe=name)

    seen = {}

    def convert(model, config, module_filter_fn):
        seen["config"] = config
        seen["kept"] = [n for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and module_filter_fn(m, n)]
        return model

    fake = types.ModuleType("torchao.float8")
    fake.Float8LinearConfig, fake.convert_to_float8_training = Config, convert
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    monkeypatch.setattr(torchao_speed, "same_batches", lambda job, n, dt: [])
    timed = types.SimpleNamespace(measured=lambda name: [0.1])
    monkeypatch.setattr(torchao_speed, "run_steps", lambda *a, **k: timed)
    monkeypatch.setattr(torchao_speed, "interleaved", lambda timers, rounds, steps: {
        k: [0.2 if k == "bf16" else 0.1] * steps for k in timers})
    job = load_job(Path(__file__).parent / "data" / "tiny.yaml")
    out = torchao_speed._real_speed(job, ["mlp_up"], torch.device("cpu"), lambda m: None)
    assert seen["config"].pad_inner_dim is True and seen["config"].recipe == job.fp8_recipe
    assert seen["kept"] and all("mlp" in n for n in seen["kept"])  # only the chosen group converts
    assert out["pad_inner_dim"] is True and out["speedup"] == pytest.approx(2.0)
    assert out["group_probe"] == [] and "CUDA events" in out["group_probe_skipped"]  # the per-group probe: GPU only


def test_nvml_pids_from_another_pid_namespace_cannot_mark_the_gpu_shared(tmp_path):
    """Issue 33 item 13: in a container on an older driver NVML returns host pids, so the workbook's own process
    looked like 'another process on the GPU'. A pid this machine's /proc does not hold is reported as not known,
    never as a neighbour; a pid /proc holds (not ours) is still another process."""
    from mfu_lab.core.measure.contention import Contention, sort_gpu_pids

    proc = tmp_path / "proc"
    for pid in (1, 4242):
        (proc / str(pid)).mkdir(parents=True)
    others, foreign = sort_gpu_pids([777001, 4242, 31337], mine={31337}, proc=str(proc))
    assert others == ["4242"] and foreign == ["777001"]
    c = Contention(True, "test", gpu_unknown=foreign)
    assert not c.shared and "cannot be told" in c.text() and "777001" in c.text()


def test_timed_ddp_steps_write_no_fsync_and_beat_at_most_once_a_second(tmp_path, monkeypatch):
    """Issue 33 item 10: local rank 0 fsynced progress.jsonl and every rank rewrote its heartbeat after every timed
    step, time that falls into the next step's wall (long on NFS or Lustre). The per-step line is now written at
    most once per BEAT_S of the loop, and at its last step, without fsync; other events stay durable."""
    import json
    import os

    from mfu_lab.workers import rank_events as dr

    synced = []
    monkeypatch.setattr(dr.os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "beats").mkdir()
    now = [0.0]
    beat = dr.step_beat(tmp_path, 0, {"config": 3}, {}, every_s=1.0, clock=lambda: now[0])
    for done in range(1, 31):  # 30 steps of 0.125 s (exact in binary)
        now[0] += 0.125
        beat(done, 30, 0.0)
    steps = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [e["done"] for e in steps] == [1, 9, 17, 25, 30]  # the first, then once a second, and the last
    assert synced == []
    assert json.loads((tmp_path / "beats" / "rank0.json").read_text())["step"] == 30
    dr.emit(tmp_path, {"event": "done"})
    assert len(synced) == 1 and os.path.exists(tmp_path / "progress.jsonl")


def test_every_launcher_has_a_work_folder_of_its_own(tmp_path, monkeypatch, tiny_job):
    """Issue 33 item 4: on a shared file system the nodes' launchers of steps 3 and 7 shared one work folder, so both
    local rank 0s appended to one progress.jsonl, each launcher removed it at start, and step 7's DDP check saw the
    other node's events. Each launcher now works in <base>/<host>-<pid>: two launchers (two processes here, as two
    nodes would be) sharing one step folder get two folders, and step 3's per-rank profile launches into it."""
    import subprocess
    import sys

    from mfu_lab.core.store.nodes import launcher_folder
    from mfu_lab.steps.kernels import step as kernels

    base = tmp_path / "03_kernels" / "ddp"
    code = f"from mfu_lab.core.store.nodes import launcher_folder; print(launcher_folder({str(base)!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = launcher_folder(base)
    assert here.parent == base and str(here) != other and Path(other).parent == base
    monkeypatch.setattr("platform.node", lambda: "node7")
    assert launcher_folder(base).name.startswith("node7-")

    seen = {}

    def fake_launch(job, spec, work, attempt, nnodes, nproc, progress=None):
        seen["work"] = work
        raise RuntimeError("stop here")

    monkeypatch.setattr(kernels, "launch", fake_launch)
    with pytest.raises(RuntimeError, match="stop here"):
        kernels.profile_ranks(tiny_job, "cpu", tmp_path / "03_kernels", lambda msg: None)
    assert seen["work"].parent == tmp_path / "03_kernels" / "ddp" and seen["work"].name.startswith("node7-")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_on_one_machine_runs_rank_0s_attention_and_waits_out_a_late_node(tmp_path, tiny_job):
    """Issue 33 item 5, with two launchers on one machine as two nodes (c10d rendezvous over localhost, gloo): each
    launcher raced attention on its own and passes a different pick; every rank runs rank 0's, and the rank whose
    launcher chose otherwise says so. The second node reaches torchrun 12 s after the first, longer than
    comm_timeout_s (8 s): the no-progress clock starts at the ranks' first event, so the early node is not killed
    while it waits in rendezvous."""
    import dataclasses
    import threading
    import time

    from mfu_lab.workers.comm_configs import config_key, sweep_configs
    from mfu_lab.workers.launch import launch

    job = dataclasses.replace(tiny_job, nnodes=2, nproc_per_node=1, rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                              comm_timeout_s=8.0, comm_steps=2, comm_warmup_steps=1, comm_hooks=["none"],
                              comm_bucket_mb=[25], comm_grad_as_bucket_view=[False])
    cfg = sweep_configs(job)[0]
    got = {}

    def node(k: int, attention: str, delay: float) -> None:
        time.sleep(delay)
        spec = {"job": job.to_dict(), "device_type": "cpu", "attention": attention, "configs": [cfg],
                "allreduce_max_bytes": None, "fault": None, "screen": job.comm_steps}
        got[k] = launch(job, spec, tmp_path / f"node{k}", 0, 2, 1)

    threads = [threading.Thread(target=node, args=(0, "sdpa math", 0.0)),
               threading.Thread(target=node, args=(1, "unfused", 12.0))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    assert set(got) == {0, 1}
    launches = {}
    for k, run in got.items():
        # every measurement in ("finished"): an exit code or a hang after it is the process group's teardown, which
        # the sweep records beside the launch and does not count as a failure (workers.launch.run_sweep); a fresh
        # clone's suite once saw this launch ended by the 8 s watchdog, the ranks' stderr empty (2026-12-07)
        finished = any(e["event"] == "finished" for e in run.events)
        assert run.returncode == 0 or finished, (run.launcher_stderr, run.rank_stderr, [e["event"] for e in run.events])
        ev = next(e for e in run.events if e["event"] == "launch")
        launches[k] = ev
        assert any(e["event"] == "done" and config_key(e["config"]) == config_key(cfg) for e in run.events)
    picked = {ev["attention"] for ev in launches.values()}
    assert len(picked) == 1  # one kernel for every rank: the pick of the node that holds rank 0
    chose = {k: a for k, a in ((0, "sdpa math"), (1, "unfused"))}
    differ = [k for k, ev in launches.items() if "own_attention" in ev]
    assert len(differ) == 1 and launches[differ[0]]["own_attention"] == chose[differ[0]]
