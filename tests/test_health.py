import dataclasses
import sys
import time
import types

import pytest

from mfu_lab.core.measure.health import HealthSampler, HealthSummary, decode_reasons


def test_cpu_run_is_skipped_with_a_reason():
    with HealthSampler("cpu", "some cpu", None) as s:
        pass
    summary = s.summary()
    assert not summary.sampled and "CPU" in summary.skipped_reason


def test_reasons_decode():
    assert decode_reasons(0x40 | 0x4) == ["SW power cap", "HW thermal slowdown"]
    assert decode_reasons(0) == []


def fake_nvml(temps, clocks):
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM, nv.NVML_TEMPERATURE_GPU = 1, 0
    nv.NVMLError = RuntimeError
    it_t, it_c = iter(temps), iter(clocks)
    nv.nvmlInit = nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: "h"
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 2000
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nv.nvmlDeviceGetTemperature = lambda h, kind: next(it_t, 70)
    nv.nvmlDeviceGetClockInfo = lambda h, kind: next(it_c, 1900)
    nv.nvmlDeviceGetPowerUsage = lambda h: 500_000
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x40
    return nv


def test_nvml_samples_are_summarised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([85, 81], [1500, 1700]))
    with HealthSampler("cuda", "NVIDIA H100 80GB HBM3", 0, interval_s=0.01) as s:
        time.sleep(0.1)
    h = s.summary()
    assert h.sampled and h.samples >= 3
    assert h.temperature_c_max == 85
    assert h.sm_clock_mhz_min == 1500 and h.sm_clock_mhz_max_supported == 2000
    assert h.power_w_mean == 500 and h.power_limit_w == 700
    assert h.reasons_seen == ["HW thermal slowdown"] and h.throttled_fraction == 1.0


def test_missing_nvml_is_a_recorded_skip(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with HealthSampler("cuda", "NVIDIA H100", 0) as s:
        pass
    assert not s.summary().sampled and "NVML unavailable" in s.summary().skipped_reason


def test_a_gpu_nvml_cannot_match_is_a_recorded_skip_not_a_wrong_gpu(monkeypatch):
    """With CUDA_VISIBLE_DEVICES set, torch's device 0 need not be NVML's device 0: without a UUID or PCI match
    the sampler says so instead of reading another GPU."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([60], [1500]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with HealthSampler("cuda", "NVIDIA H100 80GB HBM3", 0, interval_s=0.01) as s:
        pass
    h = s.summary()
    assert not h.sampled and "CUDA_VISIBLE_DEVICES=3" in h.skipped_reason


def test_operations_loss_compares_busy_clocks_with_the_datasheet_clock(monkeypatch):
    """An H100 SXM's dense peak is quoted at 989.4e12 / (132 SMs x 4096 FLOPs) = 1830 MHz, below NVML's 1980 MHz
    maximum: a busy GPU at 1830 MHz loses nothing, one at 1647 MHz loses 10%; idle samples (clocks drop by
    design) are left out."""
    nv = fake_nvml([60] * 1000, [1830, 300] * 500)
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    busy = iter([True, False] * 500)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=100 if next(busy, True) else 0)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with HealthSampler("cuda", "NVIDIA H100 80GB HBM3", 0, interval_s=0.005) as s:
        while len(s.rows) < 6:
            time.sleep(0.01)
    h = s.summary()
    assert h.sm_clock_mhz_reference == pytest.approx(989.4e12 / (132 * 4096) / 1e6)
    assert h.busy_samples == sum(1 for r in s.rows if r[4])
    assert h.sm_clock_mhz_mean == 1830  # the 300 MHz idle samples are not averaged in
    assert h.clock_ratio == 1.0  # capped: at the rated clock, no loss (1830 / 1830)
    assert "datasheet" in h.reference_clock[1]
    slow = dataclasses.replace(h, sm_clock_mhz_mean=0.9 * h.sm_clock_mhz_reference)
    assert slow.clock_ratio == pytest.approx(0.9)
    boosted = dataclasses.replace(h, sm_clock_mhz_mean=1980.0)
    assert boosted.clock_ratio == 1.0  # above the rated clock: capped at 1


def test_a_chip_without_a_datasheet_clock_falls_back_to_nvmls_maximum_and_says_so():
    h = HealthSummary(True, samples=4, sm_clock_mhz_mean=1500.0, sm_clock_mhz_max_supported=2000.0)
    assert h.clock_ratio == 0.75 and "NVML's maximum" in h.reference_clock[1]


def test_reference_clocks_follow_the_stated_formula():
    from mfu_lab.core.measure.device import lookup_chip

    assert lookup_chip("NVIDIA A100-SXM4-80GB").reference_clock_mhz == pytest.approx(1410, abs=1)  # 312e12/108/2048
    assert round(lookup_chip("NVIDIA H100 80GB HBM3").reference_clock_mhz) == 1830
    assert round(lookup_chip("NVIDIA H200").reference_clock_mhz) == 1830
    assert lookup_chip("NVIDIA B200").reference_clock_mhz is None  # no SM count in the row: NVML max instead


def test_the_monitor_charges_throttling_against_the_rated_clock_not_nvmls_maximum():
    """The monitor's interval record: busy samples throttled at 1647 MHz on an H100 SXM (rated 1830, NVML max
    1980) lose 1 - 1647/1830 = 10% of their time, not 1 - 1647/1980 = 16.8%."""
    from mfu_lab.analysis.monitor.read import GpuBin, throttle_seconds
    from mfu_lab.monitor.context import NvmlProbe

    probe = NvmlProbe(0)
    probe.max_clock, probe.reference_clock, probe.power_limit = 1980.0, 1830.0, None
    probe._ecc, probe._ecc0 = (lambda: None), None
    probe._n = probe._busy = probe._throttled = 4
    probe._clock_sum = probe._throttled_clock_sum = 4 * 1647.0
    gpu = probe.take()
    assert gpu["sm_clock_mhz_reference"] == 1830.0
    assert gpu["throttled_clock_ratio"] == pytest.approx(0.9)
    assert throttle_seconds({"wall_s": 100.0, "gpu": gpu}) == pytest.approx(10.0)
    b = GpuBin()
    b.add(gpu | {"sm_clock_mhz_busy_mean": 1900.0})  # boosted above the rated clock: capped at 1
    assert b.clock_sum / b.clock_n == 1.0
