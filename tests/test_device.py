import pytest
import torch

from mfu_lab.core.errors import DeviceError
from mfu_lab.core.measure import device as dev

T = 1e12


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312 * T),
    ("NVIDIA A100-PCIE-40GB", "float16", 312 * T),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4 * T),
    ("NVIDIA H100 PCIe", "bfloat16", 756 * T),
    ("NVIDIA H100 NVL", "bfloat16", 835.5 * T),
    ("NVIDIA H200", "bfloat16", 989.4 * T),
    ("NVIDIA B200", "bfloat16", 2250 * T),
    ("NVIDIA L40S", "bfloat16", 362.05 * T),
    ("AMD Instinct MI300X", "bfloat16", 1307.4 * T),
])
def test_datasheet_peaks(name, dtype, expected):
    peak = dev.datasheet_peak(name, dtype)
    assert peak.flops_per_s == expected
    assert peak.source == "datasheet"
    assert "datasheet" in peak.note or "data sheet" in peak.note


def test_every_chip_has_a_source_and_dense_ordering():
    for chip in dev.PEAK_TABLE:
        assert chip.source
        assert chip.fp32 < chip.tf32 < chip.bf16 == chip.fp16
        assert chip.fp8 is None or chip.fp8 == pytest.approx(2 * chip.bf16, rel=0.02)


def test_float32_uses_tf32_only_when_torch_allows_it():
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert dev.datasheet_peak("NVIDIA H100 80GB HBM3", "float32").flops_per_s == 67 * T
        torch.set_float32_matmul_precision("high")
        assert dev.datasheet_peak("NVIDIA H100 80GB HBM3", "float32").flops_per_s == 494.7 * T
    finally:
        torch.set_float32_matmul_precision(old)


def test_unknown_gpu_asks_for_peak_flops_instead_of_guessing():
    with pytest.raises(DeviceError, match="peak_flops") as e:
        dev.datasheet_peak("NVIDIA GeForce GTX 1080", "bfloat16")
    assert "GTX 1080" in str(e.value)


def test_override_wins_and_cpu_peak_is_measured():
    cpu = dev.DeviceInfo("cpu", "test cpu", None, None, 1)
    assert dev.resolve_peak(cpu, "float32", 5e9).flops_per_s == 5e9
    gpu = dev.DeviceInfo("cuda", "NVIDIA H200", 0, "9.0", None)
    assert dev.resolve_peak(gpu, "bfloat16", None).flops_per_s == 989.4 * T
    measured = dev.resolve_peak(cpu, "float32", None)
    assert measured.source == "measured" and measured.flops_per_s > 1e8


def test_measured_peak_is_consistent_with_an_independent_timing():
    import time

    rate, note = dev.measure_matmul_peak(torch.float32, sizes=(256,), budget_s=0.3)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    independent = 20 * 2 * 256**3 / (time.perf_counter() - t0)
    assert rate >= 0.5 * independent  # the best case is at least as good as an average, within noise
    assert "n=256" in note


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="device 'cuda'"):
        dev.resolve_device("cuda")
    assert dev.resolve_device("auto").type == "cpu"


@pytest.mark.parametrize("marketing_name, row", [
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H800", "H100 SXM"), ("NVIDIA H800 PCIe", "H800 PCIe"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"),
    ("NVIDIA L40S", "L40S"), ("AMD Instinct MI300X", "MI300X"),
])
def test_each_marketing_name_finds_its_own_row(marketing_name, row):
    """The strings torch.cuda.get_device_name() returns: the most specific row wins (NVL and PCIe parts, GB200)."""
    assert dev.lookup_chip(marketing_name).name == row


def test_the_nvl_and_gb200_rows_hold_their_own_dense_figures():
    assert dev.datasheet_peak("NVIDIA H200 NVL", "bfloat16").flops_per_s == 835.5 * T
    assert dev.datasheet_peak("NVIDIA GB200", "bfloat16").flops_per_s == 2500 * T
    assert dev.datasheet_peak("NVIDIA H800 PCIe", "bfloat16").flops_per_s == 756 * T


def test_the_jobs_matmul_precision_picks_the_float32_row_whatever_torch_was_left_at():
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # an earlier step in this process left TF32 on
        p = dev.datasheet_peak("NVIDIA H100 80GB HBM3", "float32", "highest")
        assert p.flops_per_s == 67 * T and p.precision == "fp32" and "true float32" in p.note
        p = dev.datasheet_peak("NVIDIA H100 80GB HBM3", "float32", "high")
        assert p.flops_per_s == 494.7 * T and "TF32" in p.note
    finally:
        torch.set_float32_matmul_precision(old)
