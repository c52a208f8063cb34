"""Issue 29, item 2: the node layouts' times calibrate the cluster predictions only over NCCL on GPUs. Constructed
layouts as a GPU run of step 6 would record them (no launch): the bubble's overhead and the TP link against hand
arithmetic, the predictions with and without them, the calibration rows and their reasons."""

import dataclasses

import pytest

from mfu_lab.analysis.layouts.calibration import GLOO_WHY, fit_link, layout_calibration, tp_points
from mfu_lab.analysis.placement import collectives
from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement import strategies as ps
from mfu_lab.analysis.placement.cluster_files import load_cluster

from .conftest import ROOT

CLUSTER = ROOT / "parameters" / "clusters" / "example_h100.yaml"
CUDA_RUN = {"world": 8, "backend": "nccl", "steps": 5}
GLOO_RUN = {"world": 2, "backend": "gloo", "steps": 5}


def _t(name, model, observed, source="measured", **kw):
    return {"term": name, "model": model, "observed": observed, "ratio": observed / model if model else None,
            "source": source, "unit": "", "note": ""} | kw


def _pp(name, bub, observed):
    """A PP layout's bubble term: the model's fraction of the step bub/(1+bub), and the measured one."""
    return {"layout": name, "status": "ok", "terms": [_t("bubble_fraction", bub / (1 + bub), observed)]}


def _tp(name, step_model, step_obs, bytes_per_layer, calls, layers=4):
    return {"layout": name, "status": "ok",
            "terms": [_t("step_time_s", step_model, step_obs),
                      _t("tp_bytes_per_layer", bytes_per_layer, bytes_per_layer, "counted", layers=layers,
                         calls=calls)]}


PP = [_pp("pp2-gpipe-m4", 1 / 4, 0.2), _pp("pp2-1f1b-m4", 1 / 4, 0.25),
      _pp("pp2-interleaved_1f1b-v2-m4", 1 / 8, 0.2)]
# tp2 and tp2-sp: the same degree and message size (1 MB), 4 all-reduces or 4 + 4 gathers/scatters a layer, 4 layers
TP_SAME = [_tp("tp2", 0.1, 0.15, 4e6, 4), _tp("tp2-sp", 0.1, 0.15, 8e6, 8)]


def test_bubble_factor_is_the_median_of_measured_over_modelled_idle_time():
    cal = layout_calibration(PP, CUDA_RUN, "cuda")
    # f/(1-f) over (p-1)/(v*m): 0.25/0.25 = 1, (1/3)/0.25 = 4/3, 0.25/0.125 = 2 -> median 4/3
    assert [p["factor"] for p in cal.bubble["points"]] == pytest.approx([1.0, 4 / 3, 2.0])
    assert cal.bubble["value"] == pytest.approx(4 / 3)
    assert cal.used and cal.bubble_used()


def test_tp_link_beta_only_when_the_points_share_degree_and_message_size():
    points, left = tp_points(TP_SAME)
    assert not left
    # tp2: 4 MB a layer x 4 layers, all-reduce bus bytes 2(t-1)/t x 16 MB = 16 MB; tp2-sp: 32 MB x (t-1)/t = 16 MB
    assert [p["bus_bytes"] for p in points] == pytest.approx([16e6, 16e6])
    assert [p["ring_steps"] for p in points] == [32, 32]  # 16 all-reduces x 2(t-1); 32 gathers/scatters x (t-1)
    assert [p["comm_s"] for p in points] == pytest.approx([0.05, 0.05])
    link = fit_link(points)
    assert link["kind"] == "beta" and link["latency_s"] is None
    assert link["busbw_gbps"] == pytest.approx(32e6 / 0.1 / 1e9)
    assert "not separable" in link["reason"]


def test_tp_link_alpha_beta_from_two_degrees():
    # alpha 10 µs a ring step, B 100 GB/s; tp2: 32 steps + 16 MB; tp4: 4 x 4 x 2 x 3 = 96 steps + 2*3/4 x 16 MB
    tp2 = 32 * 1e-5 + 16e6 / 100e9
    tp4 = 96 * 1e-5 + 24e6 / 100e9
    layouts = [_tp("tp2", 0.1, 0.1 + tp2, 4e6, 4), _tp("tp4", 0.1, 0.1 + tp4, 4e6, 4),
               _tp("tp2-fsdp4", 0.1, 0.3, 4e6, 4)]  # FSDP beside TP: left out
    cal = layout_calibration(layouts, CUDA_RUN, "cuda")
    assert cal.link["kind"] == "alpha-beta"
    assert cal.link["busbw_gbps"] == pytest.approx(100.0)
    assert cal.link["latency_s"] == pytest.approx(1e-5)
    assert [p["layout"] for p in cal.link["points"]] == ["tp2", "tp4"]
    assert cal.link_kind == "NVLink"


def _predict(cal, lay):
    c = load_cluster(CLUSTER)
    s = pl.Shape(n_layers=8, n_heads=8, d_model=1024, seq_len=1024, micro_batch=4, params=1e9,
                 flops_per_sample=6e9 * 1024, act_bytes=2)
    return pl.predict(c, s, lay, ps.place_topology_aware(c, lay), cal)


def test_used_on_cuda_the_bubble_term_changes_by_exactly_the_factor_and_tp_takes_the_link():
    base = pl.Calibration(989e12, 0.5, 0.0)
    lcal = layout_calibration(PP + TP_SAME, CUDA_RUN, "cuda")
    cal = lcal.apply(base)
    assert cal.bubble_factor == pytest.approx(4 / 3) and cal.tp_link_gbps == pytest.approx(0.32)
    assert cal.tp_link_latency_s is None  # beta only: the cluster's latency stays
    lay = pl.Layout(tp=1, pp=2, dp=8, m=8)  # no TP: only the bubble moves
    a, b = _predict(base, lay), _predict(cal, lay)
    assert b.bubble_s == pytest.approx(a.bubble_s * 4 / 3)
    assert (b.compute_s, b.tp_s, b.pp_s, b.dp_exposed_s) == (a.compute_s, a.tp_s, a.pp_s, a.dp_exposed_s)
    assert b.step_s == pytest.approx(a.step_s + a.bubble_s / 3)
    # TP inside a node: the measured bus bandwidth replaces NVLink's figure (latency kept)
    lay = pl.Layout(tp=2, pp=1, dp=8, m=1)
    a = _predict(base, lay)
    b = _predict(dataclasses.replace(base, tp_link_gbps=cal.tp_link_gbps), lay)
    c = load_cluster(CLUSTER)
    act = 1024 * 4 * 1024 * 2
    assert b.tp_s == pytest.approx(4 * 8 * collectives.allreduce_s(act, 2, 0.32, c.intra_node_latency_us * 1e-6))
    assert a.tp_s == pytest.approx(4 * 8 * collectives.allreduce_s(act, 2, c.intra_node_gbps,
                                                                  c.intra_node_latency_us * 1e-6))
    assert "intra-node TP link" in cal.sources and "pipeline bubble overhead" in cal.sources
    assert lcal.statement() == "calibrated here: pipeline bubble overhead, intra-node TP link"


def test_on_cpu_gloo_shown_not_used_and_predictions_unchanged():
    base = pl.Calibration(989e12, 0.5, 0.0)
    lcal = layout_calibration(PP + TP_SAME, GLOO_RUN, "cpu")
    assert not lcal.used and GLOO_WHY in lcal.why
    assert lcal.bubble["value"] == pytest.approx(4 / 3)  # computed and shown all the same
    assert lcal.apply(base) is base
    for lay in (pl.Layout(tp=1, pp=2, dp=8, m=8), pl.Layout(tp=2, pp=2, dp=4, m=8)):
        assert _predict(lcal.apply(base), lay) == _predict(base, lay)
    rows = lcal.rows()
    assert [r["used"] for r in rows] == [False, False, False]
    assert all(r["source"] == "measured" for r in rows)
    assert rows[0]["value"] == pytest.approx(4 / 3) and "not used: " + GLOO_WHY in rows[0]["from"]
    assert rows[1]["value"] == pytest.approx(0.32) and GLOO_WHY in rows[1]["from"]
    assert rows[2]["value"] is None and "not fitted" in rows[2]["from"]
    assert "not calibrated here: pipeline bubble overhead, intra-node TP link" in lcal.statement()
    assert GLOO_WHY in lcal.statement()


def test_nccl_rows_say_used():
    rows = layout_calibration(PP + TP_SAME, CUDA_RUN, "cuda").rows()
    assert [r["used"] for r in rows] == [True, True, False]  # beta only: no latency to use
    assert "used: timed over NCCL" in rows[0]["from"] and "used: timed over NCCL" in rows[1]["from"]


def test_missing_pp_or_tp_layouts_give_no_calibration_and_a_reason():
    base = pl.Calibration(989e12, 0.5, 0.0)
    lcal = layout_calibration(TP_SAME, CUDA_RUN, "cuda")  # no pipeline layout
    assert lcal.bubble["value"] is None and not lcal.bubble_used()
    assert "no pipeline layout" in lcal.rows()[0]["from"]
    assert lcal.apply(base).bubble_factor == 1.0
    lcal = layout_calibration(PP, CUDA_RUN, "cuda")  # no TP layout
    assert lcal.link["busbw_gbps"] is None and not lcal.link_used()
    assert "no tensor-parallel layout" in lcal.rows()[1]["from"]
    assert lcal.apply(base).tp_link_gbps is None
    assert "not calibrated here: intra-node TP link" in lcal.statement()
    lcal = layout_calibration([], {"skipped": "placement_layouts: false in the job"}, "cuda")
    assert lcal.apply(base) is base and not lcal.used
    # a TP layout without the compute-only model (no co-location run): left out with its reason
    pts, left = tp_points([_tp("tp2", None, 0.15, 4e6, 4)])
    assert not pts and "no compute-only model" in left[0]
    # failed layouts are ignored
    failed = [dict(e, status="error") for e in PP + TP_SAME]
    lcal = layout_calibration(failed, CUDA_RUN, "cuda")
    assert lcal.bubble["value"] is None and lcal.link["busbw_gbps"] is None
