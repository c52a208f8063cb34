"""What a collective costs on a link, in closed form: ring and tree all-reduce, all-gather and reduce-scatter,
point-to-point sends, the pipeline bubble, the tensor-parallel collectives of a layer, and the latency and bus
bandwidth fitted to a measured all-reduce sweep. The placement model (:mod:`mfu_lab.analysis.placement.model`) and
the layouts' counted terms (:mod:`mfu_lab.analysis.layouts.terms`) add these up; the formulas live here once.
"""

from __future__ import annotations

import math

GB = 1e9


def ring_allreduce_s(nbytes: float, n: int, busbw_gbps: float, latency_s: float) -> float:
    """Ring all-reduce: 2(n-1) steps, each moving nbytes/n over the slowest link.

    t = 2(n-1)/n * nbytes / B + 2(n-1) * alpha  (Patarasuk & Yuan 2009; B is nccl-tests' bus bandwidth).
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (busbw_gbps * GB) + 2 * (n - 1) * latency_s


def tree_allreduce_s(nbytes: float, n: int, busbw_gbps: float, latency_s: float) -> float:
    """Pipelined (double binary) tree all-reduce: reduce then broadcast, each moving the whole buffer.

    t = 2 * nbytes / B + 2 * ceil(log2 n) * alpha  (NCCL's tree: latency grows with log n, not n).
    """
    if n <= 1:
        return 0.0
    return 2 * nbytes / (busbw_gbps * GB) + 2 * math.ceil(math.log2(n)) * latency_s


def allreduce_s(nbytes: float, n: int, busbw_gbps: float, latency_s: float) -> float:
    """The faster of ring and tree, as NCCL picks per size: ring for large buffers, tree for small ones at scale."""
    return min(ring_allreduce_s(nbytes, n, busbw_gbps, latency_s), tree_allreduce_s(nbytes, n, busbw_gbps, latency_s))


def p2p_s(nbytes: float, bw_gbps: float, latency_s: float) -> float:
    """One point-to-point send: alpha + nbytes / B."""
    return latency_s + nbytes / (bw_gbps * GB)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble over ideal compute time: (p-1)/m for 1F1B, (p-1)/(v*m) with v interleaved chunks.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters"), section 2.2.
    """
    return (p - 1) / (v * m)


def tp_collectives_per_layer(sp: bool = False, checkpointing: bool = False, early_stop: bool = True) -> dict[str, int]:
    """TP collectives of one transformer layer per micro-batch, by kind (Megatron-LM: Shoeybi et al. 2019, section 3;
    Korthikanti et al. 2022, sections 4.2 and 5).

    Without SP: 2 all-reduces forward (attention and MLP outputs) and 2 backward (their inputs' gradients).
    With SP each becomes an all-gather plus a reduce-scatter: 4 of each. Activation checkpointing re-runs the
    forward's collectives in backward; PyTorch's default (non-reentrant) checkpoint stops once the tensors backward
    needs are back, so the MLP output's collective is not re-run: +1 all-reduce (5 per layer), or +2 all-gathers
    and +1 reduce-scatter under SP; with ``early_stop=False`` the whole forward: +2 all-reduces (6, Megatron's
    figure), or +2 all-gathers and +2 reduce-scatters (FIELD-NOTES; counted).
    """
    redo = (1 if early_stop else 2) if checkpointing else 0
    if sp:
        return {"allgather": 4 + (2 if checkpointing else 0), "reduce_scatter": 4 + redo}
    return {"allreduce": 4 + redo}


def p2p_sends_per_rank(p: int, m: int, v: int = 1) -> float:
    """Sends per rank, averaged over the p ranks: 2*m*(p*v - 1)/p (p*v - 1 stage boundaries, m micro-batches
    each way; FIELD-NOTES, counted: 12 at p=2, v=2, m=4, not the 2*v*m = 16 the model assumed before issue 29).
    At v = 1 (GPipe, 1F1B): 2*m*(p - 1)/p, m per rank at p = 2."""
    return 2 * m * (p * v - 1) / p


def fit_alpha_beta(table: list[dict], world: int) -> tuple[float, float] | None:
    """Least-squares fit t = alpha_ring + bytes * k / B over an all-reduce size sweep (step 2's benchmark).

    Returns (per-step latency alpha, bus bandwidth B in GB/s) under the ring formula above, or None when
    the fit is not usable (fewer than two sizes, or a non-positive slope).
    """
    pts = [(r["bytes"], r["time_s"]) for r in table if r.get("time_s")]
    if len(pts) < 2 or world < 2:
        return None
    n = len(pts)
    mx = sum(b for b, _ in pts) / n
    my = sum(t for _, t in pts) / n
    sxx = sum((b - mx) ** 2 for b, _ in pts)
    if sxx == 0:
        return None
    slope = sum((b - mx) * (t - my) for b, t in pts) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        return None
    k = 2 * (world - 1) / world
    return max(0.0, intercept) / (2 * (world - 1)), k / slope / GB


def ring_gather_s(nbytes: float, n: int, busbw_gbps: float, latency_s: float) -> float:
    """Ring all-gather or reduce-scatter of an ``nbytes`` buffer (gathered output, scattered input): half a ring
    all-reduce, (n-1)/n * nbytes / B + (n-1) * alpha (nccl-tests' bus bandwidth convention)."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / (busbw_gbps * GB) + (n - 1) * latency_s
