"""The placement model: a training step's time on a cluster, from the job's shape, its layout and where
its ranks sit. Every figure it returns is ``modelled``; the step that calls it says what each input was
calibrated from. Where ranks go (the placement strategies, the size sweep, jobs sharing the cluster) is
:mod:`mfu_lab.analysis.placement.strategies`; the queue simulation is :mod:`mfu_lab.analysis.placement.scheduler_sim`.

Ranks are numbered Megatron-style with tensor parallelism innermost:
``rank = pp_index * (dp * tp) + dp_index * tp + tp_index``. A placement maps rank -> global GPU
index (``node * gpus_per_node + local``). Groups that communicate at the same time share links: a
node's network injection bandwidth is split among the groups that leave the node, a leaf switch's
uplink among the groups that leave the switch (other jobs' groups included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mfu_lab.analysis.placement.cluster_files import Cluster
from mfu_lab.analysis.placement.collectives import (
    GB,
    allreduce_s,
    bubble_fraction,
    p2p_s,
    p2p_sends_per_rank,
    ring_gather_s,
    tp_collectives_per_layer,
)
from mfu_lab.core.measure.flops import mfu


# ------------------------------------------------------------------ the job and its layout
@dataclass(frozen=True)
class Shape:
    """What the model needs to know about the job."""

    n_layers: int
    n_heads: int
    d_model: int
    seq_len: int
    micro_batch: int
    params: float  # all parameters (gradients all-reduced by DP)
    flops_per_sample: float  # model FLOPs of one sample, forward and backward
    act_bytes: int  # bytes per activation element (2 under bf16/fp16 autocast, 4 in float32)
    grad_bytes: int = 4  # DDP all-reduces gradients in the parameters' dtype (float32 master weights)
    unfused_attention: bool = False
    checkpointing: bool = False
    checkpoint_policy: str = "full"  # with checkpointing: full | selective (core.engine.checkpointing)
    dropout: bool = False  # the reference model has no dropout: no dropout masks are stored
    residual_bytes: int = 4  # the residual stream (a checkpointed layer's input) stays in the parameters' dtype
    grad_as_bucket_view: bool = False  # DDP's gradient_as_bucket_view: no second copy of the gradients
    sequence_parallel: bool = False  # TP with sequence parallelism (or scatter/gather): p2p sends b*s*h / t
    checkpoint_early_stop: bool = True  # PyTorch's default checkpoint (5 TP collectives a layer); False: 6
    fsdp_reshard: bool = True  # FSDP2 reshard_after_forward: parameters all-gathered twice a step (once without)
    root_params: float = 0.0  # parameters outside the blocks (embeddings, final norm, head): TP leaves them whole
    pp_head_params: float = 0.0  # a head tied to the input embedding gets its own copy under PP (untied)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    m: int  # micro-batches per pipeline per optimizer step (gradient accumulation)
    v: int = 1  # interleaved chunks per pipeline stage
    fsdp: bool = False  # FSDP2 (ZeRO-3) over the dp ranks instead of DDP: weights, gradients, Adam's state sharded
    gpipe: bool = False  # GPipe keeps all m micro-batches' activations in flight; 1F1B (the default) min(p, m)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return (f"TP{self.tp} PP{self.pp}{f'x{self.v}' if self.v > 1 else ''} {'FSDP' if self.fsdp else 'DP'}{self.dp}"
                f" m{self.m}")


def state_bytes(s: Shape, lay: Layout) -> dict[str, float]:
    """Per-GPU parameter, gradient and optimizer-state bytes, and DDP's bucket copy of the gradients.

    16 B/param with AdamW: float32 weights (4) + gradients (4) + Adam's two moments (8), each GPU holding
    1/(t*p) of the parameters; FSDP (ZeRO-3, Rajbhandari et al. 2020, section 5) shards all three over the dp
    ranks too: 16/(t*p*d) B/param (FSDPMemTracker's shard bytes on CPU, FIELD-NOTES). DDP keeps a second copy of
    the gradients in its buckets (+grad_bytes per param) unless ``gradient_as_bucket_view``; FSDP has none.
    FSDP's transient unsharded block (the gathered parameters and gradients of the blocks in flight) is not
    counted. Where the shape knows them, the parameters outside the blocks (``root_params``: embeddings, final
    norm, head) are not divided by t, and a pipeline adds the untied head's copy (``pp_head_params``): the mean
    rank holds blocks/(t*p) + (root + head copy)/p, as step 6's node layouts count (issue 29).
    """
    blocks = s.params - s.root_params
    per_rank = blocks / (lay.tp * lay.pp) + (s.root_params + (s.pp_head_params if lay.pp > 1 else 0.0)) / lay.pp
    shard = per_rank / (lay.dp if lay.fsdp else 1)
    buckets = 0.0 if lay.fsdp or s.grad_as_bucket_view else s.grad_bytes * shard
    return {"params": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard, "ddp_buckets": buckets}


def activation_bytes_per_layer(s: Shape, tp: int) -> float:
    """Activation bytes one layer saves for backward per micro-batch (Korthikanti et al. 2022, section 4).

    In 16-bit units, tensor parallel without sequence parallel: s*b*h*(10 + 24/t) with dropout, of which 2*s*b*h
    are the two dropout masks, so s*b*h*(8 + 24/t) without (within 1% at t = 1 and 2, FIELD-NOTES); an unfused
    score matrix adds 5*a*s^2*b/t with dropout (softmax output, its mask and the masked output) and 2*a*s^2*b/t
    without (the softmax output). With sequence parallel every term divides by t, s*b*h*(8 + 24)/t, plus the
    all-gathered attention input that DTensor keeps whole for q, k and v's backward, s*b*h*bytes (FIELD-NOTES:
    36.25 s*b*h measured against Korthikanti's 32 at t = 2 in float32).
    """
    sbh = s.seq_len * s.micro_batch * s.d_model
    mask = 2 if s.dropout else 0
    if s.sequence_parallel:
        per_layer = sbh * (8 + mask + 24) / tp * s.act_bytes / 2 + sbh * s.act_bytes
    else:
        per_layer = sbh * (8 + mask + 24 / tp) * s.act_bytes / 2
    if s.unfused_attention:
        per_layer += ((5 if s.dropout else 2) * s.n_heads * s.seq_len ** 2 * s.micro_batch / tp
                      * s.act_bytes / 2)
    return per_layer


def selective_saved_bytes(s: Shape, tp: int) -> float:
    """Bytes a selectively checkpointed layer keeps per micro-batch (:mod:`mfu_lab.core.engine.checkpointing`: the
    outputs of ``mm``/``addmm`` and fused attention): q, k and v (3), the MLP's up-projection (4) and the attention
    output (1), each sharded over the t tensor-parallel ranks, and the two row-parallel projections' outputs (the
    attention's and the MLP's down-projection, 2), whole: s*b*h*(8/t + 2) elements at the activation dtype. An
    unfused attention's scores are recomputed (its bmm is not kept), so they add nothing here."""
    sbh = s.seq_len * s.micro_batch * s.d_model
    return sbh * (8 / tp + 2) * s.act_bytes


def activation_bytes(s: Shape, lay: Layout) -> float:
    """The first pipeline stage's activations in flight, per GPU.

    With checkpointing each layer keeps its input at the residual stream's dtype (1/t of it under sequence
    parallel) and one layer is live at a time. A selective checkpoint (``checkpoint_policy: selective``) keeps,
    besides, the linear layers' and fused attention's outputs (:func:`selective_saved_bytes`), and the one layer
    recomputed at a time holds only the rest of its activations. 1F1B keeps min(p, m) micro-batches in flight on
    stage one, GPipe all m (Narayanan et al. 2021, section 2.2).
    """
    sbh = s.seq_len * s.micro_batch * s.d_model
    per_layer = activation_bytes_per_layer(s, lay.tp)
    layers = s.n_layers / lay.pp
    kept = s.residual_bytes * sbh / (lay.tp if s.sequence_parallel else 1)
    if s.checkpointing and s.checkpoint_policy == "selective":
        saved = min(selective_saved_bytes(s, lay.tp), per_layer)
        acts = layers * (kept + saved) + (per_layer - saved)
    else:
        acts = (layers * kept + per_layer) if s.checkpointing else layers * per_layer
    return acts * (lay.m if lay.gpipe else min(lay.pp, lay.m))


def memory_bytes(s: Shape, lay: Layout) -> float:
    """Per-GPU memory: the parameters', gradients' and optimizer's shards (:func:`state_bytes`) plus the first
    pipeline stage's activations in flight (:func:`activation_bytes`)."""
    return sum(state_bytes(s, lay).values()) + activation_bytes(s, lay)


def enumerate_layouts(s: Shape, gpus: int, global_batch: int, tp: int = 0, pp: int = 0, v: int = 1,
                      max_tp: int | None = None) -> list[Layout]:
    """Every (tp, pp, dp, m) with tp*pp*dp == gpus, dp*m*micro_batch == global_batch, tp | heads, pp | layers.

    ``tp``/``pp`` fix a size when non-zero. Interleaving applies where each stage's layers split into v chunks.
    """
    out = []
    for t in range(1, gpus + 1):
        if gpus % t or s.n_heads % t or (tp and t != tp) or (max_tp and t > max_tp):
            continue
        for p in range(1, gpus // t + 1):
            if (gpus // t) % p or s.n_layers % p or (pp and p != pp):
                continue
            d = gpus // (t * p)
            if global_batch % (d * s.micro_batch):
                continue
            m = global_batch // (d * s.micro_batch)
            vv = v if p > 1 and (s.n_layers // p) % v == 0 else 1
            out.append(Layout(t, p, d, m, vv))
    return out


# ------------------------------------------------------------------ ranks and their groups
def rank_coords(rank: int, lay: Layout) -> tuple[int, int, int]:
    """rank -> (tp index, dp index, pp index)."""
    return rank % lay.tp, (rank // lay.tp) % lay.dp, rank // (lay.tp * lay.dp)


def groups(lay: Layout) -> dict[str, list[list[int]]]:
    """The ranks of every TP, DP and PP group."""
    out: dict[str, dict[tuple, list[int]]] = {"tp": {}, "dp": {}, "pp": {}}
    for r in range(lay.gpus):
        t, d, p = rank_coords(r, lay)
        out["tp"].setdefault((d, p), []).append(r)
        out["dp"].setdefault((t, p), []).append(r)
        out["pp"].setdefault((t, d), []).append(r)
    return {k: list(v.values()) for k, v in out.items()}


def occupied_groups(cluster: Cluster) -> list[list[int]]:
    """The GPUs others hold (the first ``occupied_gpus``) as one data-parallel job all-reducing along rails:
    local GPU j of each of its nodes in one group, so it crosses switches once it spans several leaves."""
    g, held = cluster.gpus_per_node, cluster.occupied_gpus
    rails = [[x for x in range(held) if x % g == j] for j in range(min(g, held))]
    return [r for r in rails if len(r) > 1]


# ------------------------------------------------------------------ links
@dataclass
class Link:
    busbw_gbps: float
    latency_s: float
    level: str  # node | switch | spine


def _group_links(cluster: Cluster, gpu_groups: list[list[int]], neighbours: list[list[int]],
                 neighbour_weight: float = 1.0) -> list[Link]:
    """The bottleneck link of each group, with leaf uplinks shared by the groups that cross them.

    Inside a node: the NVLink bus bandwidth. Across nodes: each GPU drives its own share of the node's
    NICs (node_network / gpus_per_node, rail-optimised), so a group with k members on a node gets at
    most k of them. Across leaf switches: every group that crosses a switch asks the uplink for its
    NIC-limited bandwidth; when the asks exceed the uplink (nodes x node_network / oversubscription)
    each gets a proportional share. ``gpu_groups`` communicate at the same time; ``neighbours`` are other
    jobs' groups, communicating ``neighbour_weight`` of the time (1: always, the worst case), so each asks
    the uplink for that share of its bandwidth on average.
    """
    g = cluster.gpus_per_node
    sw = cluster.node_switch
    nic = cluster.node_network_gbps / g

    def nic_limit(grp):
        per_node: dict[int, int] = {}
        for x in grp:
            per_node[x // g] = per_node.get(x // g, 0) + 1
        return min(cluster.intra_node_gbps, min(k * nic for k in per_node.values())), per_node

    asks: dict[int, float] = {}
    for grp, w in [(x, 1.0) for x in gpu_groups] + [(x, neighbour_weight) for x in neighbours]:
        bw, per_node = nic_limit(grp)
        switches = {sw[nd] for nd in per_node}
        if len(switches) > 1:
            for s_ in switches:
                asks[s_] = asks.get(s_, 0.0) + w * bw
    out = []
    for grp in gpu_groups:
        bw, per_node = nic_limit(grp)
        switches = {sw[nd] for nd in per_node}
        if len(per_node) == 1:
            out.append(Link(cluster.intra_node_gbps, cluster.intra_node_latency_us * 1e-6, "node"))
            continue
        level, lat = "switch", cluster.inter_node_latency_us * 1e-6
        if len(switches) > 1:
            bw = min([bw] + [bw * min(1.0, cluster.uplink_gbps(s_) / asks[s_]) for s_ in switches])
            level, lat = "spine", 2 * lat  # up to the spine and down again
        out.append(Link(bw, lat, level))
    return out


# ------------------------------------------------------------------ the step-time model
@dataclass
class Calibration:
    """The model's inputs that are not the job's shape, each with where it came from."""

    peak_flops: float  # per GPU, job dtype (datasheet)
    efficiency: float  # single-GPU MFU (compute time = FLOPs / (peak * efficiency))
    overlap: float  # share of the DP all-reduce hidden behind backward (capped by the backward's length)
    bucket_bytes: float = 25 * 2 ** 20  # DDP bucket size: the last bucket is reduced after backward ends
    sources: dict[str, str] = field(default_factory=dict)
    # measured on this node's layouts over NCCL (analysis.layouts.calibration); the defaults keep the model as it was
    bubble_factor: float = 1.0  # the bubble's overhead over (p-1)/(v*m)
    tp_link_gbps: float | None = None  # intra-node TP groups' effective bus bandwidth
    tp_link_latency_s: float | None = None  # and their per-ring-step latency


@dataclass
class Prediction:
    layout: Layout
    gpus: list[int]
    step_s: float
    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_s: float  # the all-reduce's full time
    dp_exposed_s: float
    mfu: float
    tokens_per_s: float
    memory_gb: float
    fits: bool
    links: dict[str, str]  # group kind -> worst level and bandwidth, for the table

    @property
    def tokens_per_gpu_hour(self) -> float:
        return self.tokens_per_s * 3600 / self.layout.gpus


def fsdp_s(s: Shape, lay: Layout, link: Link | None, compute: float) -> tuple[float, float]:
    """FSDP2's traffic time per step and the part hidden by prefetching: (full, hidden).

    Per step each rank all-gathers the parameters before forward and, resharded after forward, again before
    backward (2x param bytes; 1x without resharding), and reduce-scatters the gradients once (counted:
    layout_terms.fsdp_all_gather_bytes, fsdp_reduce_scatter_bytes); its shard of params/(t*p) over the dp ranks.
    Prefetching overlaps each group's gather with the previous group's compute and each reduce-scatter with the
    next group's backward: all but the first gather and the last reduce-scatter (one group's of the blocks + root)
    hide, never more than the compute."""
    if link is None:
        return 0.0, 0.0
    shard = s.params / (lay.tp * lay.pp)
    gathers = 2 if s.fsdp_reshard else 1  # per step; under PP the stage's groups are assumed gathered once a step
    gather = gathers * ring_gather_s(shard * 4, lay.dp, link.busbw_gbps, link.latency_s)
    scatter = ring_gather_s(shard * s.grad_bytes, lay.dp, link.busbw_gbps, link.latency_s)
    full = gather + scatter
    groups_n = s.n_layers / lay.pp + 1  # one group per block and the root's
    exposed = (gather / gathers + scatter) / groups_n
    return full, max(0.0, min(full - exposed, compute))


def predict(cluster: Cluster, s: Shape, lay: Layout, placement: list[int], cal: Calibration,
            neighbours: list[list[int]] | None = None, neighbour_weight: float = 1.0) -> Prediction:
    """Step time of one optimizer step (global batch = dp * m * micro_batch samples) on this placement.

    Each term's formula is on its line; the terms add up (communication other than the DP all-reduce's
    hidden part is on the critical path).
    """
    neighbours = neighbours or []
    gr = groups(lay)
    to_gpu = [[placement[r] for r in grp] for grp in gr["tp"]], [[placement[r] for r in grp] for grp in gr["dp"]]
    tp_links = _group_links(cluster, to_gpu[0], neighbours, neighbour_weight) if lay.tp > 1 else []
    dp_links = _group_links(cluster, to_gpu[1], neighbours, neighbour_weight) if lay.dp > 1 else []
    pp_pairs = [[placement[grp[i]], placement[grp[i + 1]]] for grp in gr["pp"] for i in range(len(grp) - 1)]
    pp_links = _group_links(cluster, pp_pairs, neighbours, neighbour_weight) if lay.pp > 1 else []

    global_batch = lay.dp * lay.m * s.micro_batch
    flops = s.flops_per_sample * global_batch  # model FLOPs of the whole step
    # compute: this GPU's share of the step's FLOPs at the single-GPU efficiency
    compute = flops / lay.gpus / (cal.peak_flops * cal.efficiency)
    act = s.seq_len * s.micro_batch * s.d_model * s.act_bytes  # one micro-batch's hidden states, b*s*h
    # TP: Megatron-LM does 2 all-reduces of b*s*h forward and 2 backward per layer (attention and MLP); with
    # activation recomputation the recomputed forward repeats them: 5 under PyTorch's default checkpoint, which stops
    # early, 6 with early_stop=False (Megatron's figure); counted (tp_collectives_per_layer). Under SP each
    # all-reduce is an all-gather plus a reduce-scatter of the same bytes in all: the same time at the ring's rate
    if cal.tp_link_gbps:  # the node's measured TP link replaces the intra-node figure for TP groups inside a node
        tp_links = [Link(cal.tp_link_gbps, k.latency_s if cal.tp_link_latency_s is None else cal.tp_link_latency_s,
                         "node") if k.level == "node" else k for k in tp_links]
    worst_tp = min(tp_links, key=lambda k: k.busbw_gbps) if tp_links else None
    tp_calls = tp_collectives_per_layer(False, s.checkpointing, s.checkpoint_early_stop)["allreduce"]
    tp = (tp_calls * (s.n_layers / lay.pp) * lay.m * allreduce_s(act, lay.tp, worst_tp.busbw_gbps,
                                                                 worst_tp.latency_s) if worst_tp else 0.0)
    # PP: each micro-batch sends its activations forward and receives their gradient back at each stage boundary;
    # plain TP sends the whole b*s*h from every rank, sequence parallelism (or scatter/gather) 1/t of it
    worst_pp = min(pp_links, key=lambda k: k.busbw_gbps) if pp_links else None
    p2p_bytes = act / lay.tp if s.sequence_parallel else act
    # sends per rank: 2*m*(p*v - 1)/p (counted; the model had 2*v*m before issue 29)
    pp = (p2p_sends_per_rank(lay.pp, lay.m, lay.v) * p2p_s(p2p_bytes, worst_pp.busbw_gbps, worst_pp.latency_s)
          if worst_pp else 0.0)
    # bubble: (p-1)/(v*m) of every micro-batch's time on the critical path idles in the pipeline's fill and
    # drain: its compute, its TP all-reduces and its p2p sends (Narayanan et al. 2021, section 2.2)
    bubble = (compute + tp + pp) * bubble_fraction(lay.pp, lay.m, lay.v) * cal.bubble_factor
    # DP: one all-reduce of this GPU's gradient shard, params/(tp*pp) * grad_bytes, over the slowest DP group
    worst_dp = min(dp_links, key=lambda k: k.busbw_gbps) if dp_links else None
    if lay.fsdp:
        dp, hidden = fsdp_s(s, lay, worst_dp, compute)
    else:
        dp = allreduce_s(s.params / (lay.tp * lay.pp) * s.grad_bytes, lay.dp, worst_dp.busbw_gbps,
                         worst_dp.latency_s) if worst_dp else 0.0
        # hidden: the overlapped share, but never more than the last micro-batch's backward (2/3 of its compute),
        # and never the last bucket, whose all-reduce starts when backward ends
        shard = s.params / (lay.tp * lay.pp) * s.grad_bytes
        last = (allreduce_s(min(cal.bucket_bytes, shard), lay.dp, worst_dp.busbw_gbps, worst_dp.latency_s)
                if worst_dp else 0.0)
        hidden = max(0.0, min(cal.overlap * dp, 2 / 3 * compute / lay.m, dp - last))
    step = compute + bubble + tp + pp + (dp - hidden)
    mem = memory_bytes(s, lay)
    links = {k: (f"{w.level}, {w.busbw_gbps:.0f} GB/s" if w else "-") for k, w in
             (("tp", worst_tp), ("pp", worst_pp), ("dp", worst_dp))}
    return Prediction(lay, placement, step, compute, bubble, tp, pp, dp, dp - hidden,
                      mfu(flops, 1 / step, lay.gpus * cal.peak_flops), global_batch * s.seq_len / step, mem / GB,
                      mem <= 0.9 * cluster.gpu_memory_gb * GB, links)
