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
    monitor's, the runs' trend) took 1.5 s of each write of a full run's page here, drawn again unchanged."""
    import json

    from mfu_lab.core.registry import BY_KEY
    from mfu_lab.core.store.files import write_json_atomic

    from .conftest import ROOT
    root = tmp_path / "job"  # a real default run's seven results (tests/test_index_screen.py reads them too)
    for key, d in json.loads((ROOT / "tests" / "data" / "default_run_results.json").read_text())["results"].items():
        write_json_atomic(root / BY_KEY[key].folder / "result.json", d)
    monkeypatch.setattr(index, "_DRAWN", {})
    from matplotlib.figure import Figure
    drawn, real = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or real(fig, *a, **k))
    first = index.write_index(root).read_text()
    assert drawn, "the stored run's page draws figures"
    n = len(drawn)
    assert index.write_index(root).read_text() == first and len(drawn) == n  # nothing changed: nothing drawn
    baseline = root / "01_baseline" / "result.json"
    d = json.loads(baseline.read_text())
    d["metrics"]["mfu"]["value"] *= 0.9  # step 1's result changed: its section and the progression drawn again
    write_json_atomic(baseline, d)
    index.write_index(root)
    assert len(drawn) > n


def test_a_kernel_run_by_the_runner_leaves_the_index_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MFU_LAB_INDEX_BY_RUNNER", "1")
    refresh_index(tmp_path)
    assert not (tmp_path / "index.html").exists()
    monkeypatch.delenv("MFU_LAB_INDEX_BY_RUNNER")
    assert "MFU_LAB_INDEX_BY_RUNNER" not in os.environ
    refresh_index(tmp_path)  # plain Python or papermill by hand: the save refreshes the page itself
    assert (tmp_path / "index.html").is_file()
