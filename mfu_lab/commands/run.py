"""Running steps: ``mfu-lab run`` (the step notebooks under papermill) and ``mfu-lab step`` (one step in plain
Python)."""

from __future__ import annotations

import sys

from mfu_lab.commands.common import EXIT_OK, EXIT_STEP_FAILED, cost_overrides, parse_overrides, with_keep
from mfu_lab.core.errors import JobError, JobProblem, StepExecutionError
from mfu_lab.report import text_summary
from mfu_lab.runner import check_cluster, resolve_job, run_one_step, run_steps, select_steps, start_checks


def cmd_run(args) -> int:
    overrides = cost_overrides(args, parse_overrides(args.param))
    job, source = resolve_job(args.job, overrides, args.out)
    job = with_keep(job, args.keep)
    steps = select_steps(args.steps)
    t = args.execution_timeout  # the notebook runner (nbclient) takes whole seconds: inf or 600.5 fail every step
    if t is not None and not (t > 0 and float(t).is_integer()):  # nan, inf and fractions are not whole numbers
        raise JobError("command line", [JobProblem("--execution-timeout", t, "must be a whole number of seconds > 0, "
                                                   "e.g. 3600 (the notebook runner takes whole seconds)")])
    args.execution_timeout = None if t is None else int(t)
    if any(s.key == "placement" for s in steps):
        check_cluster(job)  # a bad cluster file fails now, not after hours of earlier steps
    start_checks(job, args.job or "", [s.key for s in steps], minimum=False)  # step 1's minimum; a busy machine
    failed = run_steps(job, source, steps, quiet=args.quiet, resume=args.resume, keep_going=args.keep_going,
                       execution_timeout=args.execution_timeout, wait=args.wait, overrides=overrides)
    return EXIT_STEP_FAILED if failed else EXIT_OK


def cmd_step(args) -> int:
    job, source = resolve_job(args.job, overrides := cost_overrides(args, parse_overrides(args.param)), args.out)
    job = with_keep(job, args.keep)
    info = select_steps(args.step)[0]
    if info.key == "placement":
        check_cluster(job)
    start_checks(job, args.job or "", [info.key])
    print(f"mfu-lab: {info.folder} for job '{job.job_name}' from {source} (plain Python, no notebook)")
    try:
        result = run_one_step(info, job, source, wait=args.wait, overrides=overrides)
    except StepExecutionError as e:
        print(f"mfu-lab: {info.folder} FAILED: {e.ename}: {e.evalue}", file=sys.stderr)
        print(f"    earlier results kept; index: {job.output_root() / 'index.html'}", file=sys.stderr)
        return EXIT_STEP_FAILED
    print(text_summary(result))
    print(f"mfu-lab: wrote {job.step_dir(info.folder) / 'result.json'} and {job.output_root() / 'index.html'}")
    return EXIT_OK
