"""Step 6's same-die calibration (issue 46): the H200 run's measured MFU (tests/data/h200, 29.0% for GPT-2 124M)
calibrates a cluster of H100s, which share its GH100 compute die, in place of the assumed 40%; no predicted layout
then exceeds that measured single-device MFU."""

from __future__ import annotations

import json

from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement import strategies as ps
from mfu_lab.analysis.placement.calibration import calibrate
from mfu_lab.analysis.placement.cluster_files import load_cluster
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure import device as dev

from .conftest import ROOT

H200 = json.loads((ROOT / "tests" / "data" / "h200" / "01_baseline_result.json").read_text())


def test_the_dies_table():
    assert dev.same_die("H200", "H100 SXM") == "GH100"
    assert dev.same_die("A100", "H100 SXM") is None and dev.same_die("L40S", "L40S") is None


def test_an_h200s_mfu_calibrates_an_h100_cluster_and_caps_every_prediction():
    job = load_job(ROOT / "parameters" / "gpt2_124m_gpu.yaml")
    cluster = load_cluster(ROOT / "parameters" / "clusters" / "example_h100.yaml")
    assert cluster.gpu == "H100 SXM"
    measured = H200["metrics"]["mfu"]["value"]
    assert round(measured, 3) == 0.290
    _, cal, rows = calibrate(job, cluster, {"baseline": H200})
    row = next(r for r in rows if r["input"] == "single-GPU efficiency (MFU)")
    assert cal.efficiency == measured and row["source"] == "measured"
    assert "same GH100 compute die" in row["from"] and "H200" in row["from"]
    j = H200["job"]
    shape = pl.Shape(j["n_layers"], j["n_heads"], j["d_model"], j["seq_len"], j["micro_batch"], 124e6,
                     H200["metrics"]["model_flops_per_step"]["value"] / j["micro_batch"], 2)
    sweep, _ = ps.size_sweep(cluster, shape, cal, j["global_batch"], job.min_marginal_efficiency)
    ok = [r for r in sweep if r["status"] == "ok"]
    assert ok and max(r["mfu"] for r in ok) <= measured + 1e-9  # never above the measured 29.0%


def test_without_a_same_die_run_the_assumption_stays_and_says_so():
    job = load_job(ROOT / "parameters" / "gpt2_124m_gpu.yaml")
    cluster = load_cluster(ROOT / "parameters" / "clusters" / "example_h100.yaml")
    other = json.loads(json.dumps(H200))
    other["environment"]["device_name"] = "NVIDIA A100-SXM4-80GB"
    _, cal, rows = calibrate(job, cluster, {"baseline": other})
    row = next(r for r in rows if r["input"] == "single-GPU efficiency (MFU)")
    assert cal.efficiency == job.assumed_mfu and row["source"] == "modelled"
