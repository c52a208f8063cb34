"""``mfu-lab lab``: the job's own copy of the step notebooks (:mod:`mfu_lab.lab`), opened in JupyterLab."""

from __future__ import annotations

from mfu_lab.commands.common import EXIT_OK, parse_overrides
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.runner import resolve_job


def cmd_lab(args) -> int:
    from mfu_lab import lab

    if args.port is not None and not 0 < args.port < 65536:
        raise JobError("command line", [JobProblem("--port", args.port, "must be a port number, 1 to 65535")])
    given = parse_overrides(args.param)
    job, source = resolve_job(args.job, given, args.out)
    prepared = lab.prepare_lab(job, fresh=args.fresh)
    port = args.port if args.prepare_only else lab.pick_port(args.port)  # started now: on a port free now, only
    cmd, env = lab.lab_command(prepared.folder, port, not args.no_browser), lab.kernel_env(job, prepared.folder, given)
    print("\n".join(lab.describe(job, source, prepared, cmd, env, port, not args.prepare_only, args.port)), flush=True)
    return EXIT_OK if args.prepare_only else lab.start(cmd, env)
