"""Issue 20, no repeated work: a run redraws a step's section of the index only when its result changed, and a
notebook run by ``mfu-lab run`` leaves the index to the runner."""

from __future__ import annotations

import os

from mfu_lab import refresh_index
from mfu_lab.report import index


def test_an_unchanged_result_is_drawn_once_per_process(monkeypatch):
    drawn = []
    monkeypatch.setitem(index.SECTIONS, "baseline", lambda d: drawn.append(d) or index.Markup("<p>s</p>"))
    monkeypatch.setattr(index, "_DRAWN", {})
    d = {"metrics": {"mfu": {"value": 0.5}}}
    assert index._section("baseline", d) == index._section("baseline", dict(d)) == "<p>s</p>"
    assert len(drawn) == 1
    index._section("baseline", {"metrics": {"mfu": {"value": 0.6}}})  # a new result: drawn again
    assert len(drawn) == 2


def test_the_pages_top_figures_are_drawn_again_only_when_their_inputs_change(monkeypatch, tmp_path):
    """A run writes the index twice a step; the figures above the sections (progression, ledgers, staircase, the
    monitor's section, the runs' trend) took 1.5 s of each write of a full run's page here, drawn again unchanged.
    Each part is counted by its own drawing function (those stubbed: this is about when a part is drawn)."""
    import json

    from mfu_lab.core.registry import BY_KEY
    from mfu_lab.core.store.files import write_json_atomic

    from .conftest import ROOT
    root = tmp_path / "job"  # a real default run's seven results (tests/test_index_screen.py reads them too)
    for key, d in json.loads((ROOT / "tests" / "data" / "default_run_results.json").read_text())["results"].items():
        write_json_atomic(root / BY_KEY[key].folder / "result.json", d)
    monkeypatch.setattr(index, "_DRAWN", {})
    drawn: dict[str, int] = {}

    def counted(part, value):
        return lambda *a, **k: drawn.__setitem__(part, drawn.get(part, 0) + 1) or value

    for name in ("mfu_progression", "mfu_trend"):  # drawn for the top of the page only
        monkeypatch.setattr(index.plots, name, counted(name, object()))
    monkeypatch.setattr(index.plots, "to_data_uri", lambda fig: "data:,")
    monkeypatch.setattr(index, "_ledger_figure", counted("ledgers", {"kind": "none", "uri": None, "ops": None}))
    monkeypatch.setattr(index, "_staircase_of", counted("staircase", None))
    monkeypatch.setattr(index, "monitor_section", counted("monitor", index.Markup("<p>monitor</p>")))
    mon = {"verdict": "steady"}
    monkeypatch.setattr(index, "monitor_summary", lambda job_root, results: (mon, None, ""))
    trend = [("r1", {"baseline": 0.5})]
    monkeypatch.setattr(index, "runs", lambda job_root: {"r1": {"baseline": {"job_digest": "d", "git_commit": "c"}}})
    monkeypatch.setattr(index, "mfu_trend", lambda job_root, table: list(trend))
    index.write_index(root)
    first = dict(drawn)
    assert first == {"mfu_progression": 1, "ledgers": 1, "staircase": 1, "mfu_trend": 1, "monitor": 1}
    index.write_index(root)
    assert drawn == first  # nothing changed: nothing drawn again
    trend.append(("r2", {"baseline": 0.6}))  # a second run in the history: its trend, and nothing else
    mon["verdict"] = "data"  # the monitor's summary changed: its section
    verify = root / "07_verify" / "result.json"
    d = json.loads(verify.read_text())
    d["notes"] = [*d.get("notes", []), "changed"]  # step 7's result changed: its staircase
    write_json_atomic(verify, d)
    index.write_index(root)
    assert drawn == first | {"mfu_trend": 2, "monitor": 2, "staircase": 2}
    baseline = root / "01_baseline" / "result.json"
    d = json.loads(baseline.read_text())
    d["metrics"]["mfu"]["value"] *= 0.9  # step 1's MFU and ledger changed: the progression and the ledgers
    d["ledger"]["items"][0]["explanation"] += " (changed)"
    write_json_atomic(baseline, d)
    index.write_index(root)
    assert drawn == first | {"mfu_trend": 2, "monitor": 2, "staircase": 2, "mfu_progression": 2, "ledgers": 2}


def test_a_kernel_run_by_the_runner_leaves_the_index_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MFU_LAB_INDEX_BY_RUNNER", "1")
    refresh_index(tmp_path)
    assert not (tmp_path / "index.html").exists()
    monkeypatch.delenv("MFU_LAB_INDEX_BY_RUNNER")
    assert "MFU_LAB_INDEX_BY_RUNNER" not in os.environ
    refresh_index(tmp_path)  # plain Python or papermill by hand: the save refreshes the page itself
    assert (tmp_path / "index.html").is_file()
