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


def test_a_cpu_dtype_without_an_override_is_measured(monkeypatch):
    monkeypatch.setattr(dev, "measure_matmul_peak", lambda dtype: (1e10, f"stand-in {dtype}"))
    p = dev.resolve_peak(CPU, "bfloat16", {"float32": 5e9}, "highest", "float32", "highest")
    assert p.source == "measured" and p.flops_per_s == 1e10
    assert dev.resolve_peak(CPU, "float32", {"float32": 5e9}).flops_per_s == 5e9
