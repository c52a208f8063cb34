"""Does the job fit its layout? Checked before anything is allocated (step 1).

The model is built on the meta device (:func:`mfu_lab.core.engine.meta_shape.job_shape`: shapes only, so a 7B float32
model of 28 GB is sized on a laptop), and its memory per rank comes from the same formulas step 6 uses
(:func:`mfu_lab.analysis.layouts.terms.memory_per_rank`: 16 B/param over t x p, over the FSDP ranks too;
activations s*b*h*(8 + 24/t)*bytes/2 per layer). What is available is measured: on a GPU each device's free
memory (``torch.cuda.mem_get_info``); on a CPU the machine's available memory, or its cgroup's when lower
(:mod:`mfu_lab.core.measure.host`), which the ranks share, so there "fits" means the ranks together fit. A job that
does not fit is refused with the layouts of this node that would, and their memory per rank.

Before a run (``mfu-lab validate``, the start of ``mfu-lab run`` and ``step``), :func:`before_run` refuses the
reference model's job that memory cannot hold (exit 2, naming the key) and, on a CPU, says what step 1's training
alone is estimated to take when that is long: a ``seq_len`` of 100,000 is accepted, and said to take hours, but never
refused for its time.
"""

from __future__ import annotations

from typing import Any

import torch

from mfu_lab.analysis.layouts import terms as layout_terms
from mfu_lab.core.engine.layout import Layout, beyond_ddp
from mfu_lab.core.engine.meta_shape import job_shape
from mfu_lab.core.errors import JobError, JobProblem, StepError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import host

GIB = 2 ** 30


class FitError(StepError):
    """The job does not fit its layout; ``record`` is :func:`check_fit`'s record of the memory it needs."""

    def __init__(self, message: str, record: dict[str, Any]):
        super().__init__(message)
        self.record = record


def available_bytes(device_type: str, world: int) -> tuple[float, str]:
    """(bytes one rank may use, how it was read): a GPU's free memory, or the CPU's available memory / world, the
    CPU's being the machine's or its cgroup's when lower (a container, a Slurm job; :mod:`mfu_lab.core.measure.host`).
    """
    if device_type == "cuda":  # pragma: no cover - GPU only
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        return float(free), "the smallest free memory of this node's GPUs (torch.cuda.mem_get_info)"
    avail = host.available_memory()
    return avail.bytes / world, f"{avail.how}, shared by {world} rank(s)"


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
                                   job.ddp_grad_as_bucket_view, job.checkpoint_policy)
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
    raise FitError(
        f"the job does not fit its layout {layout.name}: {need / GIB:.1f} GiB per rank (analytic: parameters, "
        f"gradients, AdamW state and activations of {shape.params / 1e9:.2f}B parameters) against "
        f"{per_rank / GIB:.1f} GiB available per rank ({where}). "
        + (f"Layouts of {node_world or world} ranks that would fit: {names}. Set dp_mode, tp and pp in the job "
           "to one of them." if fit else
           f"No layout of {node_world or world} ranks fits: use more nodes (nnodes), a smaller micro_batch, "
           "activation_checkpointing: true (checkpoint_policy: selective keeps more for less recompute), or a smaller "
           "model."), record)


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


LONG_STEP1_S = 600.0  # step 1's training estimated longer than this on a CPU: said before the run


def device_type_of(job: Job) -> str:
    """'cuda' or 'cpu': where the job's ``device`` (auto | cpu | cuda) puts it on this machine."""
    return "cuda" if job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available()) else "cpu"


def step1_flops(job: Job) -> float:
    """The reference GPT's model FLOPs of step 1's training (warm-up and timed steps): 6N + 12*L*d*T per token
    (:func:`mfu_lab.core.measure.flops.transformer_flops_per_token`), N its matmul weights (12 d^2 a block and the
    tied head)."""
    from mfu_lab.core.measure.flops import transformer_flops_per_token

    n = job.n_layers * 12 * job.d_model ** 2 + job.vocab_size * job.d_model
    per_token = transformer_flops_per_token(n, job.n_layers, job.d_model, job.seq_len)
    return per_token * job.micro_batch * job.seq_len * (job.warmup_steps + job.steps)


def step1_time_note(job: Job, device_type: str) -> str:
    """A warning ('' when none): step 1's training of the reference GPT on a CPU is estimated above
    :data:`LONG_STEP1_S`. The estimate: its FLOPs (:func:`step1_flops`) at this CPU's cached peak (a lower bound: a
    training step reaches a share of the matmul peak), else at the rate of the default job's step on the reference
    CPU (:data:`mfu_lab.core.process.budget.REFERENCE_STEP_S`)."""
    if device_type != "cpu" or not job.uses_reference_model:
        return ""
    flops = step1_flops(job)
    from mfu_lab.core.measure import peak_cache
    from mfu_lab.core.measure.device import cpu_name

    peak = peak_cache.cached("cpu", cpu_name(), job.dtype)  # read only: nothing measured before the run
    if peak is not None:
        seconds, how = flops / peak, (f"at least: at this CPU's cached {job.dtype} peak of {peak / 1e9:,.0f} "
                                      "GFLOP/s, which a training step reaches only a share of")
    else:
        from mfu_lab.core.process.budget import REFERENCE_STEP_S

        default = Job()
        rate = step1_flops(default) / (default.warmup_steps + default.steps) / REFERENCE_STEP_S
        seconds, how = flops / rate, (f"about: at the default job's rate on the reference 2-core CPU "
                                      f"({rate / 1e9:,.0f} GFLOP/s; this CPU's peak is not measured yet)")
    if seconds <= LONG_STEP1_S:
        return ""
    took = f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.0f} min"
    return (f"warning: step 1's training alone is estimated at {took} on this CPU ({how}; "
            f"{job.warmup_steps + job.steps} steps of {flops / (job.warmup_steps + job.steps):.2g} model FLOPs, "
            f"6N + 12*L*d*T a token x micro_batch {job.micro_batch} x seq_len {job.seq_len}); the other steps "
            "train more. An estimate, not a limit: shrink seq_len, micro_batch or steps, or bound the run with "
            "--budget MINUTES")


def before_run(job: Job, device_type: str, world: int, source: str) -> str:
    """Before any step: refuse (JobError from ``source``, exit 2) the reference GPT's job that the memory available
    cannot hold in its layout over ``world`` ranks (:func:`check_fit`; a factory model is not imported here: step 1
    sizes it), naming ``seq_len`` when activations take most of it, ``d_model`` when the model's state does; return
    :func:`step1_time_note`."""
    if not job.uses_reference_model or (device_type == "cuda" and not torch.cuda.is_available()):
        return ""  # a GPU job checked on a machine without one: its memory is measured where it runs
    try:
        check_fit(job, device_type, world if beyond_ddp(job) else 1, node_world=world)
    except FitError as e:
        acts = e.record["by_kind"]["activations"] > e.record["bytes_per_rank"] / 2
        key = "seq_len" if acts else "d_model"
        raise JobError(source, [JobProblem(key, getattr(job, key), str(e))]) from None
    return step1_time_note(job, device_type)
