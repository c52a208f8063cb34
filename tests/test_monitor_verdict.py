"""The production monitor's verdict judges communication by what is exposed, and gives none at one rank (issue 46:
the H200 check's one-rank job read "communication (net of waiting for the slowest rank) is 21% of the step",
where its profile showed none)."""

from mfu_lab.analysis.monitor.summary import _verdict


def _shares(comm):
    m = lambda v: {"value": v, "label": "measured"}  # noqa: E731
    return {"compute": m(1 - comm - 0.01), "communication": m(comm), "data": m(0.01), "host": m(0.0),
            "other": m(0.0), "waiting_for_slowest": m(0.0)}


OPS = {"parts": {}}
ONE_RANK = _shares(0.205)  # the GPU check's figures: a collective 'in flight' 20.5% of a one-rank job's step


def test_no_communication_verdict_at_one_rank():
    key, text, figures = _verdict(ONE_RANK, OPS, [], world=1)
    assert "communication" not in figures and "communication" not in text and key != "attention_comm"


def test_the_exposed_share_of_the_profiler_windows_decides_when_there_is_one():
    hidden = {"breakdown": {"communicating": 0.004, "comm_total": 0.2}}
    key, text, figures = _verdict(ONE_RANK, OPS, [], world=8, profile=hidden)
    assert figures["communication"] == 0.004 and key != "attention_comm"
    exposed = {"breakdown": {"communicating": 0.18, "comm_total": 0.2}}
    key, text, _ = _verdict(ONE_RANK, OPS, [], world=8, profile=exposed)
    assert key == "attention_comm" and text.startswith("exposed communication (outside compute, from the profiler")


def test_without_a_profiler_window_the_verdict_says_the_overlap_is_unmeasured():
    key, text, figures = _verdict(ONE_RANK, OPS, [], world=8)
    assert key == "attention_comm" and figures["communication"] == 0.205
    assert "no profiler window measured how much of it compute hides" in text
