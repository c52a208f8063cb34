"""The job file and its keys: ``mfu-lab validate`` (check a job file, its cluster file, output folder, layout and
FP8 layer groups; print the job) and ``mfu-lab keys`` (every key with its default and help). Runs no code a job
file names."""

from __future__ import annotations

from pathlib import Path

import yaml

from mfu_lab.commands.common import EXIT_OK, parse_overrides
from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.job import factories
from mfu_lab.core.job.compile_options import options_text
from mfu_lab.core.job.schema import FIELDS, KEY_GROUPS, Job, load_job
from mfu_lab.runner import check_cluster, check_output_folder


def cmd_validate(args) -> int:
    job = load_job(args.job, parse_overrides(args.param))
    check_cluster(job)
    check_output_folder(job, args.job)
    mon = ""
    if job.monitor_path() is not None:
        from mfu_lab.core.store.monitor_files import rank_files
        from mfu_lab.steps.monitor import check_folder

        check_folder(job.monitor_path())
        mon = f"; monitor folder {job.monitor_path()}: {len(rank_files(job.monitor_path()))} rank file(s)"
    source = f"{args.job} and the command line (-p KEY=VALUE)" if args.param else str(args.job)
    check_ranks(job, source)
    fp8_note = fp8_groups_here(job, source)
    layout = layout_here(job, source)
    notes = fit_here(job, source)
    print(f"{args.job}: valid (cluster file {job.cluster}: valid; output folder {job.output_root()}: writable{mon}"
          f"{layout})")
    for line in factories.code_notes(job, Path(args.job).resolve().parent):
        print(line)
    if job.compile_mode == "options" or job.compile_options:
        used = "the job trains with them" if job.compile_mode == "options" else "step 4's options trial"
        print(f"compile options in force ({used}; inductor options from the allowed list): "
              f"{options_text(job.compile_options)}")
    for line in notes + ([fp8_note] if fp8_note else []):
        print(line)
    print(yaml.safe_dump(job.to_dict(), sort_keys=False), end="")
    return EXIT_OK


def check_ranks(job: Job, source: str) -> None:
    """``nproc_per_node`` against this machine (workers.launch.check_nproc, as every launch checks it): its GPUs,
    or its cores and memory for CPU ranks; JobError naming ``source``."""
    from mfu_lab.steps.fit import device_type_of
    from mfu_lab.workers.launch import check_nproc

    check_nproc(job, device_type_of(job), source)


def fp8_groups_here(job: Job, source: str) -> str:
    """The job's ``fp8_layers`` and ``fp8_policies`` against the reference GPT's layer groups, counted on a model
    built on the meta device (step 5's check, before any step runs; a misspelt group would train without FP8): a
    JobError naming ``source``. Under tensor parallel, the Linears whose shard torch._scaled_mm would refuse, which
    train in high precision (core.engine.tp_plan.unaligned_shards): the line that says so. A factory model's groups
    are checked when step 1 or 5 builds it, as validate imports no code a job file names: the line that says so, or
    ''."""
    if not (job.fp8_layers or job.fp8_policies):
        return ""
    if not job.uses_reference_model:
        return (f"fp8_layers / fp8_policies: the layer groups of model {job.model} are checked when step 1 or 5 "
                "builds it (validate imports no code a job file names)")
    import torch

    from mfu_lab.analysis.fp8_numerics import linear_groups
    from mfu_lab.core.engine.workload import build_model
    from mfu_lab.steps.fp8.policies import check_groups

    with torch.device("meta"):
        model = build_model(job)
    check_groups(job, list(linear_groups(model)), source)
    if job.tp > 1 and job.fp8_layers:
        from mfu_lab.core.engine.fp8 import is_candidate
        from mfu_lab.core.engine.layout import Layout
        from mfu_lab.core.engine.tp_plan import plan_of, unaligned_shards

        plan = plan_of(model, "gpt", job, Layout.from_job(job, job.tp * job.pp))  # tp and sp are what it reads
        kept = [f"{n} ({why})" for n, why in unaligned_shards(model, plan, job.tp).items()
                if is_candidate(n, model.get_submodule(n), job.fp8_layers)]  # as fp8.apply leaves them out
        if kept:
            return (f"fp8_layers at tp {job.tp}: {len(kept)} Linear(s) stay in high precision, their shard not "
                    f"divisible by 16 (torch._scaled_mm's alignment on a GPU): {', '.join(kept)}")
    return ""


def fit_here(job: Job, source: str) -> list[str]:
    """The reference model's memory in its layout on this machine, and step 1's estimated time on a CPU
    (steps.fit.before_run): a JobError naming ``source``, or the warnings to print."""
    from mfu_lab.steps.fit import before_run, device_type_of
    from mfu_lab.workers.launch import world_layout

    device_type = device_type_of(job)
    nnodes, nproc = world_layout(job, device_type)
    note = before_run(job, device_type, nnodes * nproc, source)
    return [note] if note else []


def layout_here(job: Job, source: str) -> str:
    """The job's layout against the world it gets on this machine (workers.launch.world_layout), as "; layout ..."
    for validate's line, or JobError naming ``source``; '' for plain DDP. The reference GPT's heads and blocks are
    checked too; a factory model is not imported (validate runs no code a job file names)."""
    if not beyond_ddp(job):
        return ""
    from mfu_lab.core.engine.layout_check import check_layout, dp_degree
    from mfu_lab.steps.fit import device_type_of
    from mfu_lab.workers.launch import world_layout

    device_type = device_type_of(job)
    nnodes, nproc = world_layout(job, device_type)
    if job.uses_reference_model:
        check_layout(job, nnodes * nproc, device_type, source)
    dp = dp_degree(job, nnodes * nproc, device_type, source)
    return (f"; layout over {nnodes * nproc} {device_type.upper()} ranks: {job.dp_mode} {dp} x tp {job.tp}"
            f"{' + sp' if job.sp else ''} x pp {job.pp}")


def cmd_keys(args) -> int:
    """Every key, its default and what it does, in columns, under its group's title (KEY_GROUPS); a default too
    long for its column gets a line of its own and the text goes on under the column, so the columns never drift."""
    job, width = Job(), 16
    for name, f in FIELDS.items():
        if name in KEY_GROUPS:
            print(f"{'' if name == next(iter(FIELDS)) else chr(10)}--- {KEY_GROUPS[name]} ---")
        default = repr(getattr(job, name))
        if len(default) > width:
            print(f"{name:<26} default {default}\n{'':<{26 + 9 + width}} {f.metadata['help']}")
        else:
            print(f"{name:<26} default {default:<{width}} {f.metadata['help']}")
    return EXIT_OK
