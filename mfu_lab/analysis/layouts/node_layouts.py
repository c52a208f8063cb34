"""The layouts one node's ranks can form (step 6 measures them all, issue 29), and each one's terms: the placement
model's figure (:mod:`mfu_lab.analysis.layouts.terms`, :mod:`mfu_lab.analysis.placement.model`) beside what the
run counted or measured, with their ratio. Pure functions of plain numbers and of the run records
(:class:`mfu_lab.workers.layout_launch.LayoutRun` as dicts).

Sources: collective counts and bytes are ``counted`` (exact: the same on any device); step times, the pipeline's
fill and drain and memory are ``measured`` (on a CPU the memory by torch's MemTracker; times over gloo, which do
not transfer to GPUs).
"""

from __future__ import annotations

import dataclasses
import statistics

from mfu_lab.analysis.layouts import terms as lt
from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement.collectives import bubble_fraction, p2p_sends_per_rank, tp_collectives_per_layer

# Every layout starts from the job's data-parallel default, so a job trained in a layout of its own still races
# the node's layouts on equal terms (its dtype, precision policy and prefetch are kept).
BASE = {"dp_mode": "ddp", "fsdp_reshard_after_forward": True, "tp": 1, "sp": False, "pp": 1, "pp_schedule": "1f1b",
        "pp_virtual_stages": 1}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
INTERLEAVE = 2  # virtual stages of the interleaved schedule


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def node_layouts(world: int, n_heads: int, n_layers: int, micro_batch: int = 0,
                 pp_microbatches: int = 4) -> list[dict]:
    """Every layout ``world`` ranks can form, named as issue 29 names them, each ``{"name", "overrides"}`` (job
    keys over :data:`BASE`):

    - data parallel over every rank: ``ddp{w}``, ``fsdp{w}``, ``fsdp{w}-noreshard``;
    - tensor parallel over t ranks (t | heads), FSDP over the rest: ``tp{t}-fsdp{d}``, or at t = w ``tp{w}`` and
      ``tp{w}-sp``;
    - pipeline parallel over p ranks (p | layers), FSDP over the rest, each schedule with m = max(pp_microbatches,
      p) micro-batches (rounded up to a multiple of p): ``pp{p}[-fsdp{d}]-gpipe-m{m}``, ``-1f1b-m{m}`` and, where
      every rank's layers split in two, ``-interleaved_1f1b-v2-m{m}``. A ``micro_batch`` that m does not divide
      leaves the pipeline out (its micro-batches would be unequal).

    TP x PP together is left out: on one node it would leave at most a quarter of the ranks to data parallel.
    """
    if world < 2:
        return []
    out = [{"name": f"ddp{world}", "overrides": {}},
           {"name": f"fsdp{world}", "overrides": {"dp_mode": "fsdp"}},
           {"name": f"fsdp{world}-noreshard", "overrides": {"dp_mode": "fsdp", "fsdp_reshard_after_forward": False}}]
    for t in (t for t in _divisors(world) if n_heads % t == 0):
        d = world // t
        if d == 1:
            out += [{"name": f"tp{t}", "overrides": {"tp": t}},
                    {"name": f"tp{t}-sp", "overrides": {"tp": t, "sp": True}}]
        else:
            out.append({"name": f"tp{t}-fsdp{d}", "overrides": {"tp": t, "dp_mode": "fsdp"}})
    for p in (p for p in _divisors(world) if n_layers % p == 0):
        d = world // p
        m = -(-max(pp_microbatches, p) // p) * p
        if micro_batch and micro_batch % m:
            continue
        stem = f"pp{p}" + (f"-fsdp{d}" if d > 1 else "")
        base = {"pp": p, "pp_microbatches": m} | ({"dp_mode": "fsdp"} if d > 1 else {})
        for sched in SCHEDULES:
            if sched == "interleaved_1f1b":
                if n_layers % (p * INTERLEAVE):
                    continue
                out.append({"name": f"{stem}-{sched}-v{INTERLEAVE}-m{m}",
                            "overrides": base | {"pp_schedule": sched, "pp_virtual_stages": INTERLEAVE}})
            else:
                out.append({"name": f"{stem}-{sched}-m{m}", "overrides": base | {"pp_schedule": sched}})
    for item in out:
        item["overrides"] = BASE | item["overrides"]
    return out


# ------------------------------------------------------------------ terms
def term(name: str, model: float | None, observed: float | None, source: str, note: str = "") -> dict:
    """One row: the model's figure, the observed one, observed / model, and where the observed came from."""
    ratio = observed / model if model and observed is not None else None
    unit = ("s" if name.endswith("_s") else "fraction" if name == "bubble_fraction" else "sends"
            if name == "p2p_sends" else "bytes")
    return {"term": name, "model": model, "observed": observed, "ratio": ratio, "source": source, "unit": unit,
            "note": note}


@dataclasses.dataclass
class Facts:
    """What the terms need about the job beyond its shape: the root FSDP group's parameters, whether torch reshards
    the root, and the checkpoint's early stop (PyTorch's default: True)."""

    shape: pl.Shape  # the job's shape (micro_batch: one data-parallel rank's samples)
    root_params: float = 0.0
    root_reshards: bool = True
    head_params: float = 0.0  # a head tied to the input embedding: the copy PP's untying adds
    early_stop: bool = True
    norm_tensors_per_layer: int = 4  # the reference GPT's ln1, ln2: weight and bias


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _kind(run: dict, kind: str, what: str = "bytes") -> float:
    """The ranks' mean count or bytes of one kind of collective in the counted step."""
    return _mean(c.get(kind, {}).get(what, 0) for c in run["collectives"]) or 0.0


def layout_entry(run: dict, facts: Facts, compute_s: float | None = None, timed_on: str = "gloo") -> dict:
    """One layout's entry of step 6's ``layouts``: ``{layout, status, reason, terms, ...}`` from its run record.

    ``compute_s``: the compute one rank gets on one micro_batch when the ranks run at once (the co-location
    run's pair); the step-time model is then compute / (t*p) x (1 + bubble) and the collectives are left out
    (it shows what the layout's traffic and bubble cost beyond its share of compute). ``timed_on``: gloo on a CPU,
    nccl on GPUs; gloo's times are shown, never used to calibrate."""
    lay = run.get("layout") or {}
    entry = {"layout": run.get("name") or lay.get("name", "?"), "label": lay.get("name", ""),
             "status": run["status"], "reason": run.get("reason", ""), "terms": [], "timed_on": timed_on,
             "calibrates": timed_on != "gloo"}
    if run["status"] != "ok":
        return entry
    s = facts.shape
    tp, pp, dp = lay.get("tp", 1), lay.get("pp", 1), lay.get("dp", 1)
    fsdp, sp = lay.get("dp_mode") == "fsdp", bool(lay.get("sp")) and tp > 1
    m, v = lay.get("pp_microbatches", 1), lay.get("pp_virtual_stages", 1)
    gloo = " (gloo's: shown, not used to calibrate)" if timed_on == "gloo" else ""
    terms = entry["terms"]
    times = [max(per) for per in zip(*run["step_times_s"])] if run.get("step_times_s") else []
    step = statistics.median(times) if times else None
    bub = bubble_fraction(pp, m, v) if pp > 1 else 0.0
    model_step = compute_s / (tp * pp) * (1 + bub) if compute_s else None
    terms.append(term("step_time_s", model_step, step, "measured", "compute a rank gets / (t*p) x (1 + (p-1)/(v*m))"
                      ", no communication" + gloo if model_step else "no compute input to model it" + gloo))
    # data parallel
    params_stage = s.params / pp
    if dp > 1 and not fsdp and tp == 1:
        terms.append(term("ddp_all_reduce_bytes", lt.ddp_all_reduce_bytes(params_stage, s.grad_bytes),
                          _kind(run, "allreduce"), "counted", "params x grad bytes"))
    if fsdp and dp > 1:
        pbytes = 2 if lay.get("param_dtype") in ("bfloat16", "float16") else 4
        rbytes = 2 if lay.get("reduce_dtype") in ("bfloat16", "float16") else 4
        reshard = lay.get("reshard_after_forward", True)
        stage_params = s.params / (tp * pp)
        root = facts.root_params / tp if pp == 1 else 0.0
        # SP's collectives are all-gathers and reduce-scatters too: FSDP's share is then not separable by kind
        ag, rs = (None, None) if sp else (_kind(run, "allgather"), _kind(run, "reduce_scatter"))
        terms.append(term("fsdp_all_gather_bytes", lt.fsdp_all_gather_bytes(stage_params, pbytes, reshard, root,
                                                                            facts.root_reshards), ag, "counted",
                          f"{'2' if reshard else '1'} x params x param bytes"))
        terms.append(term("fsdp_reduce_scatter_bytes", lt.fsdp_reduce_scatter_bytes(stage_params, rbytes), rs,
                          "counted", "params x reduce bytes (gloo runs it as an all-reduce of the same input)"))
    # tensor parallel
    if tp > 1:
        per = lt.tp_bytes_per_layer(s.micro_batch, s.seq_len, s.d_model, s.act_bytes, sp, s.checkpointing,
                                    facts.early_stop)
        layers = s.n_layers / pp
        if sp:
            edge = lt.sp_boundary_bytes(s.micro_batch, s.seq_len, s.d_model, s.act_bytes)["allgather"]
            obs = (_kind(run, "allgather") - edge + _kind(run, "reduce_scatter")) / layers
        else:
            obs = _kind(run, "allreduce") / layers  # FSDP beside it gathers and reduce-scatters, never all-reduces
        calls = ((_kind(run, "allgather", "count") - 2 + _kind(run, "reduce_scatter", "count")) if sp else
                 _kind(run, "allreduce", "count")) / layers
        terms.append(term("tp_bytes_per_layer", sum(per.values()), obs, "counted",
                          f"{sum(tp_collectives_per_layer(sp, s.checkpointing, facts.early_stop).values())} "
                          "collectives of b*s*h*bytes a layer" + (", SP's two boundary all-gathers aside" if sp
                                                                   else "")) | {"layers": layers, "calls": calls})
        if sp:
            norms = lt.sp_norm_grad_all_reduces(facts.norm_tensors_per_layer * s.n_layers,
                                                facts.norm_tensors_per_layer * s.n_layers * s.d_model,
                                                4, uses=1)
            terms.append(term("sp_norm_all_reduce_bytes", norms["bytes"], _kind(run, "allreduce"), "counted",
                              "the partial LayerNorm gradients, all-reduced once before optimizer.step()"))
    # pipeline
    if pp > 1:
        terms.append(term("p2p_sends", p2p_sends_per_rank(pp, m, v), _kind(run, "send", "count"), "counted",
                          "2*m*(p*v - 1)/p per rank"))
        one = lt.p2p_send_bytes(s.micro_batch // m, s.seq_len, s.d_model, s.act_bytes, tp, sp)
        terms.append(term("p2p_send_bytes", p2p_sends_per_rank(pp, m, v) * one, _kind(run, "send"), "counted",
                          "sends x b/m*s*h*bytes"))
        b = run.get("bubble") or {}
        last = (b.get("per_pp_rank") or [{}])[-1].get("fraction")
        terms.append(term("bubble_fraction", bub / (1 + bub), last, "measured",
                          "the last pipeline rank's fill + drain (its wait for the first stage's last backward) / its "
                          "step, against (p-1)/(v*m + p-1)" + gloo))
    # memory per rank
    mem = lt.memory_per_rank(dataclasses.replace(s, root_params=facts.root_params,
                                                 pp_head_params=facts.head_params), _Lay(lay))
    shards = run.get("memory") or []
    for kind in ("params", "grads", "optimizer"):
        terms.append(term(f"memory_{kind}", mem[kind].value, _mean(r["shard_bytes"].get(kind) for r in shards),
                          "counted", "local shards' bytes after a step; model " + mem[kind].note))
    acts = _mean((r.get("peak_by_kind") or {}).get("Activation") for r in shards)
    terms.append(term("memory_activations", mem["activations"].value, acts, "measured",
                      "MemTracker's activations at the step's peak (the embeddings, logits and loss included; the "
                      "model counts the blocks'); model " + mem["activations"].note))
    return entry


@dataclasses.dataclass
class _Lay:
    """A run record's layout dict as layout_terms' duck-typed layout."""

    d: dict

    def __getattr__(self, k):
        if k == "d":
            raise AttributeError(k)
        return self.d[k]


def ratio_table(entries: list[dict]) -> list[dict]:
    """Flattened rows for the model-check table: one per term per layout."""
    return [{"layout": e["layout"], "status": e["status"]} | t for e in entries for t in e["terms"]]


def calibration_rows(entries: list[dict]) -> list[dict]:
    """Rows of step 6's calibration table, one per term, saying what the node's layouts did to the model: counts
    and bytes check its formulas on any device (the formulas are the counted ones); times calibrate cluster
    predictions only when measured over NCCL on GPUs; over gloo they are shown beside the model and not used."""
    by: dict[str, list[tuple[str, dict]]] = {}
    for e in entries:
        for t in e["terms"] if e["status"] == "ok" else []:
            by.setdefault(t["term"], []).append((e["layout"], t | {"timed_on": e["timed_on"]}))
    rows = []
    for name, got in by.items():
        ratios = [(lay, t["ratio"]) for lay, t in got if t["ratio"] is not None]
        if not ratios:
            continue
        lo, hi = min(r for _, r in ratios), max(r for _, r in ratios)
        src = got[0][1]["source"]
        span = f"observed/model {lo:.3g}-{hi:.3g} over {', '.join(lay for lay, _ in ratios)}"
        off = [lay for lay, r in ratios if abs(r - 1) > 0.01]
        if src == "counted" and not off:
            use = "calibrated here (counts and bytes hold on any device): the model uses the counted formula"
        elif src == "counted":
            use = (f"counted here, and the model is off beyond 1% on {', '.join(off)}: not corrected yet (shards: the "
                   "model holds the blocks' parameters / (t*p) and those outside them (embeddings, final norm, head) "
                   "whole under TP, with an untied head's copy under PP; a TP plan that also shards the embeddings "
                   "holds less)" if name.startswith("memory") else
                   f"counted here, and the model is off beyond 1% on {', '.join(off)}: not corrected yet")
        elif name.startswith("memory"):
            use = "checked here, not used to calibrate (MemTracker on a CPU; max_memory_allocated on GPUs)"
        elif got[0][1]["timed_on"] == "gloo":
            use = "not calibrated here: timed over gloo on a CPU, shown beside the model, not used"
        else:
            use = ("measured over NCCL: the cluster model takes the bubble's overhead and the TP link from these "
                   "(see their rows)")
        rows.append({"input": f"node layouts: {name}", "value": statistics.median(r for _, r in ratios),
                     "unit": "x", "source": src, "from": f"{use}; {span}"})
    return rows
