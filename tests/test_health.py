import sys
import time
import types

from mfu_lab.core.health import HealthSampler, decode_reasons


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
