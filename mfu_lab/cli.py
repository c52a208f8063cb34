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
    mfu-lab trace FILE [--step-ms MS] [--json]   step 3's analysis of a torch.profiler trace you already have
    mfu-lab check-html [JOB_DIR]         open the job's reports in headless Chromium; screenshots; exit 1 on errors
    mfu-lab history [JOB_DIR]            list the job's runs (kept under JOB_DIR/runs/) with their MFU
    mfu-lab compare RUN_A RUN_B [--job-dir DIR] [--tolerance 0.03]
        what changed between two runs, metric by metric, beyond the noise
    mfu-lab monitor report DIR [--out FOLDER]
        read a production monitor's folder (mfu_lab.monitor.Monitor): report.html and summary.json
    mfu-lab lab [JOB] [-p key=value ...] [--out DIR] [--fresh] [--prepare-only]
        the job's own copy of the notebooks in outputs/<job>/lab, opened in JupyterLab

Exit codes: 0 all steps passed; 1 a step failed; 2 bad input (job file, arguments).

The commands' bodies are in :mod:`mfu_lab.commands`, one module per group; this module parses the arguments,
dispatches to them and turns their errors into messages and exit codes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mfu_lab.commands import jobfile, lab, production, results, run, trace
from mfu_lab.commands.common import EXIT_BAD_INPUT, EXIT_OK, EXIT_STEP_FAILED  # noqa: F401 - all three kept here
from mfu_lab.core.errors import JobError, MfuLabError
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store.runstate import JobBusy
from mfu_lab.core.thresholds import HOT_C
from mfu_lab.runner import filesystem_problem

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command whose reader closed the pipe


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
    r.set_defaults(func=run.cmd_run)

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
    s.set_defaults(func=run.cmd_step)

    v = sub.add_parser("validate", help="check a job file")
    v.add_argument("job")
    v.add_argument("-p", "--param", **param)
    v.set_defaults(func=jobfile.cmd_validate)

    k = sub.add_parser("keys", help="list the job keys")
    k.set_defaults(func=jobfile.cmd_keys)

    rep = sub.add_parser("report", help="re-export HTML and the index for a job's output folder")
    rep.add_argument("job_dir")
    rep.set_defaults(func=results.cmd_report)

    h = sub.add_parser("history", help="list a job's runs (kept under JOB_DIR/runs/) with their MFU")
    h.add_argument("job_dir", nargs="?", help="job output folder (default: the default job's)")
    h.set_defaults(func=results.cmd_history)

    c = sub.add_parser("compare", help="what changed between two runs of a job, metric by metric, beyond the noise")
    c.add_argument("run_a", help="run id (or a unique prefix), latest, previous, or a folder of step results")
    c.add_argument("run_b", help="the same forms as RUN_A")
    c.add_argument("--job-dir", help="job output folder holding runs/ (default: the default job's)")
    c.add_argument("--tolerance", type=float, default=0.03,
                   help="relative noise below which a measured figure counts as the same (0.03); widened to "
                        "half the step's p10-p90 spread when larger")
    c.add_argument("--all", action="store_true", help="list the metrics that stayed the same too")
    c.set_defaults(func=results.cmd_compare)

    ch = sub.add_parser("check-html", help="open a job's index and step reports in headless Chromium: console "
                        "errors, failed or off-machine requests, missing images, table words split over two lines, "
                        "pages wider than the window; full-page screenshots")
    ch.add_argument("job_dir", nargs="?", help="job output folder (default: the default job's)")
    ch.set_defaults(func=results.cmd_check_html)

    mon = sub.add_parser("monitor", help="the production monitor: read what mfu_lab.monitor.Monitor recorded")
    mon_sub = mon.add_subparsers(dest="monitor_command", required=True)
    mr = mon_sub.add_parser("report", help="summarise a monitor folder: report.html and summary.json")
    mr.add_argument("dir", help="the folder the Monitor wrote (<host>-rank<k>.jsonl files; any ranks, nodes, days)")
    mr.add_argument("--out", help="where to write report.html and summary.json (default: DIR)")
    mr.add_argument("-q", "--quiet", action="store_true", help="do not stream the notebook's output")
    mr.set_defaults(func=production.cmd_monitor_report)

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
    lb.set_defaults(func=lab.cmd_lab)

    t = sub.add_parser("trace", help="step 3's analysis of a torch.profiler trace you have: breakdown, top kernels, "
                       "fusion candidates")
    t.add_argument("file", help="the trace (.json or .json.gz, as torch.profiler exports it)")
    t.add_argument("--step-ms", type=float, help="the step's time without the profiler (ms): shares against it")
    t.add_argument("--top", type=int, default=20, help="rows of the top table (default 20)")
    t.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    t.set_defaults(func=trace.cmd_trace)

    g = sub.add_parser("gate", help="pre-launch health gate: every NVIDIA GPU on this node cool and unthrottled")
    g.add_argument("--max-temp-c", type=float, default=HOT_C, help=f"fail a GPU above this temperature ({HOT_C:g})")
    g.set_defaults(func=production.cmd_gate)
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
