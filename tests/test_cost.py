"""Issue 20, no repeated work: a run redraws a step's section of the index only when its result changed, and a
notebook run by ``mfu-lab run`` leaves the index to the runner."""

from __future__ import annotations

import os

from mfu_lab import refresh_index
from mfu_lab.report import index


def test_an_unchanged_result_is_drawn_once_per_process(monkeypatch):
    drawn = []
    monkeypatch.setitem(index.SECTIONS, "baseline", lambda d: drawn.append(d) or index.Markup("<p>s</p>"))
    monkeypatch.setattr(index, "_RENDERED", {})
    d = {"metrics": {"mfu": {"value": 0.5}}}
    assert index._section("baseline", d) == index._section("baseline", dict(d)) == "<p>s</p>"
    assert len(drawn) == 1
    index._section("baseline", {"metrics": {"mfu": {"value": 0.6}}})  # a new result: drawn again
    assert len(drawn) == 2


def test_a_kernel_run_by_the_runner_leaves_the_index_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MFU_LAB_INDEX_BY_RUNNER", "1")
    refresh_index(tmp_path)
    assert not (tmp_path / "index.html").exists()
    monkeypatch.delenv("MFU_LAB_INDEX_BY_RUNNER")
    assert "MFU_LAB_INDEX_BY_RUNNER" not in os.environ
    refresh_index(tmp_path)  # plain Python or papermill by hand: the save refreshes the page itself
    assert (tmp_path / "index.html").is_file()
