"""The ``mfu-lab`` command.

    mfu-lab run [JOB] [--steps baseline,...] [--out DIR] [-p key=value ...] [--resume] [--keep-going] [--thorough]
                  [--budget MIN] [--execution-timeout SECONDS]
        execute the step notebooks with papermill, export HTML, refresh the index
    mfu-lab step STEP --job JOB [-p key=value ...]
        run one step in plain Python (no Jupyter needed), write result.json and the index
    mfu-lab validate JOB     check a job file and print the job it describes
    mfu-lab keys             list every job key with its default and help
    mfu-lab report JOB_DIR   re-export HTML for executed notebooks in a job folder and refresh its index
    mfu-lab gate             pre-launch GPU health gate on this node (NVML); exit 1 names the failing GPU
    mfu-lab check-html [JOB_DIR]         open the job's reports in headless Chromium; screenshots; exit 1 on errors
    mfu-lab history [JOB_DIR]            list the job's runs (kept under JOB_DIR/runs/) with their MFU
    mfu-lab compare RUN_A RUN_B [--job-dir DIR] [--tolerance 0.03]
        what changed between two runs, metric by metric, beyond the noise
    mfu-lab monitor report DIR [--out FOLDER]
        read a production monitor's folder (mfu_lab.monitor.Monitor): report.html and summary.json
    mfu-lab lab [JOB] [-p key=value ...] [--out DIR] [--fresh] [--prepare-only]
        the job's own copy of the notebooks in outputs/<job>/lab, opened in JupyterLab

Exit codes: 0 all steps passed; 1 a step failed; 2 bad input (job file, arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.errors import JobError, JobProblem, MfuLabError, StepExecutionError
from mfu_lab.core.job import factories, yamlfile
from mfu_lab.core.job.schema import FIELDS, KEY_GROUPS, Job, load_job, validate
from mfu_lab.core.measure.health import gate
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store import files
from mfu_lab.core.store.files import JOB_MARKER, RESULT_FILE, is_job_root, read_json, write_json_atomic
from mfu_lab.core.store.history import compare, mfu_trend, resolve_run, runs
from mfu_lab.core.store.nodes import merge_into
from mfu_lab.core.store.runstate import JobBusy
from mfu_lab.core.thresholds import HOT_C
from mfu_lab.report import export_html, fmt, text_summary, write_index
from mfu_lab.report.browser import check_pages, ensure_chromium, job_pages
from mfu_lab.report.format import compare_text
from mfu_lab.runner import (
    check_cluster,
    check_output_folder,
    filesystem_problem,
    monitor_report,
    resolve_job,
    run_one_step,
    run_steps,
    select_steps,
    start_checks,
)

EXIT_OK, EXIT_STEP_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command whose reader closed the pipe


def parse_overrides(pairs: list[str]) -> dict:
    """``key=value`` pairs; values parsed as YAML scalars (``4`` -> int, ``true`` -> bool)."""
    out, problems = {}, []
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            problems.append(JobProblem(pair, pair, "expected key=value, e.g. -p micro_batch=4"))
            continue
        try:
            out[key.strip()] = yamlfile.loads(text) if text.strip() else ""
        except yamlfile.YamlProblem as e:
            problems.append(JobProblem(key, text, f"is not a valid value: {e}"))
    if problems:
        raise JobError("command line (-p)", problems)
    return out


def with_keep(job, keep: list[str] | None):
    """The job with ``--keep`` keys added to its ``keep:`` list (checked like any job key)."""
    keys = [k.strip() for arg in keep or [] for k in arg.split(",") if k.strip()]
    if not keys:
        return job
    return validate(job.to_dict() | {"keep": list(dict.fromkeys([*job.keep, *keys]))}, "command line (--keep)")


def cost_overrides(args, overrides: dict) -> dict:
    """``--budget MIN`` and ``--thorough`` as the job keys they set (budget_min, thorough)."""
    if getattr(args, "budget", None) is not None:
        if not args.budget >= 0:
            raise JobError("command line", [JobProblem("--budget", args.budget, "must be minutes >= 0 (0: no budget)")])
        overrides["budget_min"] = args.budget
    if getattr(args, "thorough", False):
        overrides["thorough"] = True
    return overrides


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
    start_checks(job, args.job or "", [s.key for s in steps])  # step 1's minimum; a busy machine said
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
    layout = layout_here(job, f"{args.job} and the command line (-p KEY=VALUE)" if args.param else str(args.job))
    print(f"{args.job}: valid (cluster file {job.cluster}: valid; output folder {job.output_root()}: writable{mon}"
          f"{layout})")
    for line in factories.code_notes(job, Path(args.job).resolve().parent):
        print(line)
    print(yaml.safe_dump(job.to_dict(), sort_keys=False), end="")
    return EXIT_OK


def layout_here(job: Job, source: str) -> str:
    """The job's layout against the world it gets on this machine (workers.launch.world_layout), as "; layout ..."
    for validate's line, or JobError naming ``source``; '' for plain DDP. The reference GPT's heads and blocks are
    checked too; a factory model is not imported (validate runs no code a job file names)."""
    if not beyond_ddp(job):
        return ""
    import torch

    from mfu_lab.core.engine.layout_check import check_layout, dp_degree
    from mfu_lab.workers.launch import world_layout

    device_type = "cuda" if job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available()) else "cpu"
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


def cmd_report(args) -> int:
    root = Path(args.job_dir)
    if not root.is_dir():
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "no such folder")])
    if not is_job_root(root):
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "holds no mfu-lab results (no "
                                                   f"{JOB_MARKER} marker, no run history, no step result): "
                                                   "mfu-lab report rewrites index.html only in a folder a run "
                                                   "made, e.g. outputs/<job_name>")])
    for info in STEPS:
        nb = root / info.folder / info.notebook
        merged = root / info.folder / RESULT_FILE
        if merged.is_file() and (data := merge_into(merged, 1)) is not None:  # nodes that finished after node 0
            write_json_atomic(merged, data)
            print(f"merged the nodes' results into {merged}: {data['nodes']['text']}")
        if nb.is_file():
            try:
                print(f"exported {export_html(nb, root / info.folder / 'report.html')}")
            except files.DamagedFile as e:  # the other steps' reports and the index are still rebuilt
                print(f"warning: {e}; its report.html is left as it was", file=sys.stderr)
    print(f"wrote {write_index(root)}")
    return EXIT_OK


def _job_dir(arg: str | None) -> Path:
    """The job output folder named on the command line, else the default job's."""
    if arg:
        return Path(arg)
    job, _ = resolve_job(None, {}, None, writable=False)
    return job.output_root()


def cmd_history(args) -> int:
    root = _job_dir(args.job_dir)
    if not root.is_dir():  # as `report` says: a typo is not an empty history
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "no such folder")])
    table = runs(root)
    if not table:
        print(f"{root}: no run recorded yet (history.jsonl is written when a step saves its result)")
        return EXIT_OK
    trend = dict(mfu_trend(root, table))
    for rid, steps in table.items():
        first = next(iter(steps.values()))
        mfus = ", ".join(f"{k} {fmt(v, 'fraction')}" for k, v in trend.get(rid, {}).items())
        given = {k: v for line in steps.values() for k, v in (line.get("overrides") or {}).items()}
        over = " ".join(f"-p {k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sorted(given.items()))
        print(f"{rid}  {len(steps)} step(s): {', '.join(steps)}; commit {str(first.get('git_commit'))[:12]}; "
              f"job {first.get('job_digest')}" + (f"; overrides {over}" if over else "; the job as in its file")
              + (f"; MFU {mfus}" if mfus else ""))
    return EXIT_OK


def cmd_compare(args) -> int:
    root = _job_dir(args.job_dir)
    a, b = resolve_run(args.run_a, root), resolve_run(args.run_b, root)
    for run in (a, b):  # a damaged result is left out of the comparison: say which
        damaged: dict = {}
        files.load_results(run.where, damaged)
        for e in damaged.values():
            print(f"warning: {e}; left out of the comparison", file=sys.stderr)
    changes, notes = compare(a, b, args.tolerance)
    print(compare_text(a, b, changes, notes, args.all))
    return EXIT_OK


def cmd_check_html(args) -> int:
    root = _job_dir(args.job_dir)
    pages = job_pages(root)
    if not pages:
        raise JobError("command line", [JobProblem("JOB_DIR", str(root), "holds no index.html or step report")])
    try:
        import playwright.sync_api  # noqa: F401 - the browser driver check_pages uses
    except ImportError:
        raise MfuLabError("check-html drives Chromium through Playwright, which is not installed: "
                          "pip install -e '.[test]' (or pip install playwright)") from None
    chromium, why = ensure_chromium(install=False)
    if not chromium:
        raise MfuLabError(f"{why}: install Debian's chromium package (apt-get install chromium)")
    bad = 0
    for c in check_pages(pages, root / "screenshots", chromium):
        bad += not c.ok
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.page}: {c.images} images, {c.height_px} px tall -> {c.screenshot}")
        for p in c.problems():
            print(f"     {p}")
    return EXIT_OK if not bad else EXIT_STEP_FAILED


def cmd_monitor_report(args) -> int:
    report, summary_file = monitor_report(args.dir, args.out, quiet=args.quiet)
    s = read_json(summary_file)
    print(f"mfu-lab: {s['read']['ranks']} rank(s) on {s['read']['nodes']} node(s), {s['read']['steps']:,} timed "
          f"steps, {s['span']['launches']} launch(es)" + (f"; {s['read']['skipped_lines']} unreadable line(s) "
                                                          "skipped" if s["read"]["skipped_lines"] else ""))
    for note in s.get("notes") or []:  # what was skipped or left out, and the clocks: never silent
        print(f"note: {note}")
    print(f"verdict: {s['verdict']}")
    print(f"wrote {summary_file}" + (f" and {report}" if report else " (papermill is not installed here: no "
                                     "report.html; run mfu-lab monitor report on a machine with the workbook)"))
    return EXIT_OK


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


def cmd_gate(args) -> int:
    ok, lines = gate(args.max_temp_c)
    for line in lines:
        print(line)
    print("health gate: " + ("passed" if ok else "FAILED"))
    return EXIT_OK if ok else EXIT_STEP_FAILED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mfu-lab", description="Measure and raise the MFU of a PyTorch training job.")
    sub = p.add_subparsers(dest="command", required=True)
    param = {"action": "append", "default": [], "metavar": "KEY=VALUE", "help": "override one job key"}

    r = sub.add_parser("run", help="execute the step notebooks (papermill) and build the reports")
    r.add_argument("job", nargs="?", help="job file (default: parameters/default.yaml)")
    r.add_argument("--steps", help=f"comma-separated subset of: {', '.join(BY_KEY)}")
    r.add_argument("--out", help="results folder (overrides out_dir)")
    r.add_argument("-p", "--param", **param)
    keep = {"action": "append", "metavar": "KEY", "help": "job key the tuned job (tuned.yaml) keeps at its "
            "original value, whatever the steps recommend; repeatable or comma-separated"}
    r.add_argument("--keep", **keep)
    cost = [(("--budget",), {"type": float, "metavar": "MIN", "help": "minutes the steps may take in all, spread by "
                             "the README's rule ('Cost'); each step shortens to fit and says what it left out"}),
            (("--thorough",), {"action": "store_true", "help": "exhaustive sweeps: every candidate of steps 2, 4 "
                               "and 5 measured in full (the default races them)"})]
    for names, kw in cost:
        r.add_argument(*names, **kw)
    r.add_argument("-q", "--quiet", action="store_true", help="do not stream the notebooks' progress lines")
    r.add_argument("--resume", action="store_true", help="keep the steps whose results exist for the same job "
                   "parameters and workbook version; run the rest")
    r.add_argument("--keep-going", action="store_true", help="after a step fails, run the remaining steps anyway "
                   "(the exit code is still 1)")
    r.add_argument("--execution-timeout", type=float, metavar="SECONDS",
                   help="end a notebook cell that runs longer than this; the step is recorded as a timeout")
    r.add_argument("--wait", action="store_true", help="when another run holds the job's output folder, wait for "
                   "it to end instead of refusing")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("step", help="run one step in plain Python, without Jupyter")
    s.add_argument("step", choices=list(BY_KEY))
    s.add_argument("--job", help="job file (default: parameters/default.yaml)")
    s.add_argument("--out", help="results folder (overrides out_dir)")
    s.add_argument("-p", "--param", **param)
    s.add_argument("--keep", **keep)
    for names, kw in cost:
        s.add_argument(*names, **kw)
    s.add_argument("--wait", action="store_true", help="when another run holds the job's output folder, wait for "
                   "it to end instead of refusing")
    s.set_defaults(func=cmd_step)

    v = sub.add_parser("validate", help="check a job file")
    v.add_argument("job")
    v.add_argument("-p", "--param", **param)
    v.set_defaults(func=cmd_validate)

    k = sub.add_parser("keys", help="list the job keys")
    k.set_defaults(func=cmd_keys)

    rep = sub.add_parser("report", help="re-export HTML and the index for a job's output folder")
    rep.add_argument("job_dir")
    rep.set_defaults(func=cmd_report)

    h = sub.add_parser("history", help="list a job's runs (kept under JOB_DIR/runs/) with their MFU")
    h.add_argument("job_dir", nargs="?", help="job output folder (default: the default job's)")
    h.set_defaults(func=cmd_history)

    c = sub.add_parser("compare", help="what changed between two runs of a job, metric by metric, beyond the noise")
    c.add_argument("run_a", help="run id (or a unique prefix), latest, previous, or a folder of step results")
    c.add_argument("run_b", help="the same forms as RUN_A")
    c.add_argument("--job-dir", help="job output folder holding runs/ (default: the default job's)")
    c.add_argument("--tolerance", type=float, default=0.03,
                   help="relative noise below which a measured figure counts as the same (0.03); widened to "
                        "half the step's p10-p90 spread when larger")
    c.add_argument("--all", action="store_true", help="list the metrics that stayed the same too")
    c.set_defaults(func=cmd_compare)

    ch = sub.add_parser("check-html", help="open a job's index and step reports in headless Chromium: console "
                        "errors, failed or off-machine requests, missing images; full-page screenshots")
    ch.add_argument("job_dir", nargs="?", help="job output folder (default: the default job's)")
    ch.set_defaults(func=cmd_check_html)

    mon = sub.add_parser("monitor", help="the production monitor: read what mfu_lab.monitor.Monitor recorded")
    mon_sub = mon.add_subparsers(dest="monitor_command", required=True)
    mr = mon_sub.add_parser("report", help="summarise a monitor folder: report.html and summary.json")
    mr.add_argument("dir", help="the folder the Monitor wrote (<host>-rank<k>.jsonl files; any ranks, nodes, days)")
    mr.add_argument("--out", help="where to write report.html and summary.json (default: DIR)")
    mr.add_argument("-q", "--quiet", action="store_true", help="do not stream the notebook's output")
    mr.set_defaults(func=cmd_monitor_report)

    lb = sub.add_parser("lab", help="the job's own copy of the step notebooks (parameters injected, not run) in "
                        "outputs/<job>/lab/, opened in JupyterLab")
    lb.add_argument("job", nargs="?", help="job file (default: parameters/default.yaml)")
    lb.add_argument("-p", "--param", **param)
    lb.add_argument("--out", help="results folder (overrides out_dir); the lab is <out>/<job_name>/lab")
    lb.add_argument("--fresh", action="store_true", help="replace the lab's notebooks with new copies (the default "
                    "keeps each one that exists: your edits and outputs)")
    lb.add_argument("--no-browser", action="store_true", help="start JupyterLab without opening a browser")
    lb.add_argument("--port", type=int, help="JupyterLab's port (default: its own, 8888 or the next free one)")
    lb.add_argument("--prepare-only", action="store_true", help="prepare the lab and print the command that "
                    "starts JupyterLab on it, without starting it")
    lb.set_defaults(func=cmd_lab)

    g = sub.add_parser("gate", help="pre-launch health gate: every NVIDIA GPU on this node cool and unthrottled")
    g.add_argument("--max-temp-c", type=float, default=HOT_C, help=f"fail a GPU above this temperature ({HOT_C:g})")
    g.set_defaults(func=cmd_gate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a short output meets a closed pipe here, not at exit (where nothing could catch it)
        return code
    except JobError as e:
        print(f"mfu-lab: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobBusy as e:
        print(f"mfu-lab: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MfuLabError as e:
        print(f"mfu-lab: error: {e}", file=sys.stderr)
        return EXIT_STEP_FAILED
    except BrokenPipeError:  # the reader went away (`mfu-lab keys | head`): nothing went wrong here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a folder or file the command needed could not be read or written
        print(f"mfu-lab: {filesystem_problem(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        # the notebook's kernel died with the interrupt (core.process.procs ends it): nbclient's orphaned cell task
        # would log "Task exception was never retrieved ... DeadKernelError" when it is collected; that is this stop
        logging.getLogger("asyncio").disabled = True
        print("mfu-lab: interrupted; finished steps are kept, the interrupted one is marked interrupted "
              "(mfu-lab run --resume goes on from there)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
