"""Issue 33, items 2, 3, 8, 9 and 11: peaks per (dtype, matmul precision), DDP warm-up, exposed-comm medians,
dead verify rungs, nproc_per_node against the visible GPUs."""

import pytest

from mfu_lab.core import device as dev
from mfu_lab.core.errors import DeviceError

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
    from mfu_lab.cli import parse_overrides
    from mfu_lab.core.errors import JobError
    from mfu_lab.core.job import load_job

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
    from mfu_lab.steps.verify import Rung

    return Rung(name, {}, "ok", dtype=dtype, peak_flops_per_s=peak, peak_source="datasheet", peak_precision=row,
                mfu=0.3, speedup=speedup, speedup_low=speedup * 0.9, speedup_high=speedup * 1.1)


def test_step7_keys_peaks_by_dtype_and_matmul_precision_on_a_gpu(tiny_job):
    import dataclasses

    from mfu_lab.steps import verify

    job = dataclasses.replace(tiny_job, dtype="float32", matmul_precision="highest", peak_flops=6.0e13)
    wanted = {("float32", "highest"), ("float32", "high"), ("bfloat16", "high")}
    peaks = verify._peaks(job, H200, wanted, lambda *a: None)
    assert peaks[("float32", "highest")][:2] == (6.0e13, "datasheet")  # the job's own override, for its own peak
    assert peaks[("float32", "high")] == (494.7 * T, "datasheet", "tf32")  # TF32 rung: TF32's row, not the override
    assert peaks[("bfloat16", "high")] == (989.4 * T, "datasheet", "bf16")  # never the fp32 override
    # the same-peak warning shows for the TF32 rung, naming the rows
    before, after = _rung("original", "float32", 6.0e13, "fp32", 1.0), _rung("precision", "float32", 494.7 * T, "tf32")
    text = verify._headline(before, after, [before, after], {"status": "ok"})["text"]
    assert "own precision's peak (fp32, then tf32)" in text and "8.2x" in text and "compare the speedup" in text


def test_step7_on_a_gpu_without_a_row_takes_the_mapping_and_says_what_it_needs(tiny_job):
    import dataclasses

    from mfu_lab.steps import verify

    job = dataclasses.replace(tiny_job, dtype="float32", matmul_precision="highest",
                              peak_flops={"float32": 6.7e13, "bfloat16": 9.9e14})
    peaks = verify._peaks(job, UNKNOWN_GPU, {("float32", "highest"), ("bfloat16", "highest"),
                                             ("float16", "highest")}, lambda *a: None)
    assert peaks[("float32", "highest")][0] == 6.7e13 and peaks[("bfloat16", "highest")][0] == 9.9e14
    value, source, row = peaks[("float16", "highest")]
    assert value is None and "no peak_flops for float16" in source and "GTX 1080" in source and row == "fp16"
    before, after = _rung("original", "float32", 6.7e13, "fp32", 1.0), _rung("precision", "float16", None, "fp16")
    after.peak_source, after.mfu = source, None
    text = verify._headline(before, after, [before, after], {"status": "ok"})["text"]
    assert "no MFU without a peak" in text and "float16" in text
