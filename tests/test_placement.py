"""Step 6: the placement model's formulas, the placements, the readers and the step end to end."""

import dataclasses
import json
import math

import pytest

from mfu_lab.analysis.placement import collectives
from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement import scheduler_sim as sim
from mfu_lab.analysis.placement import strategies as ps
from mfu_lab.analysis.placement.cluster_files import (
    ClusterError,
    QueueEntry,
    expand_hostlist,
    load_cluster,
    parse_nvidia_smi_topo,
    parse_topology_conf,
)
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job

from .conftest import ROOT, TINY

CLUSTERS = ROOT / "parameters" / "clusters"


# ------------------------------------------------------------------ formulas against hand-worked values
def test_ring_and_tree_allreduce_against_hand_worked_values():
    # 1 GB over 8 GPUs at 100 GB/s: ring moves 2*7/8 GB per link = 17.5 ms, plus 2*7 latencies of 10 µs
    assert collectives.ring_allreduce_s(1e9, 8, 100, 10e-6) == pytest.approx(0.0175 + 14 * 10e-6)
    # tree: 2 * 1 GB / 100 GB/s = 20 ms, plus 2 * log2(8) = 6 latencies
    assert collectives.tree_allreduce_s(1e9, 8, 100, 10e-6) == pytest.approx(0.020 + 6 * 10e-6)
    assert collectives.allreduce_s(1e9, 8, 100, 10e-6) == pytest.approx(0.0175 + 14e-5)  # large: ring wins
    # 1 kB over 64 GPUs: ring pays 126 latencies (1.26 ms), tree 12 (0.12 ms) -> tree wins
    assert collectives.allreduce_s(1e3, 64, 100, 10e-6) == pytest.approx(2e3 / 100e9 + 12 * 10e-6)
    assert collectives.ring_allreduce_s(1e9, 1, 100, 1e-5) == 0.0
    assert collectives.p2p_s(50e9, 50, 1e-5) == pytest.approx(1.0 + 1e-5)


def test_bubble_fraction_plain_and_interleaved():
    assert collectives.bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert collectives.bubble_fraction(4, 8, v=2) == pytest.approx(3 / 16)
    assert collectives.bubble_fraction(1, 8) == 0.0


def test_alpha_beta_fit_recovers_the_latency_and_bandwidth_it_was_built_from():
    world, alpha, bw = 4, 20e-6, 12.5
    sizes = [2 ** k for k in range(12, 27, 2)]
    table = [{"bytes": b, "time_s": collectives.ring_allreduce_s(b, world, bw, alpha)} for b in sizes]
    a, b = collectives.fit_alpha_beta(table, world)
    assert a == pytest.approx(alpha, rel=1e-6)
    assert b == pytest.approx(bw, rel=1e-6)
    assert collectives.fit_alpha_beta(table[:1], world) is None


def test_efficient_size_is_the_last_size_before_marginal_efficiency_drops():
    pts = [(1, 100.0), (2, 200.0), (4, 380.0), (8, 600.0), (16, 1300.0)]
    size, marg = ps.efficient_size(pts, 0.8)
    # 1->2: (100/1)/100 = 1.0; 2->4: (180/2)/100 = 0.9; 4->8: (220/4)/95 = 0.58 stops the run, even if 16 recovers
    assert marg[1] == pytest.approx(1.0) and marg[2] == pytest.approx(0.9)
    assert marg[3] == pytest.approx((220 / 4) / (380 / 4))
    assert size == 4


def _shape(**kw):
    base = dict(n_layers=8, n_heads=8, d_model=1024, seq_len=1024, micro_batch=4, params=1e9,
                flops_per_sample=6e9 * 1024, act_bytes=2)
    return pl.Shape(**(base | kw))


def test_memory_formula_by_hand():
    s = _shape()
    lay = pl.Layout(tp=2, pp=2, dp=1, m=8)
    sbh = 1024 * 4 * 1024
    per_layer = sbh * (8 + 24 / 2)  # bytes, 2-byte activations, no dropout masks (Korthikanti: 10 with them)
    # 16 B/param + DDP's bucket copy of the gradients (4 B/param); 4 layers per stage, 2 micro-batches in flight
    expected = 20e9 / 4 + 4 * per_layer * 2
    assert pl.memory_bytes(s, lay) == pytest.approx(expected)
    with_dropout = dataclasses.replace(s, dropout=True, grad_as_bucket_view=True)
    assert pl.memory_bytes(with_dropout, lay) == pytest.approx(16e9 / 4 + 4 * sbh * (10 + 24 / 2) * 2)
    unfused = dataclasses.replace(s, unfused_attention=True, grad_as_bucket_view=True)
    scores = 2 * 8 * 1024 ** 2 * 4 / 2  # 2*a*s^2*b/t: the softmax output only, without dropout
    assert pl.memory_bytes(unfused, lay) == pytest.approx(16e9 / 4 + 4 * (per_layer + scores) * 2)
    ckpt = dataclasses.replace(s, checkpointing=True, grad_as_bucket_view=True)
    # each layer keeps its input at the residual's 4 bytes; one layer is live
    assert pl.memory_bytes(ckpt, lay) == pytest.approx(16e9 / 4 + (4 * 4 * sbh + per_layer) * 2)


def test_layouts_respect_heads_layers_and_global_batch():
    s = _shape()
    lays = pl.enumerate_layouts(s, 16, 256)
    assert lays and all(x.gpus == 16 and 8 % x.tp == 0 and 8 % x.pp == 0 for x in lays)
    assert all(x.dp * x.m * s.micro_batch == 256 for x in lays)
    assert all(x.tp == 2 for x in pl.enumerate_layouts(s, 16, 256, tp=2))


def test_predicted_step_adds_up_its_terms_and_mfu_follows():
    c = load_cluster(CLUSTERS / "example_h100.yaml")
    s = _shape()
    cal = pl.Calibration(989e12, 0.5, 0.0)
    lay = pl.Layout(tp=2, pp=2, dp=4, m=8)
    p = pl.predict(c, s, lay, ps.place_topology_aware(c, lay), cal)
    assert p.step_s == pytest.approx(p.compute_s + p.bubble_s + p.tp_s + p.pp_s + p.dp_exposed_s)
    assert p.compute_s == pytest.approx(s.flops_per_sample * 4 * 8 * 4 / 16 / (989e12 * 0.5))
    # the bubble idles (p-1)/m of the whole critical path per micro-batch: compute, TP and p2p
    assert p.bubble_s == pytest.approx((p.compute_s + p.tp_s + p.pp_s) * 1 / 8)
    assert p.dp_exposed_s == pytest.approx(p.dp_s)  # overlap 0: nothing hidden
    assert p.mfu == pytest.approx(s.flops_per_sample * 128 / (16 * 989e12 * p.step_s))


def test_tp_traffic_with_recompute_and_p2p_without_sequence_parallelism():
    c = load_cluster(CLUSTERS / "example_h100.yaml")
    cal = pl.Calibration(989e12, 0.5, 0.0)
    lay = pl.Layout(tp=2, pp=2, dp=4, m=8)
    place = ps.place_topology_aware(c, lay)
    plain, ckpt = (pl.predict(c, _shape(checkpointing=k), lay, place, cal) for k in (False, True))
    # PyTorch's default checkpoint stops early: 5 all-reduces a layer (counted); early_stop=False repeats both: 6
    assert ckpt.tp_s == pytest.approx(plain.tp_s * 5 / 4)
    full = pl.predict(c, _shape(checkpointing=True, checkpoint_early_stop=False), lay, place, cal)
    assert full.tp_s == pytest.approx(plain.tp_s * 6 / 4)
    # sends per rank 2*m*(p*v - 1)/p: interleaving v = 2 at p = 2 sends 3x as often as v = 1 (the model had
    # 2*v*m before issue 29: 2x)
    inter = pl.predict(c, _shape(), dataclasses.replace(lay, v=2), place, cal)
    assert inter.pp_s == pytest.approx(plain.pp_s * 3)
    sp = pl.predict(c, _shape(sequence_parallel=True), lay, place, cal)
    assert plain.pp_s > sp.pp_s  # plain TP sends the whole b*s*h between stages, SP 1/t of it


# ------------------------------------------------------------------ placements
def _cluster(occupied: int, oversub: float = 2.0):
    c = load_cluster(CLUSTERS / "example_h100.yaml")
    return dataclasses.replace(c, occupied_gpus=occupied, oversubscription=oversub)


@pytest.mark.parametrize("occupied", [1, 3, 4, 6])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_topology_aware_is_never_slower_than_in_order_when_in_order_stretches_tp(occupied, tp):
    c = _cluster(occupied)
    s = _shape()
    cal = pl.Calibration(989e12, 0.5, 1.0)
    for dp in (1, 2, 4):
        lay = pl.Layout(tp=tp, pp=1, dp=dp, m=4)
        naive = ps.place_in_order(c, lay.gpus)
        tp_nodes = [{naive[r] // c.gpus_per_node for r in grp} for grp in pl.groups(lay)["tp"]]
        if not any(len(n) > 1 for n in tp_nodes):
            continue
        aware = ps.place_topology_aware(c, lay)
        assert all(len({aware[r] // c.gpus_per_node for r in grp}) == 1 for grp in pl.groups(lay)["tp"])
        assert pl.predict(c, s, lay, aware, cal).step_s <= pl.predict(c, s, lay, naive, cal).step_s
        assert pl.predict(c, s, lay, naive, cal).links["tp"].startswith("switch")


def test_placements_use_free_gpus_once_and_respect_occupied_ones():
    c = _cluster(4)
    lay = pl.Layout(tp=8, pp=1, dp=4, m=1)
    for strat in ps.STRATEGIES:
        where = ps.place(c, strat, lay, seed=1)
        assert len(where) == 32 and len(set(where)) == 32 and min(where) >= 4
    too_big = pl.Layout(tp=1, pp=1, dp=c.n_gpus, m=1)
    assert ps.place_in_order(c, too_big.gpus) == [] and ps.place_topology_aware(c, too_big) == []


def test_groups_crossing_an_oversubscribed_uplink_split_it():
    c = _cluster(0, oversub=8.0)  # uplink of a 4-node leaf: 4 x 400 / 8 = 200 GB/s
    s = _shape()
    cal = pl.Calibration(989e12, 0.5, 0.0)
    lay = pl.Layout(tp=8, pp=1, dp=8, m=1)  # 8 DP groups, one GPU per node each, over 8 nodes in 2 switches
    racks = ps.shared_predictions(c, s, lay, cal, ps.partition_whole_racks(c, 2))
    inter = ps.shared_predictions(c, s, lay, cal, ps.partition_interleaved(c, 2))
    assert all(p.step_s <= q.step_s for p, q in zip(racks, inter))
    assert inter[0].dp_s > racks[0].dp_s


def test_gang_and_greedy_simulation_by_hand():
    q = [QueueEntry("a", 0.0, 3, 1.0), QueueEntry("b", 0.0, 3, 1.0)]
    gang = sim.simulate(q, 4, "gang")
    assert [(j.start_h, j.end_h) for j in gang.jobs] == [(0.0, 1.0), (1.0, 2.0)]
    assert gang.idle_gpu_hours == pytest.approx(1.0)  # one GPU free for an hour while b waits
    assert gang.makespan_h == 2.0 and gang.deadlock_h is None
    greedy = sim.simulate(q, 4, "greedy", horizon_h=2.0)
    assert greedy.deadlock_h == 0.0  # each holds 2 of 4, both need 3
    assert greedy.idle_gpu_hours == pytest.approx(8.0) and greedy.makespan_h is None


# ------------------------------------------------------------------ readers
def test_hostlists_keep_zero_padding():
    assert expand_hostlist("gpu[008-010],login1", "x") == ["gpu008", "gpu009", "gpu010", "login1"]
    assert expand_hostlist("n[1,3-4]", "x") == ["n1", "n3", "n4"]


def test_topology_conf_sample():
    leaves = parse_topology_conf((CLUSTERS / "topology.conf").read_text())
    assert leaves == {"leaf-a": ["gpu001", "gpu002", "gpu003", "gpu004"], "leaf-b": ["gpu005", "gpu006", "gpu008"]}


@pytest.mark.parametrize("text, line, words", [
    ("SwitchName=s0 Nodes=n[5-3]\n", 1, "runs backwards"),
    ("# c\nSwitchName=s0 Nodes=n[1-2] Speed=9\n", 2, "unknown key"),
    ("SwitchName=s0 Nodes=n[1-2]\nSwitchName=s1 Nodes=n2\n", 2, "already under switch s0"),
    ("SwitchName=s0 Nodes=n1\nSwitchName=top Switches=s0,s9\n", 2, "no line defines"),
    ("Nodes=n1\n", 1, "must name its switch"),
    ("SwitchName=s0 Nodes=n[a-b]\n", 1, "must be N or N-M"),
])
def test_malformed_topology_conf_names_the_line(text, line, words):
    with pytest.raises(ClusterError) as e:
        parse_topology_conf(text, "t.conf")
    assert f"t.conf, line {line}" in str(e.value) and words in str(e.value)


def test_nvidia_smi_topo_sample():
    t = parse_nvidia_smi_topo((CLUSTERS / "nvidia_smi_topo.txt").read_text())
    assert t.gpus == 8 and t.nics == ["NIC0", "NIC1"]
    assert t.bottleneck_gbps() == (18 * 25.0, "NV18")


def _topo(rows):
    head = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
    return head + "\n".join(rows) + "\n\nLegend:\n"


@pytest.mark.parametrize("rows, words", [
    (["GPU0\t X \tNV4\tNV4\t0-7", "GPU1\tNV4\t X \tPIX\t0-7", "GPU2\tNV4\tSYS\t X \t0-7"], "symmetric"),
    (["GPU0\t X \tNV4\tQQ\t0-7", "GPU1\tNV4\t X \tPIX\t0-7", "GPU2\tQQ\tPIX\t X \t0-7"], "unknown link"),
    (["GPU0\t X \tNV4\tNV4\t0-7", "GPU1\tNV4\t X \tPIX\t0-7"], "3 GPU columns but 2 GPU rows"),
    (["GPU0\t X \tNV4", "GPU1\tNV4\t X \tPIX\t0-7", "GPU2\tNV4\tPIX\t X \t0-7"], "has 2 cells"),
    (["GPU0\tNV4\t X \tNV4\t0-7"], "diagonal"),
])
def test_malformed_nvidia_smi_topo_is_refused_clearly(rows, words):
    with pytest.raises(ClusterError) as e:
        parse_nvidia_smi_topo(_topo(rows), "topo.txt")
    assert "topo.txt" in str(e.value) and words in str(e.value)
    with pytest.raises(ClusterError, match="no header line"):
        parse_nvidia_smi_topo("nvidia-smi: command not found\n", "topo.txt")


def test_cluster_from_slurm_and_nvidia_smi_files():
    c = load_cluster(CLUSTERS / "slurm_example.yaml")
    assert c.nodes == ["gpu001", "gpu002", "gpu003", "gpu004", "gpu005", "gpu006", "gpu008"]
    assert c.gpus_per_node == 8 and c.intra_node_gbps == 450.0
    assert "topology.conf" in c.sources["switches"] and "nvidia-smi" in c.sources["intra_node_gbps"]


@pytest.mark.parametrize("text, key, words", [
    ("gpu: H100 SXM\ngpus_per_node: 8\nintra_node_gbps: 360\nnode_network_gbps: 400\n", "switches",
     "give switches and nodes_per_switch"),
    ("gpu: TPU\ngpus_per_node: 8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n",
     "gpu", "a GPU of the device table"),
    ("gpu: A100\ngpus_per_node: -8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n",
     "gpus_per_node", "whole number >= 1"),
    ("gpu: A100\ngpus_per_node: 8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n"
     "oversubscription: 0.5\n", "oversubscription", ">= 1"),
    ("gpu: A100\ngpus_per_node: 8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n"
     "switchs: 2\n", "switchs", "unknown key"),
    ("gpu: A100\ngpus_per_node: 8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n"
     "queue: [{name: x, arrival_h: 0, gpus: 0, hours: 1}]\n", "queue[0]", "gpus a whole number >= 1"),
    ("!!python/object/apply:os.system [echo hi]\n", "(file)", "not valid YAML"),
    ("gpu: A100\ngpus_per_node: 8\nswitches: 1\nnodes_per_switch: 1\nintra_node_gbps: 1\nnode_network_gbps: 1\n"
     "occupied_gpus: 8\n", "occupied_gpus", "below the cluster's 8 GPUs"),
])
def test_bad_cluster_files_name_the_file_key_and_what_is_allowed(tmp_path, text, key, words):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ClusterError) as e:
        load_cluster(f)
    msg = str(e.value)
    assert str(f) in msg and f"'{key}'" in msg and words in msg


def test_job_keys_for_placement_are_checked():
    with pytest.raises(JobError) as e:
        load_job(TINY, {"global_batch": 10, "cluster_tp": 3, "cluster_pp": 3, "min_marginal_efficiency": 1.5})
    msg = str(e.value)
    assert "multiple of micro_batch (4)" in msg and "must divide n_heads (2)" in msg
    assert "must divide n_layers (2)" in msg and "<= 1" in msg


# ------------------------------------------------------------------ the step
def test_model_check_adds_the_fitted_allreduce_to_each_measured_compute_time():
    from mfu_lab.analysis.placement.check import Coloc, model_check
    from mfu_lab.core.measure import device as dev

    device = dev.DeviceInfo("cpu", "SomeCPU", None, None, 2)
    table = [{"bytes": b, "time_s": collectives.ring_allreduce_s(b, 2, 2.0, 1e-4)} for b in (2 ** 12, 2 ** 18, 2 ** 24)]
    comm = {"hook": "none", "bucket_mb": 25, "grad_as_bucket_view": False, "status": "ok", "step_median_s": 1.0,
            "step_p10_s": 0.9, "step_p90_s": 1.1, "no_sync_step_s": 0.95, "comm_s": 0.1, "exposed_s": 0.05}
    step2 = {"environment": {"device_name": "SomeCPU"}, "comm_layout": {"world_size": 2, "backend": "gloo"},
             "allreduce": table, "comm": [comm],
             "recommendation": {"comm": {"hook": "none", "bucket_cap_mb": 25, "gradient_as_bucket_view": False}}}
    shape = _shape(params=1e6)  # 4 MB of gradients: one bucket
    coloc = Coloc("ok", alone_median_s=0.8, pair_median_s=0.9, threads=1)
    chk = model_check(shape, {"attention_comm": step2}, coloc, device)
    ar = collectives.ring_allreduce_s(4e6, 2, 2.0, 1e-4)
    assert chk.available and chk.buckets == 1 and chk.allreduce_s == pytest.approx(ar, rel=1e-6)
    pair = next(r for r in chk.rows if r["name"].startswith("two at once"))
    assert pair["predicted_s"] == pytest.approx(0.9 + ar, rel=1e-6)  # one bucket: nothing hides
    assert pair["error"] == pytest.approx((0.9 + ar - 1.0) / 1.0, rel=1e-6)
    # the headline is the row the cluster predictions use: where ranks share a device (a CPU), the compute a rank
    # really gets, the co-location run with as many copies as ranks (issue 29), never the row that lands closest
    assert chk.headline == "two at once, as ranks, model's overlap rule" and chk.used()["name"] == chk.headline
    step1 = {"environment": {"device_name": "SomeCPU", "torch_threads": 2},
             "metrics": {"step_time_median_s": {"value": 0.5}}}
    chk = model_check(shape, {"attention_comm": step2, "baseline": step1}, coloc, device)
    assert chk.headline == "two at once, as ranks, model's overlap rule"  # not step 1's, which had both cores
    assert chk.used()["predicted_s"] == pytest.approx(0.9 + ar, rel=1e-6)
    # no co-location run: step 2's no_sync steps, still not step 1's
    chk = model_check(shape, {"attention_comm": step2, "baseline": step1}, Coloc("failed", "x"), device)
    assert chk.headline == "step 2 no_sync steps, model's overlap rule"
    assert chk.used()["predicted_s"] == pytest.approx(0.95 + ar, rel=1e-6)
    # a rank with a GPU to itself: step 1's single process
    gpu = dev.DeviceInfo("cuda", "SomeCPU", None, None, 1)
    chk = model_check(shape, {"attention_comm": step2, "baseline": step1}, coloc, gpu)
    assert chk.headline == "step 1 single process, model's overlap rule"
    assert abs(chk.used()["error"]) > min(abs(r["error"]) for r in chk.rows)  # not the luckiest row
    assert not model_check(shape, {}, coloc, device).available


def test_step_runs_in_plain_python_and_labels_cluster_figures_modelled(tiny_job, monkeypatch):
    from mfu_lab.core.store.files import read_json
    from mfu_lab.steps.placement import step as placement

    # the node's layouts are launched in tests/test_layouts_step6.py; here their entries as the step files them
    seen = {}

    def layouts(job, device_type, work, shape, compute_s, progress=None, left_s=None, step_s=None):
        seen["compute_s"], seen["left_s"] = compute_s, left_s
        t = {"term": "tp_bytes_per_layer", "model": 2.0, "observed": 2.0, "ratio": 1.0, "source": "counted",
             "unit": "bytes", "note": ""}
        return ([{"layout": "tp2", "status": "ok", "terms": [t], "timed_on": "gloo"},
                 {"layout": "pp2-1f1b-m4", "status": "crashed", "reason": "rank 1 exited", "terms": [],
                  "timed_on": "gloo"}], {"world": 2, "backend": "gloo", "steps": 3, "seconds": 1.0})

    monkeypatch.setattr(placement, "measure_layouts", layouts)
    job = dataclasses.replace(tiny_job, coloc_steps=3, global_batch=64)
    r = placement.run(job, progress=lambda m: None)
    assert seen["compute_s"] == r.coloc.pair_median_s  # the compute a rank gets beside the others
    assert seen["left_s"] is None and r.budget["planned_s"] is None  # no budget: every layout
    assert [e["layout"] for e in r.layouts] == ["tp2", "pp2-1f1b-m4"] and r.metric("layouts_measured") == 1
    assert {"what": "layout pp2-1f1b-m4", "reason": "crashed: rank 1 exited"} in r.skipped  # the step went on
    row = next(c for c in r.calibration if c["input"] == "node layouts: tp_bytes_per_layer")
    assert row["source"] == "counted" and "calibrated here" in row["from"]
    d = read_json(job.step_dir("06_placement") / "result.json")
    assert d["metrics"]["predicted_mfu"]["source"] == "modelled"
    assert d["metrics"]["coloc_slowdown"]["source"] == "measured"
    assert r.coloc.status == "ok" and len(r.coloc.pair_s) == 2 and all(len(x) == 3 for x in r.coloc.pair_s)
    assert r.coloc.slowdown == pytest.approx(r.coloc.pair_median_s / r.coloc.alone_median_s)
    assert not r.check.available and "step 2 has not run" in r.check.reason
    eff = next(c for c in r.calibration if c["input"].startswith("single-GPU"))
    assert eff["source"] == "modelled" and eff["value"] == job.assumed_mfu  # the CPU is not an H100
    ok = [x for x in r.sweep if x["status"] == "ok"]
    assert [x["gpus_n"] for x in ok] == sorted(x["gpus_n"] for x in ok)
    assert r.efficient_size in [x["gpus_n"] for x in ok]
    assert {s["strategy"] for s in r.strategies} == set(ps.STRATEGIES)
    assert "#SBATCH --switches=" in r.hints["slurm"] and "podset-required-topology" in r.hints["kueue"]
    assert {g["policy"] for g in r.gang} == {"gang", "greedy"}
    json.dumps(d)  # serialisable as written
    assert math.isfinite(d["metrics"]["predicted_step_s"]["value"])


def test_a_missing_cluster_file_stops_the_step_before_any_work(tiny_job):
    from mfu_lab.steps.placement import step as placement

    job = dataclasses.replace(tiny_job, cluster="parameters/clusters/nope.yaml")
    with pytest.raises(ClusterError, match="no such cluster file"):
        placement.run(job, progress=lambda m: None)
    assert not job.step_dir("06_placement").exists()


def test_notebook_runs_under_papermill_after_the_other_steps(full_run):
    from .test_e2e import assert_offline

    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    folder = job_root / "06_placement"
    nb = json.loads((folder / "06_placement.ipynb").read_text())
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5  # check, sweep, strategies, map, gang
    d = json.loads((folder / "result.json").read_text())
    assert d["check"]["available"], d["check"]["reason"]  # step 2 ran first: the model is checked against it
    measured = d["check"]["measured_s"]
    for row in d["check"]["rows"]:
        assert row["error"] == pytest.approx((row["predicted_s"] - measured) / measured)
    report = (folder / "report.html").read_text()
    assert "The model against this machine" in report and "two copies at once" in report
    index = (job_root / "index.html").read_text()
    assert "Step 6 · Placement" in index and 'href="06_placement/report.html"' in index
    assert_offline(index)


def test_calibration_uses_measurements_only_from_the_clusters_gpu(tiny_job):
    from mfu_lab.analysis.placement.calibration import calibrate

    c = load_cluster(CLUSTERS / "example_h100.yaml")
    table = [{"bytes": b, "time_s": collectives.ring_allreduce_s(b, 8, 300.0, 5e-6)}
             for b in (2 ** 20, 2 ** 24, 2 ** 28)]
    comm = {"hook": "none", "bucket_mb": 25, "grad_as_bucket_view": False, "status": "ok", "comm_s": 0.010,
            "exposed_s": 0.004}
    rec = {"comm": {"hook": "none", "bucket_cap_mb": 25, "gradient_as_bucket_view": False}}

    def earlier(device, backend):
        env = {"device_name": device}
        return {"baseline": {"environment": env, "metrics": {"mfu": {"value": 0.47}}},
                "attention_comm": {"environment": env, "metrics": {"mfu": {"value": 0.52}}, "comm": [comm],
                                   "comm_layout": {"world_size": 8, "backend": backend, "nnodes": 1},
                                   "allreduce": table, "recommendation": rec}}

    on_gpu, cal, rows = calibrate(tiny_job, c, earlier("NVIDIA H100 80GB HBM3", "nccl"))
    by = {r["input"]: r for r in rows}
    assert cal.efficiency == 0.52 and by["single-GPU efficiency (MFU)"]["source"] == "measured"  # best of steps
    assert on_gpu.intra_node_gbps == pytest.approx(300.0) and by["intra-node bus bandwidth"]["source"] == "measured"
    assert cal.overlap == pytest.approx(0.6)  # 1 - 4 / 10 ms
    on_cpu, cal2, rows2 = calibrate(tiny_job, c, earlier("AMD EPYC", "gloo"))
    by2 = {r["input"]: r for r in rows2}
    assert cal2.efficiency == tiny_job.assumed_mfu and by2["single-GPU efficiency (MFU)"]["source"] == "modelled"
    assert on_cpu.intra_node_gbps == c.intra_node_gbps and "not recalibrated" in by2["intra-node bus bandwidth"]["from"]
