import pytest

from mfu_lab.core.health import HealthSummary
from mfu_lab.core.ledger import ORDER, single_process_ledger
from mfu_lab.core.measure import Timings

CPU = HealthSummary(False, "CPU run")


def timings(data, compute, host, warm=1):
    n = len(data)
    return Timings([d + c + h for d, c, h in zip(data, compute, host)], data, compute, [0.0] * n, warm, "test")


def test_parts_add_up_and_software_is_data_plus_host():
    t = timings([9, 0.1, 0.2], [9, 0.8, 0.7], [9, 0.1, 0.1])
    ledger = single_process_ledger(t, 0.3, CPU)
    assert [i.name for i in ledger.items] == list(ORDER)
    assert ledger.total == pytest.approx(1.0)
    assert ledger.get("software").fraction == pytest.approx((0.3 + 0.2) / 2.0)
    assert ledger.get("hardware").fraction == pytest.approx(1.5 / 2.0 - 0.3)
    assert ledger.get("structure").fraction == 0.0
    assert "unknown" in ledger.get("operations").explanation


def test_throttled_clocks_become_operations_loss():
    t = timings([0, 0.0], [0, 1.0], [0, 0.0])
    hot = HealthSummary(True, samples=10, sm_clock_mhz_mean=1600.0, sm_clock_mhz_max_supported=2000.0,
                        reasons_seen=["HW thermal slowdown"], throttled_fraction=0.5)
    ledger = single_process_ledger(t, 0.4, hot)
    assert ledger.get("operations").fraction == pytest.approx(0.2)  # 1.0 x (1 - 1600/2000)
    assert ledger.get("hardware").fraction == pytest.approx(0.4)
    assert ledger.total == pytest.approx(1.0)
    calm = HealthSummary(True, samples=10, sm_clock_mhz_mean=1600.0, sm_clock_mhz_max_supported=2000.0,
                         throttled_fraction=0.0)
    assert single_process_ledger(t, 0.4, calm).get("operations").fraction == 0.0
