from types import SimpleNamespace

import pytest

from mfu_lab.core.measure.health import HealthSummary
from mfu_lab.core.measure.ledger import (
    ORDER,
    HardwareFlops,
    Ledger,
    ddp_ledger,
    hardware_flops,
    single_process_ledger,
    trace_ledger,
    upgrade,
)
from mfu_lab.core.measure.timed import Timings
from mfu_lab.core.store.results import jsonable, rebuild

CPU = HealthSummary(False, "CPU run")
HW = HardwareFlops(1.1, "analytic", "activation checkpointing 10.0% of model FLOPs")


def timings(data, compute, host, warm=1):
    n = len(data)
    return Timings([d + c + h for d, c, h in zip(data, compute, host)], data, compute, [0.0] * n, warm, "test")


def breakdown(computing=0.6, copying=0.1, communicating=0.05, waiting_for_data=0.05, idle=0.2):
    return SimpleNamespace(computing=computing, copying=copying, communicating=communicating, comm_total=0.1,
                           comm_overlapped=0.05, waiting_for_data=waiting_for_data, idle=idle)


def test_parts_add_up_and_software_is_data_plus_host():
    t = timings([9, 0.1, 0.2], [9, 0.8, 0.7], [9, 0.1, 0.1])
    ledger = single_process_ledger(t, 0.3, CPU)
    assert [i.name for i in ledger.items] == list(ORDER)
    assert ledger.total == pytest.approx(1.0)
    assert ledger.get("software").fraction == pytest.approx((0.3 + 0.2) / 2.0)
    assert ledger.get("efficiency").fraction == pytest.approx(1.5 / 2.0 - 0.3)
    assert ledger.get("structure").fraction == 0.0
    assert "unknown" in ledger.get("operations").explanation
    # without a hardware FLOP count, recompute is not separated and says so
    rec = ledger.get("recompute")
    assert rec.fraction == 0.0 and rec.source == "analytic" and "within compute efficiency" in rec.explanation


def test_throttled_clocks_become_operations_loss():
    t = timings([0, 0.0], [0, 1.0], [0, 0.0])
    hot = HealthSummary(True, samples=10, sm_clock_mhz_mean=1600.0, sm_clock_mhz_max_supported=2000.0,
                        reasons_seen=["HW thermal slowdown"], throttled_fraction=0.5)
    ledger = single_process_ledger(t, 0.4, hot)
    assert ledger.get("operations").fraction == pytest.approx(0.2)  # 1.0 x (1 - 1600/2000)
    assert ledger.get("efficiency").fraction == pytest.approx(0.4)
    assert ledger.total == pytest.approx(1.0)
    calm = HealthSummary(True, samples=10, sm_clock_mhz_mean=1600.0, sm_clock_mhz_max_supported=2000.0,
                         throttled_fraction=0.0)
    assert single_process_ledger(t, 0.4, calm).get("operations").fraction == 0.0


def test_recompute_is_hfu_minus_mfu_and_comes_out_of_compute_efficiency():
    t = timings([9, 0.1, 0.2], [9, 0.8, 0.7], [9, 0.1, 0.1])
    ledger = single_process_ledger(t, 0.3, CPU, HW)
    rec = ledger.get("recompute")
    assert rec.fraction == pytest.approx(0.3 * 1.1 - 0.3)  # HFU - MFU
    assert rec.source == "analytic" and "HFU - MFU" in rec.explanation
    assert ledger.get("efficiency").fraction == pytest.approx(1.5 / 2.0 - 0.3 * 1.1)
    assert ledger.get("efficiency").label == "compute efficiency loss"
    counted = single_process_ledger(t, 0.3, CPU, HardwareFlops(1.0, "counted", "nothing recomputed"))
    assert counted.get("recompute").fraction == 0.0 and counted.get("recompute").source == "counted"


@pytest.mark.parametrize("hw", [None, HW], ids=["no hardware FLOPs", "with hardware FLOPs"])
@pytest.mark.parametrize("build", ["single_process", "ddp", "trace"])
def test_every_builder_adds_up_to_the_peak_in_order(build, hw):
    if build == "single_process":
        ledger = single_process_ledger(timings([9, 0.1, 0.2], [9, 0.8, 0.7], [9, 0.1, 0.1]), 0.3, CPU, hw)
    elif build == "ddp":
        ledger = ddp_ledger(0.3, 0.1, 0.05, 2, hw)
    else:
        ledger = trace_ledger(breakdown(), 0.3, "cpu", hw)
    assert [i.name for i in ledger.items] == list(ORDER)
    assert ledger.total == pytest.approx(1.0)
    assert ledger.get("recompute").fraction == pytest.approx(0.03 if hw else 0.0)


def test_the_trace_ledger_residual_is_busy_time_less_mfu_and_recompute():
    ledger = trace_ledger(breakdown(), 0.3, "cuda", HW)
    assert ledger.get("efficiency").fraction == pytest.approx(0.6 + 0.1 - 0.3 - 0.03)
    assert "- MFU - recompute" in ledger.get("efficiency").explanation
    assert ledger.get("structure").fraction == pytest.approx(0.05)


def test_hardware_flops_from_a_flop_report():
    report = SimpleNamespace(model_flops_per_step=100.0, model_flops_source="counted", hardware_flops_per_step=125.0,
                             flash_recompute_flops_per_step=5.0)
    hw = hardware_flops(report)
    assert hw.ratio == pytest.approx(1.25) and hw.source == "counted"
    assert "checkpointing 20.0%" in hw.what and "flash-style score recompute 5.0%" in hw.what
    plain = hardware_flops(SimpleNamespace(model_flops_per_step=100.0, model_flops_source="analytic",
                                           hardware_flops_per_step=100.0, flash_recompute_flops_per_step=0.0))
    assert plain.ratio == 1.0 and plain.what == "nothing recomputed"
    assert hardware_flops(SimpleNamespace(model_flops_per_step=0.0, model_flops_source="counted",
                                          hardware_flops_per_step=0.0, flash_recompute_flops_per_step=0.0)) is None


OLD = {"items": [{"name": "mfu", "fraction": 0.4, "source": "measured", "explanation": ""},
                 {"name": "hardware", "fraction": 0.5, "source": "measured", "explanation": "old residual"},
                 {"name": "software", "fraction": 0.1, "source": "measured", "explanation": ""}]}


def test_an_earlier_runs_hardware_item_reads_back_as_compute_efficiency():
    from mfu_lab import plots
    from mfu_lab.report.index import _ledger_obj
    from mfu_lab.report.summary import ledger_before_after

    typed = rebuild(Ledger, OLD)  # as BaselineResult.from_dict reads a stored result.json
    assert [i.name for i in typed.items] == ["mfu", "efficiency", "software"]
    assert typed.get("efficiency").fraction == 0.5 and typed.get("hardware") is typed.get("efficiency")
    assert jsonable(typed)["items"][1]["name"] == "efficiency"
    assert [i["name"] for i in upgrade(OLD)["items"]] == ["mfu", "efficiency", "software"]
    assert OLD["items"][1]["name"] == "hardware"  # the stored dict itself is left as it was
    before, after = ledger_before_after({"baseline": {"ledger": OLD}})
    assert [i["name"] for i in before[1]["items"]] == ["mfu", "efficiency", "software"] and after is None
    assert _ledger_obj(OLD).get("efficiency").fraction == 0.5
    ax = plots.ledger_waterfall(typed).axes[0]
    assert "compute\nefficiency\nloss" in [t.get_text() for t in ax.get_xticklabels()]


def test_layout_ledger_names_collectives_by_kind_and_counts_the_bubble_once():
    from mfu_lab.core.measure.ledger import layout_ledger

    led = layout_ledger(0.30, {"allgather": 0.05, "reduce_scatter": 0.03, "recv": 0.08, "send": 0.01}, 0.12, 0.02,
                        "PP2 1f1b m4", 2)
    assert led.total == pytest.approx(1.0)
    # the bubble (12%) is larger than the send/recv waits (9%), which it contains: 5 + 3 + 12, not + 9
    assert led.get("structure").fraction == pytest.approx(0.20)
    text = led.get("structure").explanation
    assert "allgather 5.0%" in text and "reduce_scatter 3.0%" in text and "pipeline bubble 12.0%" in text
    assert led.get("efficiency").fraction == pytest.approx(1 - 0.30 - 0.20 - 0.02)
    no_pp = layout_ledger(0.3, {"allreduce": 0.1}, None, 0.0, "TP2", 2)
    assert no_pp.get("structure").fraction == pytest.approx(0.1) and "bubble" not in no_pp.get("structure").explanation
