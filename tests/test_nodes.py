"""Issue 18 item 10: a step run on several nodes at once keeps every node's figures, and node 0 owns result.json."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from mfu_lab.commands.results import cmd_report
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.store import nodes
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import RESULT_FILE
from mfu_lab.core.store.history import HISTORY_FILE
from mfu_lab.core.store.results import Metric
from mfu_lab.steps.baseline import step as baseline

from .conftest import TINY


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One real step 1 result of the tiny job (not saved): each test gives each node its own step time."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path_factory.mktemp("measured")))
    return baseline.run(job, progress=lambda msg: None, write=False)


@pytest.fixture
def result(measured):
    def make(step_s: float, mfu: float):
        metrics = dict(measured.metrics, step_time_median_s=Metric(step_s, "s", "measured"),
                       mfu=Metric(mfu, "fraction", "measured"))
        return dataclasses.replace(measured, metrics=metrics)
    return make


@pytest.fixture
def job(tmp_path):
    return dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), job_name="two-nodes", nnodes=2,
                               rdzv_endpoint="node01:29500")


def test_each_node_keeps_its_figures_and_node_0_owns_the_result(job, result, monkeypatch):
    monkeypatch.setattr(nodes, "WAIT_S", 5.0)
    step_dir = job.step_dir("01_baseline")
    other = store.save(job, "baseline", result(0.52, 0.40), env={"SLURM_NODEID": "1"})
    assert other == step_dir / "nodes" / "node1.json"
    assert not (step_dir / RESULT_FILE).exists()  # node 1 never writes the step's result...
    assert not (job.output_root() / HISTORY_FILE).exists()  # ...nor the run history
    path = store.save(job, "baseline", result(0.50, 0.42), env={"SLURM_NODEID": "0"})
    data = json.loads(path.read_text())
    assert path == step_dir / RESULT_FILE
    assert data["metrics"]["step_time_median_s"]["value"] == 0.50  # node 0's figures are the step's
    n = data["nodes"]
    step = n["metrics"]["step_time_median_s"]
    assert step["values"] == {"0": 0.50, "1": 0.52}
    assert step["slowest_node"] == 1 and step["spread"] == pytest.approx(0.52 / 0.50 - 1)
    assert n["metrics"]["mfu"]["slowest_node"] is None  # a slowest node is said for times only
    assert n["missing"] == [] and "slowest node 1" in n["text"] and "4.0%" in n["text"]
    assert len((job.output_root() / HISTORY_FILE).read_text().splitlines()) == 1


def test_a_late_node_is_named_missing_then_merged_by_report(job, result, monkeypatch, capsys):
    monkeypatch.setattr(nodes, "WAIT_S", 0.05)
    path = store.save(job, "baseline", result(0.50, 0.42), env={"NODE_RANK": "0"})
    assert json.loads(path.read_text())["nodes"]["missing"] == [1]
    store.save(job, "baseline", result(0.61, 0.35), env={"NODE_RANK": "1"})
    assert cmd_report(argparse.Namespace(job_dir=str(job.output_root()))) == 0
    n = json.loads(path.read_text())["nodes"]
    assert n["missing"] == [] and n["metrics"]["step_time_median_s"]["slowest_node"] == 1
    assert "merged the nodes' results" in capsys.readouterr().out
    assert "slowest node 1" in (job.output_root() / "index.html").read_text()


def test_the_node_rank_comes_from_the_launcher_and_a_missing_one_is_said():
    assert nodes.this_node(4, {"SLURM_NODEID": "2", "NODE_RANK": "3"}).rank == 2  # Slurm before torchrun's
    assert nodes.this_node(4, {"GROUP_RANK": "3"}).how == "GROUP_RANK=3"
    guess = nodes.this_node(4, {})
    assert guess.rank == 0 and "taken as node 0" in guess.how


def test_one_node_writes_no_node_files(tmp_path, result):
    j = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), job_name="one")
    path = store.save(j, "baseline", result(0.5, 0.4), env={"SLURM_NODEID": "3"})
    assert "nodes" not in json.loads(path.read_text()) and not (path.parent / "nodes").exists()
