"""Does the job fit its layout? Checked before anything is allocated (step 1).

The model is built on the meta device (:func:`mfu_lab.core.engine.meta_shape.job_shape`: shapes only, so a 7B float32
model of 28 GB is sized on a laptop), and its memory per rank comes from the same formulas step 6 uses
(:func:`mfu_lab.analysis.layouts.terms.memory_per_rank`: 16 B/param over t x p, over the FSDP ranks too;
activations s*b*h*(8 + 24/t)*bytes/2 per layer). What is available is measured: on a GPU each device's free
memory (``torch.cuda.mem_get_info``); on a CPU the machine's available memory, which the ranks share, so there
"fits" means the ranks together fit. A job that does not fit is refused with the layouts of this node that
would, and their memory per rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mfu_lab.analysis.layouts import terms as layout_terms
from mfu_lab.core.engine.layout import Layout, beyond_ddp
from mfu_lab.core.engine.meta_shape import job_shape
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import Job

GIB = 2 ** 30


def available_bytes(device_type: str, world: int) -> tuple[float, str]:
    """(bytes one rank may use, how it was read): a GPU's free memory, or the CPU's available memory / world."""
    if device_type == "cuda":  # pragma: no cover - GPU only
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        return float(free), "the smallest free memory of this node's GPUs (torch.cuda.mem_get_info)"
    avail = _mem_available()
    return avail / world, (f"this machine's available memory ({avail / GIB:.1f} GiB, /proc/meminfo MemAvailable) "
                           f"shared by {world} rank(s)")


def _mem_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_fit(job: Job, device_type: str, world: int, node_world: int | None = None,
              available: tuple[float, str] | None = None) -> dict[str, Any]:
    """The job's memory per rank in its layout over ``world`` ranks against what is available; a record for the
    result, or :class:`StepError` naming the layouts of ``node_world`` ranks that would fit."""
    shape = job_shape(job)
    act = 4 if job.dtype == "float32" else 2
    if None in (shape.n_layers, shape.n_heads, shape.d_model):
        missing = [k for k in ("n_layers", "n_heads", "d_model") if getattr(shape, k) is None]
        return {"checked": False, "reason": f"the model's {', '.join(missing)} could not be read on the meta "
                "device: memory not checked before the run", "params": shape.params}
    ms = layout_terms.memory_shape(shape.params, shape.n_layers, shape.n_heads, shape.d_model, job.seq_len,
                                   job.micro_batch, act, job.activation_checkpointing, job.attention == "unfused",
                                   job.ddp_grad_as_bucket_view)
    layout = Layout.from_job(job, world)
    mem = layout_terms.memory_per_rank(ms, layout)
    per_rank, where = available if available is not None else available_bytes(device_type, world)
    need = mem["total"].value
    record = {"checked": True, "params": shape.params, "layout": layout.name, "bytes_per_rank": need,
              "available_per_rank": per_rank, "available_how": where,
              "by_kind": {k: m.value for k, m in mem.items()}, "source": "analytic",
              "formula": "analysis.layouts.terms.memory_per_rank (step 6's memory formulas, with FSDP sharding)"}
    if need <= per_rank:
        return record
    fit = layout_terms.layouts_that_fit(ms, node_world or world, per_rank, max(job.pp_microbatches, 1), job.sp)
    names = "; ".join(f"{c['name']} ({c['bytes_per_rank'] / GIB:.1f} GiB per rank)" for c in fit[:6])
    raise StepError(
        f"the job does not fit its layout {layout.name}: {need / GIB:.1f} GiB per rank (analytic: parameters, "
        f"gradients, AdamW state and activations of {shape.params / 1e9:.2f}B parameters) against "
        f"{per_rank / GIB:.1f} GiB available per rank ({where}). "
        + (f"Layouts of {node_world or world} ranks that would fit: {names}. Set dp_mode, tp and pp in the job "
           "to one of them." if fit else
           f"No layout of {node_world or world} ranks fits: use more nodes (nnodes), a smaller micro_batch, "
           "activation_checkpointing: true, or a smaller model."))


def one_process_note(job: Job, what: str, in_layout_instead: str) -> dict[str, str] | None:
    """A skipped-list entry for a step that measures on one process (steps 4 and 5) while the job trains in its
    own layout: what it measured instead, and where the layout's figure comes from; None for a plain job."""
    if not beyond_ddp(job):
        return None
    parts = [p for p in ("FSDP2" if job.dp_mode == "fsdp" else "", f"tp {job.tp}" if job.tp > 1 else "",
                         f"pp {job.pp}" if job.pp > 1 else "") if p]
    return {"what": f"{what} in the job's layout ({', '.join(parts)})",
            "reason": f"measured on one process holding the whole model, not per rank in the layout: "
                      f"{in_layout_instead}; step 7 runs the adopted change in the layout, side by side"}
