"""Where a job's ranks go on a cluster, and what the placement model predicts there: the placement
strategies, the fastest layout per size and the size sweep, the strategies side by side, and several
copies of the job sharing the cluster (whole racks against interleaved nodes). Every figure is
``modelled`` (:mod:`mfu_lab.analysis.placement.model`).
"""

from __future__ import annotations

import dataclasses
import math
import random

from mfu_lab.analysis.placement.cluster_files import Cluster
from mfu_lab.analysis.placement.model import (
    Calibration,
    Layout,
    Prediction,
    Shape,
    enumerate_layouts,
    groups,
    predict,
)


# ------------------------------------------------------------------ placement strategies
def free_gpus(cluster: Cluster, taken: set[int] = frozenset()) -> list[int]:
    return [g for g in range(cluster.occupied_gpus, cluster.n_gpus) if g not in taken]


def place_in_order(cluster: Cluster, n: int, taken: set[int] = frozenset()) -> list[int]:
    """Naive: ranks onto the first free GPUs in node order, wherever the free list starts."""
    free = free_gpus(cluster, taken)
    return free[:n] if len(free) >= n else []


def place_round_robin(cluster: Cluster, n: int, taken: set[int] = frozenset()) -> list[int]:
    """Spread: rank i onto the next free GPU of node i mod nodes (a scheduler that balances nodes)."""
    g = cluster.gpus_per_node
    per_node = [[x for x in free_gpus(cluster, taken) if x // g == node] for node in range(len(cluster.nodes))]
    out, node = [], 0
    while len(out) < n and any(per_node):
        if per_node[node]:
            out.append(per_node[node].pop(0))
        node = (node + 1) % len(per_node)
    return out if len(out) == n else []


def place_random(cluster: Cluster, n: int, seed: int, taken: set[int] = frozenset()) -> list[int]:
    free = free_gpus(cluster, taken)
    if len(free) < n:
        return []
    return random.Random(seed).sample(free, n)


def place_topology_aware(cluster: Cluster, lay: Layout, taken: set[int] = frozenset(),
                         nodes_allowed: list[int] | None = None) -> list[int]:
    """Each TP group inside one node; whole free nodes first, under the fewest leaf switches.

    Nodes are ranked by switch (the switches with the most wholly free nodes first), then filled with
    whole TP groups in rank order (TP innermost, then DP, then PP), so DP replicas and pipeline
    stages pack under as few switches as the job's size allows.
    """
    g = cluster.gpus_per_node
    free = set(free_gpus(cluster, taken))
    sw = cluster.node_switch
    nodes = nodes_allowed if nodes_allowed is not None else list(range(len(cluster.nodes)))
    free_of = {nd: [x for x in range(nd * g, nd * g + g) if x in free] for nd in nodes}
    whole = {s: sum(1 for nd in nodes if sw[nd] == s and len(free_of[nd]) == g) for s in set(sw.values())}
    order = sorted(nodes, key=lambda nd: (-whole[sw[nd]], sw[nd], -len(free_of[nd]), nd))
    out: list[int] = []
    tp = lay.tp
    for nd in order:
        slots = free_of[nd]
        usable = len(slots) - len(slots) % tp if tp <= g else len(slots)
        take = min(usable, lay.gpus - len(out))
        out += slots[:take]
        if len(out) == lay.gpus:
            return out
    return []


# ------------------------------------------------------------------ the strategies, the best layout, the sweep
STRATEGIES = ("topology-aware", "in order", "round-robin", "random")


def place(cluster: Cluster, strategy: str, lay: Layout, seed: int = 0, taken: set[int] = frozenset()) -> list[int]:
    if strategy == "topology-aware":
        return place_topology_aware(cluster, lay, taken)
    if strategy == "in order":
        return place_in_order(cluster, lay.gpus, taken)
    if strategy == "round-robin":
        return place_round_robin(cluster, lay.gpus, taken)
    if strategy == "random":
        return place_random(cluster, lay.gpus, seed, taken)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def best_layout(cluster: Cluster, s: Shape, gpus: int, global_batch: int, cal: Calibration, tp: int = 0,
                pp: int = 0, v: int = 1) -> Prediction | None:
    """The fastest layout that fits in memory at this size, placed topology-aware; None if none can."""
    best = None
    for lay in enumerate_layouts(s, gpus, global_batch, tp, pp, v):
        where = place_topology_aware(cluster, lay)
        if not where:
            continue
        p = predict(cluster, s, lay, where, cal)
        if p.fits and (best is None or p.step_s < best.step_s):
            best = p
    return best


def sweep_sizes(cluster: Cluster) -> list[int]:
    """1, 2, 4 ... up to the free GPUs, plus the free GPU count itself."""
    free = cluster.n_gpus - cluster.occupied_gpus
    sizes = [2 ** i for i in range(0, int(math.log2(free)) + 1)]
    return sizes + ([free] if free not in sizes else [])


def efficient_size(points: list[tuple[int, float]], threshold: float) -> tuple[int | None, list[float | None]]:
    """The largest size whose marginal efficiency has stayed >= threshold at every step up to it.

    Marginal efficiency of going from n1 to n2 GPUs: the tokens/s the added GPUs bring, per added GPU,
    over the tokens/s per GPU at n1: ((T2 - T1) / (n2 - n1)) / (T1 / n1). 1.0 is perfect scaling.
    ``points`` are (gpus, tokens/s), ascending. Returns the size and each point's marginal efficiency.
    """
    if not points:
        return None, []
    marg: list[float | None] = [None]
    best = points[0][0]
    ok = True
    for (n1, t1), (n2, t2) in zip(points, points[1:]):
        e = ((t2 - t1) / (n2 - n1)) / (t1 / n1)
        marg.append(e)
        ok = ok and e >= threshold
        if ok:
            best = n2
    return best, marg


# ------------------------------------------------------------------ several jobs sharing the cluster
def partition_whole_racks(cluster: Cluster, n_jobs: int) -> list[list[int]]:
    """Each job gets whole leaf switches' nodes (job k: the k-th block of switches), as evenly as possible."""
    sw = list(cluster.switches.values())
    per = max(1, len(sw) // n_jobs)
    out, node = [], 0
    for k in range(n_jobs):
        mine = sw[k * per:(k + 1) * per] if k < n_jobs - 1 else sw[k * per:]
        count = sum(len(x) for x in mine)
        out.append(list(range(node, node + count)))
        node += count
    return out


def partition_interleaved(cluster: Cluster, n_jobs: int) -> list[list[int]]:
    """Nodes dealt out in turn: node i to job i mod n_jobs, so every job spans every switch."""
    return [[nd for nd in range(len(cluster.nodes)) if nd % n_jobs == k] for k in range(n_jobs)]


def shared_predictions(cluster: Cluster, s: Shape, lay: Layout, cal: Calibration,
                       node_sets: list[list[int]]) -> list[Prediction] | None:
    """Place one copy of the job on each node set (topology-aware inside it) and predict each with the
    others' DP groups sharing the links they cross. None when a copy does not fit its nodes."""
    places = []
    for nodes in node_sets:
        where = place_topology_aware(cluster, lay, nodes_allowed=nodes)
        if not where:
            return None
        places.append(where)
    dp_groups = [[[p[r] for r in grp] for grp in groups(lay)["dp"]] for p in places]
    out = []
    for k, where in enumerate(places):
        others = [grp for j, gs in enumerate(dp_groups) if j != k for grp in gs]
        out.append(predict(cluster, s, lay, where, cal, neighbours=others))
    return out


# ------------------------------------------------------------------ rows for step 6's tables
def pred_row(p: Prediction, extra: dict | None = None) -> dict:
    """A prediction as a table row: its fields, the layout's label and tokens per GPU-hour, plus ``extra``."""
    d = dataclasses.asdict(p)
    d["label"] = p.layout.label()
    d["tokens_per_gpu_hour"] = p.tokens_per_gpu_hour
    return d | (extra or {})


def nodes_used(cluster: Cluster, gpus: list[int]) -> tuple[int, int]:
    """How many nodes and leaf switches these GPUs span."""
    nodes = {x // cluster.gpus_per_node for x in gpus}
    return len(nodes), len({cluster.node_switch[n] for n in nodes})


def placed_row(cluster: Cluster, p: Prediction, extra: dict | None = None) -> dict:
    """:func:`pred_row` with the nodes and switches the prediction's GPUs span."""
    nodes, switches = nodes_used(cluster, p.gpus)
    return pred_row(p, (extra or {}) | {"nodes": nodes, "switches": switches})


def strategy_rows(cluster: Cluster, shape: Shape, layout: Layout, cal: Calibration, seed: int,
                  neighbours: list[list[int]] | None = None, neighbour_weight: float = 1.0) -> list[dict]:
    """The layout placed by every strategy and predicted there: one row each, with its slowdown against
    topology-aware (``vs_aware``) when both fit. Step 6's table and the notebook's what-if both use it."""
    rows = []
    for strat in STRATEGIES:
        where = place(cluster, strat, layout, seed)
        if not where:
            rows.append({"strategy": strat, "status": "does not fit"})
            continue
        p = predict(cluster, shape, layout, where, cal, neighbours, neighbour_weight)
        rows.append(placed_row(cluster, p, {"strategy": strat, "status": "ok"}))
    aware = rows[0]
    for r in rows:
        if r.get("status") == "ok" and aware.get("status") == "ok":
            r["vs_aware"] = r["step_s"] / aware["step_s"]
    return rows


def size_sweep(cluster: Cluster, shape: Shape, cal: Calibration, global_batch: int, min_marginal: float,
               tp: int = 0, pp: int = 0, v: int = 1) -> tuple[list[dict], int | None]:
    """The fastest layout at each size of :func:`sweep_sizes` (a row each, with its marginal efficiency) and
    the efficient size (:func:`efficient_size` at ``min_marginal``)."""
    sweep, points = [], []
    for n in sweep_sizes(cluster):
        best = best_layout(cluster, shape, n, global_batch, cal, tp, pp, v)
        if best is None:
            sweep.append({"gpus_n": n, "status": "no layout", "reason": "no (tp, pp, dp) divides the model and "
                          f"global_batch {global_batch} at this size, or none fits in memory"})
            continue
        sweep.append(placed_row(cluster, best, {"status": "ok"}) | {"gpus_n": n})
        points.append((n, best.tokens_per_s))
    size, marg = efficient_size(points, min_marginal)
    for row, e in zip([r for r in sweep if r["status"] == "ok"], marg):
        row["marginal_efficiency"] = e
    return sweep, size


def shared_rows(cluster: Cluster, shape: Shape, cal: Calibration, n_jobs: int, max_gpus: int, global_batch: int,
                tp: int = 0, pp: int = 0, v: int = 1) -> tuple[list[dict], str]:
    """``n_jobs`` copies of the job on the cluster emptied of others, each as large as a power of two (at most
    ``max_gpus``) lets them all fit, with whole racks each and with nodes dealt out in turn: a row per copy
    and partition. Returns the rows and why the comparison was not made ('' when it was)."""
    empty = dataclasses.replace(cluster, occupied_gpus=0)
    per_job = max((n for n in sweep_sizes(empty) if n * n_jobs <= empty.n_gpus), default=0)
    per_job = min(per_job, max_gpus)
    if n_jobs < 2:
        return [], "placement_jobs is 1"
    lay = best_layout(empty, shape, per_job, global_batch, cal, tp, pp, v)
    if lay is None:
        return [], f"no layout of {per_job} GPUs per copy fits"
    rows = []
    for name, sets in (("whole racks", partition_whole_racks(empty, n_jobs)),
                       ("interleaved nodes", partition_interleaved(empty, n_jobs))):
        preds = shared_predictions(empty, shape, lay.layout, cal, sets)
        if preds is None:
            rows.append({"partition": name, "status": "does not fit"})
            continue
        for k, p in enumerate(preds):
            rows.append(placed_row(empty, p, {"partition": name, "job": k, "status": "ok"}))
    return rows, ""
