"""Step 6's node layouts (issue 29): every layout this node's ranks can form
(:func:`mfu_lab.analysis.layouts.node_layouts.node_layouts`), run in one torchrun launch
(:func:`mfu_lab.workers.layout_launch.run_layouts`: the ranks rebuild the model per layout, start-up is paid
once), each checked against one process's loss, timed for a few steps, its collectives counted, its memory
read, its pipeline fill and drain measured; then each term beside the placement model's figure
(:func:`mfu_lab.analysis.layouts.node_layouts.layout_entry`). A layout that fails is recorded with its reason; a launch
that fails records every layout left, never the step.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from mfu_lab.analysis.layouts.node_layouts import Facts, layout_entry, node_layouts
from mfu_lab.analysis.placement import model as pl
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.budget import fit_count
from mfu_lab.core.process.progress import as_progress
from mfu_lab.workers.launch import world_layout
from mfu_lab.workers.layout_launch import run_layouts

CHECK_STEPS = 2  # the loss check's steps per layout (the worker's default is 3): the second step has trained once


def job_facts(job: Job, shape: pl.Shape) -> Facts:
    """The root FSDP group's parameters (those outside the blocks: embeddings, final norm, head), the head a
    pipeline unties (core.engine.parallelize.tied_head, as untie_head tells it), whether this torch reshards the root,
    and
    the checkpoint's early stop (the reference model and parallelize use
    torch.utils.checkpoint's default, which stops early: 5 TP collectives a layer)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from mfu_lab.core.engine.parallelize import tied_head
    from mfu_lab.core.engine.tp_plan import blocks_of
    from mfu_lab.core.engine.workload import build_model

    with torch.device("meta"):  # parameter counts only: no memory, no weights
        model = build_model(job)
    in_blocks = sum(p.numel() for b in blocks_of(model) or [] for p in b.parameters())  # none: one root group
    root = float(sum(p.numel() for p in model.parameters()) - in_blocks)
    tied = float(head.weight.numel()) if (head := tied_head(model)) is not None else 0.0
    # torch 2.13 reshards the root when told explicitly (parallelize passes reshard_after_forward to every group)
    return Facts(shape, root, hasattr(FSDPState(), "_auto_reshard_after_forward"), early_stop=True,
                 head_params=tied)


def _events(progress, names: list[str], t0: float):
    """The ranks' events as one line per layout started and finished, and a heartbeat between."""
    p = as_progress(progress)
    beat = p.heartbeat("  node layouts")

    def on(ev: dict) -> None:
        kind = ev.get("event")
        if kind == "start":
            i = ev["index"]
            p.say(f"  layout {i + 1}/{len(names)}: {names[i]} ({time.perf_counter() - t0:.0f} s so far)")
        elif kind == "done" and ev.get("status") != "ok":
            p.say(f"  {names[ev['index']]}: {ev.get('status')}: {str(ev.get('reason', ''))[:160]}")
        else:
            beat.beat(what=kind or "")

    return on


REBUILD_STEPS = 3  # a layout's model rebuild and the check's one-process reference, in steps (the estimate below)


def layout_seconds(job: Job, step_s: float) -> float:
    """Estimated seconds of one layout in the launch: the check's steps in the layout and in one process, the
    warm-up and timed steps, and :data:`REBUILD_STEPS` for the rebuild, each at twice ``step_s`` (the job's step in
    one process: a rank gets one thread of two). On the default job (2-core AMD EPYC, 2026-12-03) it read 12.4 s
    against 12.2 s measured per layout."""
    return (2 * CHECK_STEPS + job.comm_warmup_steps + job.comm_steps + REBUILD_STEPS) * 2 * step_s


def budget_order(job: Job, items: list[dict]) -> list[dict]:
    """The layouts in the order a budget keeps them: the job's own first (every proposal is against it), then the
    first of each family (data parallel, FSDP, tensor parallel, pipeline), then the rest in their order."""
    from mfu_lab.analysis.layouts.proposal import is_own_layout

    def family(name: str) -> str:
        return next((f for f in ("fsdp", "tp", "pp", "ddp") if name.startswith(f)), name)

    own = [it for it in items if is_own_layout(job, it["name"])][:1]
    firsts, seen = [], {family(it["name"]) for it in own}
    for it in items:
        if family(it["name"]) not in seen:
            seen.add(family(it["name"]))
            firsts.append(it)
    return own + firsts + [it for it in items if it not in own and it not in firsts]


def measure_layouts(job: Job, device_type: str, work: Path, shape: pl.Shape, compute_s: float | None,
                    progress=None, left_s: float | None = None, step_s: tuple[float, str] | None = None
                    ) -> tuple[list[dict], dict]:
    """Every layout of this node, measured and held against the model: (entries, about). ``compute_s``: the
    compute one rank gets when the ranks run at once (the co-location pair), for the step-time model.
    ``about``: the world, the backend, the steps per layout, the launch's seconds. Under a budget (``left_s``
    seconds left of step 6's share, ``step_s`` the job's step and where it comes from), the layouts that fit by
    :func:`layout_seconds` in :func:`budget_order`; ``about["budget"]`` says which were left out."""
    p = as_progress(progress)
    nnodes, nproc = world_layout(job, device_type)
    world = nnodes * nproc
    items = node_layouts(world, job.n_heads, job.n_layers, job.micro_batch, job.pp_microbatches)
    cut: list[str] = []
    if left_s is not None and step_s is not None and items:
        each = layout_seconds(job, step_s[0])
        keep = fit_count(left_s, len(items), each, least=1)
        if keep < len(items):
            ordered = budget_order(job, items)
            items, cut = ordered[:keep], [it["name"] for it in ordered[keep:]]
    timed_on = "nccl" if device_type == "cuda" else "gloo"
    about = {"world": world, "backend": timed_on, "steps": job.comm_steps, "warmup_steps": job.comm_warmup_steps,
             "layouts": len(items), "seconds": 0.0, "nnodes": nnodes}
    if cut:
        about["budget"] = (f"{len(cut)} layout(s) not measured: {', '.join(cut)} ({left_s:.0f} s of step 6's share "
                           f"left, about {layout_seconds(job, step_s[0]):.0f} s a layout: {step_s[1]} x 2 x "
                           f"{layout_seconds(job, 1.0) / 2:.0f} steps)")
    if nnodes > 1:
        about["skipped"] = "the job spans several nodes: step 6 measures one node's layouts"
        return [], about
    if not items:
        about["skipped"] = f"{world} rank(s): no layout to form"
        return [], about
    t0 = time.perf_counter()
    p.say(f"node layouts: {len(items)} on {world} {timed_on} ranks in one launch; each checked over {CHECK_STEPS} "
          f"steps against one process, then {job.comm_warmup_steps} warm-up (comm_warmup_steps) and "
          f"{job.comm_steps} timed steps (comm_steps)")
    # the layouts' own keys come from the items; the step counts from step 2's (a few steps each)
    run_job = dataclasses.replace(job, warmup_steps=job.comm_warmup_steps, compile_mode="off", fp8_layers=[])
    fp8_note = ("fp8_layers left out of the node layouts: their terms and the link they calibrate are the job's "
                "dtype's, and FP8 under tensor parallel adds collectives of its own (the scales' all-reduces)"
                if job.fp8_layers else "")
    if fp8_note:
        p.say(f"  {fp8_note}")
    names = [it["name"] for it in items]
    runs = run_layouts(run_job, device_type, work, [{"overrides": it["overrides"]} for it in items],
                       progress=_events(progress, names, t0), steps=job.comm_steps, check_steps=CHECK_STEPS)
    about["seconds"] = time.perf_counter() - t0
    facts = job_facts(job, shape)
    entries = []
    for name, run in zip(names, runs):
        d = run.to_dict() | {"name": name}
        e = layout_entry(d, facts, compute_s, timed_on)
        e["notes"] = run.notes + ([fp8_note] if fp8_note else [])
        e["threads_per_rank"] = run.threads_per_rank
        e["loss_gap"] = (run.loss_check or {}).get("max_rel_gap")
        entries.append(e)
    ok = sum(e["status"] == "ok" for e in entries)
    p.say(f"node layouts: {ok} of {len(entries)} measured in {about['seconds']:.0f} s")
    return entries, about
