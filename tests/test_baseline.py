import dataclasses
import json
import statistics

import pytest

from mfu_lab.core.store.files import read_json
from mfu_lab.steps.baseline import step as baseline

REQUIRED = {"mfu", "hfu", "step_time_median_s", "tokens_per_s", "model_flops_per_step", "counted_flops_per_step",
            "peak_flops_per_s", "data_wait_fraction"}


def test_baseline_result_is_complete_and_consistent(tiny_job):
    r = baseline.run(tiny_job, progress=lambda *a: None)
    path = tiny_job.step_dir("01_baseline") / "result.json"
    d = read_json(path)
    assert REQUIRED <= set(d["metrics"])
    for m in d["metrics"].values():
        assert m["source"] in ("measured", "counted", "analytic", "datasheet")
    assert d["job"]["job_name"] == "tiny" and d["environment"]["torch"]
    # MFU recomputed independently from the stored series, FLOPs and peak
    wall = r.timings.wall_s[r.timings.warmup_steps:]
    expected = r.metric("model_flops_per_step") * len(wall) / (r.metric("peak_flops_per_s") * sum(wall))
    assert r.metric("mfu") == pytest.approx(expected)
    assert r.metric("tokens_per_s") == pytest.approx(4 * 32 * len(wall) / sum(wall))
    # nothing recomputed but the scores inside the flash-style SDPA kernel's backward: 2*L*d*T per token
    flash = 2 * tiny_job.n_layers * tiny_job.d_model * tiny_job.seq_len * 4 * 32
    assert r.metric("hfu") == pytest.approx(r.metric("mfu") * (1 + flash / r.metric("model_flops_per_step")))
    assert r.metric("counted_flops_per_step") == pytest.approx(r.metric("model_flops_per_step"), rel=0.02)
    assert r.ledger.total == pytest.approx(1.0)
    assert r.peak["source"] == "measured"
    assert any("NVML" in s["what"] for s in r.skipped)
    # the index page summarises it
    index = (tiny_job.output_root() / "index.html").read_text()
    assert "01_baseline" in index and "data:image/png;base64" in index
    # round-trip through JSON to the typed result
    again = baseline.BaselineResult.from_dict(json.loads(path.read_text()))
    assert again.metric("mfu") == r.metric("mfu")


def test_slow_loader_shows_as_software_loss_and_advice(tiny_job):
    job = dataclasses.replace(tiny_job, synthetic_load_ms=40.0)
    r = baseline.run(job, progress=lambda *a: None, write=False)
    # the injected 40 ms sleep against the measured wait: true however busy the machine is (a share is not)
    assert min(r.timings.measured("data_s")) >= 0.040
    assert r.metric("data_wait_fraction") > 0.03  # above the advice's limit unless a step took over 1.3 s
    assert r.ledger.get("software").fraction >= r.metric("data_wait_fraction")
    act = [a for a in r.advice if a.severity == "act" and "num_workers" in a.message]
    assert act and "data wait" in act[0].because


def test_activation_checkpointing_raises_hfu_above_mfu(tiny_job):
    r = baseline.run(dataclasses.replace(tiny_job, activation_checkpointing=True), progress=lambda *a: None,
                     write=False)
    assert r.metric("hfu") > r.metric("mfu")
    assert r.flops.counted_hardware_flops_per_step == pytest.approx(r.metric("hardware_flops_per_step"), rel=0.02)


def test_user_model_flops_are_counted(tiny_job):
    job = dataclasses.replace(tiny_job, model="tests.fixtures.tiny_models:bigram", model_kwargs={"vocab_size": 128})
    r = baseline.run(job, progress=lambda *a: None, write=False)
    assert r.metrics["model_flops_per_step"].source == "counted"
    # one Linear(16 -> 128) per token: 2*16*128 forward, twice that backward
    assert r.metric("model_flops_per_step") == 6 * 16 * 128 * 4 * 32
    assert r.metric("flops_disagreement") is None


def test_peak_override_is_used(tiny_job):
    r = baseline.run(dataclasses.replace(tiny_job, peak_flops=1e15), progress=lambda *a: None, write=False)
    assert r.metric("peak_flops_per_s") == 1e15 and "job file" in r.metrics["peak_flops_per_s"].note


def test_a_busy_neighbour_is_named_and_speed_advice_withheld(tiny_job):
    """Another process holds a core for the whole run (not a child of ours: it is the machine's neighbour)."""
    import os
    import signal
    import subprocess
    import sys

    from mfu_lab.steps.baseline import step as baseline

    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    try:
        # enough steps for half a second or more (/proc/stat counts in 10 ms ticks) while the loop burns a core
        r = baseline.run(dataclasses.replace(tiny_job, steps=150), progress=lambda *a: None, write=False)
    finally:
        os.kill(pid, signal.SIGKILL)
    c = r.timings.contention
    assert c.sampled and c.other_cpu_s >= 0.5 * c.elapsed_s, c  # the neighbour's core, whatever the machine's speed
    assert c.shared and r.advice[0].message.startswith("The machine was shared")
    assert not any("Most of the peak is lost" in a.message or "unsteady" in a.message for a in r.advice[1:])
    assert r.metrics["contention_other_cores"].value >= 0.5


def test_variable_length_batches_count_only_their_useful_tokens(tiny_job):
    """Padding is not model work: tokens/s and MFU count the non-padding targets, and padding has its own share."""
    from mfu_lab.core.engine.workload import IGNORE, build_loader

    job = dataclasses.replace(tiny_job, data="synthetic_varlen", seq_policy="longest")
    r = baseline.run(job, progress=lambda *a: None, write=False)
    # an independent count: the same loader, seed and batches, iterated here
    every = list(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0),
                              job.warmup_steps + job.steps, "cpu"))
    batches = every[job.warmup_steps:]
    useful = sum(int((y != IGNORE).sum()) for _, y in batches)
    padded = sum(y.numel() for _, y in batches)
    wall = sum(r.timings.measured("wall_s"))
    assert 0 < useful < padded < job.tokens_per_step * job.steps  # 'longest' pads less than seq_len, but pads
    assert r.metric("tokens_per_s") == pytest.approx(useful / wall)
    assert r.metric("padding_share") == pytest.approx(1 - useful / padded)
    per_token = r.metric("model_flops_per_step") / every[0][0].numel()  # FLOPs were counted on the first batch
    assert r.metric("mfu") == pytest.approx(per_token * useful / (wall * r.metric("peak_flops_per_s")))


def test_mfu_is_over_the_total_wall_and_a_recheck_below_the_cached_peak_is_contention(tiny_job, tmp_path,
                                                                                       monkeypatch):
    """One MFU statistic (model FLOPs x steps / (peak x their total wall time)), and one peak per machine: a
    re-check below the cached peak is recorded as the machine being shared, the cached peak kept."""
    from mfu_lab.core.measure import device as dev
    from mfu_lab.core.measure import peak_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    probes = [5e9] * 5
    monkeypatch.setattr(dev, "measure_matmul_peak", lambda dtype, *a, **k: (1e13, "stand-in measurement"))
    monkeypatch.setattr(peak_cache, "probe_rates", lambda dtype, device_type="cpu": list(probes))
    dev.resolve_peak(dev.resolve_device("cpu"), tiny_job.dtype, None)  # cached, with probes at 5 GFLOP/s
    probes[:] = [2.4e9, 2.5e9, 2.6e9, 2.5e9, 2.5e9]  # a neighbour arrived: the re-checks read half
    r = baseline.run(tiny_job, progress=lambda *a: None, write=False)
    wall = r.timings.measured("wall_s")
    assert r.metric("peak_flops_per_s") == 1e13  # the cached peak, not the contended re-check
    assert r.metric("mfu") == pytest.approx(
        r.metric("model_flops_per_step") * len(wall) / (r.metric("peak_flops_per_s") * sum(wall)))
    assert "over the total wall time of the measured steps" in r.metrics["mfu"].note
    assert r.metric("step_time_median_s") == pytest.approx(statistics.median(wall))
    note = r.metrics["peak_flops_per_s"].note
    assert "cached since" in note and "re-checked now" in note and "contention" in note
    c = r.timings.contention
    assert c.shared and ("the matmul rate re-checked before and after the steps was 50% and 50% of the cached peak, "
                         "each time its probes' p90") in c.text() and c.text().count("re-checked") == 1
    # the advice says why the machine counts as shared: the re-check, not the cores other processes kept busy
    assert r.advice[0].message.startswith("The machine was shared") and "50% of the cached peak" in r.advice[0].because


def test_every_step_that_measured_on_a_shared_machine_says_so_in_its_headline():
    """Step 1's contention record (timings) and step 3's (unprofiled, profiled) both reach the first line of
    "What this step found"."""
    from mfu_lab.report.found import shared_line

    busy = {"sampled": True, "shared": True, "other_cores": 1.57, "usable_cores": 2, "load_1min": 3.2,
            "gpu_processes": []}
    quiet = dict(busy, shared=False, other_cores=0.1)
    step1 = {"timings": {"contention": busy}}
    step3 = {"unprofiled": {"contention": quiet}, "profiled": {"contention": busy}}
    for d in (step1, step3):
        line = shared_line(d)
        assert line.startswith("The machine was shared while this step measured") and "1.57 of 2 cores" in line
    assert shared_line({"unprofiled": {"contention": quiet}, "profiled": {"contention": None}}) == ""
    # shared by the peak's re-check alone, no process here busy: the headline says the re-check, not just the cores
    slow = dict(quiet, shared=True, other_cores=0.01, rechecks=["the matmul rate re-checked before the steps was "
                                                                "90% of the cached peak"])
    assert "0.01 of 2 cores busy" in shared_line({"timings": {"contention": slow}})
    assert "90% of the cached peak" in shared_line({"timings": {"contention": slow}})
    assert shared_line({"metrics": {}}) == ""


def test_a_recheck_above_the_cached_peak_after_the_steps_measures_it_again(tiny_job, tmp_path, monkeypatch):
    """The cache was a busy machine's: the re-check after the steps reads above it, so step 1 measures again,
    caches the better reading and takes MFU against it."""
    from mfu_lab.core.measure import device as dev
    from mfu_lab.core.measure import peak_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls, peaks = [], [1e13, 2e13]
    monkeypatch.setattr(dev, "measure_matmul_peak", lambda dtype, *a, **k: (peaks.pop(0), "stand-in"))
    monkeypatch.setattr(peak_cache, "probe_rates",
                        lambda dtype, device_type="cpu": calls.append(1) or [5e9 if len(calls) <= 3 else 1e10] * 5)
    dev.resolve_peak(dev.resolve_device("cpu"), tiny_job.dtype, None)  # cached at 1e13 (probes 1 and 2)
    r = baseline.run(tiny_job, progress=lambda *a: None, write=False)  # probe 3 before the steps: steady
    note = r.metrics["peak_flops_per_s"].note
    assert r.metric("peak_flops_per_s") == 2e13 and "re-check after the steps read above the cache" in note
    assert "cached from now on" in note and r.peak["cache"]["verdict"] == "remeasured"
    wall = r.timings.measured("wall_s")
    assert r.metric("mfu") == pytest.approx(r.metric("model_flops_per_step") * len(wall) / (2e13 * sum(wall)))
    assert dev.resolve_peak(dev.resolve_device("cpu"), tiny_job.dtype, None).flops_per_s == 2e13  # the cache too


def test_with_accumulation_every_rate_is_an_optimizer_steps(tiny_job):
    """grad_accum 2 x micro_batch 2 against 1 x 4 (the same samples per optimizer step): the same model FLOPs per
    step, and MFU, tokens/s and samples/s over the optimizer step's tokens and samples, from the stored series.
    Before, MFU divided a step's FLOPs (both micro-batches) by one micro-batch's tokens: 2x too high (4x on the
    GPU job's grad_accum 4)."""
    from mfu_lab.core.measure import flops as fl
    from mfu_lab.core.measure.device import resolve_device
    from mfu_lab.steps.placement.step import job_shape

    one = dataclasses.replace(tiny_job, steps=4, warmup_steps=1)
    two = dataclasses.replace(one, micro_batch=2, grad_accum=2)
    assert two.tokens_per_step == one.tokens_per_step == 4 * 32
    r1 = baseline.run(one, progress=lambda *a: None, write=False)
    r2 = baseline.run(two, progress=lambda *a: None, write=False)
    assert r2.metric("model_flops_per_step") == pytest.approx(r1.metric("model_flops_per_step"), rel=1e-9)
    wall = r2.timings.wall_s[r2.timings.warmup_steps:]
    steps_per_s = len(wall) / sum(wall)
    assert r2.metric("mfu") == pytest.approx(fl.mfu(r2.metric("model_flops_per_step"), steps_per_s,
                                                    r2.metric("peak_flops_per_s")))
    assert r2.metric("tokens_per_s") == pytest.approx(4 * 32 * steps_per_s)
    assert r2.metric("samples_per_s") == pytest.approx(4 * steps_per_s)
    # step 6's FLOPs per sample: an optimizer step's FLOPs over its samples, whatever the split
    cpu = resolve_device("cpu")
    assert job_shape(two, cpu)[0].flops_per_sample == pytest.approx(job_shape(one, cpu)[0].flops_per_sample)
