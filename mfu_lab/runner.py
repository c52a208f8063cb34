"""Running steps: which job and steps, papermill execution, the run loop.

Every step, whether its notebook runs under papermill (``mfu-lab run``) or its code runs in plain Python
(``mfu-lab step``), goes through :func:`mfu_lab.publish.step_bracket`: the step folder says ``running`` while it
runs, then either its new files are published as one set (result, report, history line, index), or
``failure.json`` (failed / interrupted / timeout) says why, with the previous set kept whole.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mfu_lab.analysis.placement.cluster_files import load_cluster
from mfu_lab.core.errors import JobError, JobProblem, MfuLabError, StepExecutionError
from mfu_lab.core.job.overrides import OVERRIDES_ENV
from mfu_lab.core.job.paths import workbook_file
from mfu_lab.core.job.schema import Job, find_workbook_root, load_job, validate
from mfu_lab.core.measure import contention
from mfu_lab.core.process import budget, floors, procs
from mfu_lab.core.process.budget import LEFT_ENV, left_env, plan_text
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store import fixed_costs
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import JOB_MARKER, is_job_root, load_results, refuse_links_below
from mfu_lab.core.store.history import RUN_ENV, RUNS_DIR, current_run_id, new_run_id, resumed_run_id
from mfu_lab.core.store.results import source_digest
from mfu_lab.core.store.runstate import job_lock, resumable
from mfu_lab.kernels import KERNEL_FILES, execute_notebook, kernel_files_in
from mfu_lab.publish import NotPublished, filesystem_problem, fresh_step_folder, settle_publications, step_bracket
from mfu_lab.report import export_html


@contextmanager
def run_id_set(run_id: str) -> Iterator[str]:
    """``MFU_LAB_RUN_ID`` set for the length of a run (saves and the notebooks' kernels read it), then restored,
    so that a later run in the same process (a notebook, a test) draws an id of its own."""
    with procs.env_set(RUN_ENV, run_id):
        yield run_id


@contextmanager
def overrides_set(overrides: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """``MFU_LAB_OVERRIDES`` set to ``overrides`` (``out_dir`` left out) for the length of a run, then restored."""
    kept = {k: v for k, v in (overrides or {}).items() if k != "out_dir"}
    with procs.env_set(OVERRIDES_ENV, json.dumps(kept, default=str)):
        yield kept


def start_checks(job, job_arg: str, keys: list[str], say=print, minimum: bool = True) -> None:
    """What ``mfu-lab run`` (and ``mfu-lab step``) checks before its first step: a budget too small for step 1 is
    refused (:class:`JobError`, exit 2) with the estimate; a busy machine is said, with the command that bounds the
    run. The step-1 estimate comes from the job's own last step-1 result when it has one. ``minimum``: say here a
    share under its step's floor (:func:`minimum_line`); ``mfu-lab run`` says it after its plan line instead."""
    earlier = store.earlier(job, "baseline").data if "baseline" in keys else None
    why = floors.step1_refusal(job, keys, earlier)
    if why:
        raise JobError("command line", [JobProblem("--budget", job.budget_min, why)])
    line = floors.busy_text(contention.busy_now(), job_arg, keys, job, earlier)
    if line:
        say("mfu-lab: " + line)
    if minimum and (line := minimum_line(job, keys)):
        say("mfu-lab: " + line)
    from mfu_lab.steps.fit import device_type_of, step1_time_note  # torch: only once a run starts

    line = step1_time_note(job, device_type_of(job))  # a long run on a CPU is said, with its estimate
    if line:
        say("mfu-lab: " + line)


def minimum_line(job, keys: list[str]) -> str:
    """:func:`floors.minimum_text` for ``keys``, from the job's last steps 1 and 4 ('' without a budget)."""
    if not job.budget_min:
        return ""
    before = {k: store.earlier(job, k).data for k in ("baseline", "compile")}
    return floors.minimum_text(job, keys, before, budget.overhead(job.device)[0])


def minimum_recheck(job, keys: list[str], before: str) -> str:
    """After step 1 of a job that had no step-1 result when the run began: the floors of the steps after it again,
    at the step time step 1 has just measured (the run's first line took the reference CPU's). '' when step 1 left
    no result or nothing changed; else what the measured step changes, said beside the earlier line."""
    result = store.earlier(job, "baseline").data
    step_s = (((result or {}).get("metrics") or {}).get("step_time_median_s") or {}).get("value")
    if not step_s:
        return ""
    now = minimum_line(job, keys)
    if now == before:
        return ""
    measured = (f"step 1 measured the job's step at {step_s * 1e3:.3g} ms (the floors above took the reference "
                f"CPU's {budget.REFERENCE_STEP_S:g} s)")
    if not now:
        return f"{measured}: every step's share now holds its minimum"
    return f"{measured}: {now}"


def check_output_folder(job: Job, source: str) -> None:
    """Refuse, before any work, an output folder that cannot be made or written: a file where a folder of the
    path should be, or a folder where no file can be created (a read-only disk). Nothing is left behind."""
    target = job.output_root()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = ""
    if not probe.is_dir():
        why = f"{probe} is a file, not a folder, so {target} cannot be made"
    else:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".mfu-lab-probe-", dir=probe)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            why = f"nothing can be written in {probe} ({e.strerror})"
    if why:
        raise JobError(source, [JobProblem("out_dir", job.out_dir, f"{why}; choose another out_dir (--out DIR)")])
    if why := not_the_workbooks(target):
        raise JobError(source, [JobProblem("out_dir", job.out_dir, why)])


def not_the_workbooks(target: Path) -> str:
    """Why the workbook may not write its results in ``target`` (a job's output folder), '' when it may: inside
    the installed mfu_lab package (its own files, and its source digest, which ``--resume`` compares), or a folder
    that holds files the workbook did not make (no marker, history nor step result), which a run would overwrite
    or delete. A link planted there (where a step folder or runs/ would be) is refused as one, named."""
    real, package = Path(os.path.realpath(target)), Path(os.path.realpath(Path(__file__).parent))
    if real == package or package in real.parents:
        return (f"{target} is inside the installed mfu_lab package ({package}): results there would change the "
                "package's source digest (every --resume would then run every step again) and could overwrite its "
                "files; choose an out_dir outside it (--out DIR)")
    if not real.is_dir() or is_job_root(real):
        return ""
    found = sorted(p.name for p in real.iterdir())
    if not found:
        return ""
    refuse_links_below(target, depth=1)
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    return (f"{target} already holds files mfu-lab did not make ({shown}) and no {JOB_MARKER} marker: a run "
            "would overwrite or delete them, so nothing was written; choose a new or empty folder (--out DIR, or "
            "another job_name), or the folder of an earlier run of this job")


def resolve_job(path: str | None, overrides: dict, out: str | None, writable: bool = True) -> tuple[Job, str]:
    """The job to run and where it came from: a file, or the embedded default job. ``writable``: refuse an
    output folder that cannot be written (commands that only read results pass False)."""
    if out:
        overrides = {**overrides, "out_dir": str(Path(out).resolve())}
    if path:
        job, source = load_job(path, overrides), path
    elif (default := find_workbook_root() / "parameters" / "default.yaml").is_file():
        job, source = load_job(default, overrides), str(default)
    elif (default := workbook_file("parameters/default.yaml")).is_file():  # the package's own, as the embedded job
        job, source = load_job(default, overrides, anchor=False), str(default)
    else:
        job, source = validate(overrides, "embedded default job"), "embedded default job"
    if writable:
        check_output_folder(job, source)
    return job, source


def select_steps(spec: str | None) -> list:
    if not spec:
        return list(STEPS)
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in keys if k not in BY_KEY]
    if bad:
        def hint(k: str) -> str:
            close = difflib.get_close_matches(k, list(BY_KEY), n=1)
            return f"did you mean '{close[0]}'? " if close else ""

        raise JobError("command line (--steps)", [JobProblem("--steps", k, f"unknown step; {hint(k)}choose from "
                                                             f"{', '.join(BY_KEY)}") for k in bad])
    return [s for s in STEPS if s.key in keys]


def check_cluster(job: Job) -> None:
    """Raise JobError when the job's cluster file is missing or invalid."""
    load_cluster(job.cluster_path())


def execute_step(info, job: Job, source: str, root: Path, quiet: bool = False,
                 execution_timeout: float | None = None) -> Path:
    """Run one step's notebook with papermill into the job's output folder; export its HTML.

    The step folder says what state the step is in while and after it runs (``runstate``): running,
    then either a new result, or failed / interrupted / timeout with the error, the previous result kept.
    """
    folder = fresh_step_folder(job, info)
    # the package's own notebook: its checkout's, else the copy installed with it (mfu_lab.core.job.paths)
    src, out_nb = workbook_file(Path("notebooks") / info.notebook), folder / info.notebook
    if not src.is_file():
        raise MfuLabError(f"notebook {src} not found: this mfu_lab was installed without its notebooks; reinstall "
                          "it from the workbook's source (pip install <checkout>), or run it from the checkout")
    params = job.to_dict() | {"out_dir": str(job.output_root().parent)}
    with step_bracket(job, info, source, current_run_id(), notebook=out_nb, limit=execution_timeout), \
            kernel_files_in(job.output_root() / KERNEL_FILES):
        # The kernel's printed lines (the steps' own progress, with time left) are streamed as they come. The
        # kernel inherits MFU_LAB_INDEX_BY_RUNNER: the bracket rewrites the index after the step, not the kernel.
        os.environ["MFU_LAB_INDEX_BY_RUNNER"] = "1"
        try:
            execute_notebook(src, out_nb, params, root, quiet, execution_timeout)
        finally:
            os.environ.pop("MFU_LAB_INDEX_BY_RUNNER", None)
    return folder / "report.html"


def warn_damaged(job: Job) -> list[str]:
    """Name every damaged result of the job before work starts (the run goes on: a later step treats a damaged
    result as one that has not run); the warnings, as printed."""
    damaged: dict = {}
    load_results(job.output_root(), damaged)
    lines = [f"mfu-lab: warning: {e}; going on without it" for e in damaged.values()]
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return lines


def run_one_step(info, job: Job, source: str, wait: bool = False, overrides: dict | None = None):
    """One step in plain Python (no notebook) inside the bracket, holding the job's folder; its result. A failure
    raises :class:`StepExecutionError` (recorded in the step folder, the index refreshed). ``overrides``: the
    command line's (``-p``), recorded in the result (:mod:`mfu_lab.core.job.overrides`)."""
    with procs.interrupt_on_sigterm(), job_lock(job.output_root(), "(starting)", wait) as holder:
        # one reserved id for the lock, the running marker and the history line (record reads it from RUN_ENV)
        settle_publications(job.output_root())  # a publication a killed run left half done, completed or taken back
        run_id = current_run_id(job.output_root())  # MFU_LAB_RUN_ID of an earlier run is not joined (history)
        holder(run_id)
        with run_id_set(run_id), overrides_set(overrides), step_bracket(job, info, source, run_id):
            warn_damaged(job)
            return info.load().run(job)


def run_steps(job: Job, source: str, steps: list, *, quiet: bool = False, resume: bool = False,
              keep_going: bool = False, execution_timeout: float | None = None, wait: bool = False,
              overrides: dict | None = None) -> list[str]:
    """Execute the steps' notebooks in order as one run, holding the job's output folder, printing progress;
    the folders of the steps that failed (after the first failure the rest are skipped unless ``keep_going``).
    A resumed run keeps the id of the run it goes on with. ``overrides``: the command line's (``-p``), handed to
    the kernels and recorded in every result and in tuned.yaml (:mod:`mfu_lab.core.job.overrides`)."""
    job_root = job.output_root()
    with procs.interrupt_on_sigterm(), job_lock(job_root, "(starting)", wait) as holder:
        settle_publications(job_root)  # a publication a killed run left half done: completed or taken back, said
        same_code = {"source_digest": source_digest()}
        run_id = (resumed_run_id(job_root, job.to_dict(), same_code) if resume else None) \
            or new_run_id(job_root=job_root)
        holder(run_id)
        warn_damaged(job)
        with run_id_set(run_id), overrides_set(overrides):  # the notebooks' kernels inherit both: one run, one id
            try:
                return _run_steps(job, source, steps, run_id, quiet, resume, keep_going, execution_timeout)
            finally:
                os.environ.pop(LEFT_ENV, None)  # the budget left is this run's: no later run in this process reads it


def _run_steps(job: Job, source: str, steps: list, run_id: str, quiet: bool, resume: bool, keep_going: bool,
               execution_timeout: float | None) -> list[str]:
    root = find_workbook_root()
    print(f"mfu-lab: job '{job.job_name}' from {source}; steps: {', '.join(s.key for s in steps)}"
          + ("; thorough (exhaustive sweeps)" if job.thorough else ""))
    overhead = budget.overhead(job.device)
    short = ""  # the line on the shares under their floors, said after the plan (it speaks of the plan's shares)
    guessed = bool(job.budget_min) and store.earlier(job, "baseline").data is None  # a step time not yet measured
    if job.budget_min:
        print("mfu-lab: " + plan_text(job.budget_min, [s.key for s in steps], {s.key: s.number for s in STEPS},
                                      overhead))
        if short := minimum_line(job, [s.key for s in steps]):
            print("mfu-lab: " + short)
    print(f"mfu-lab: results in {job.output_root()} (this run is also kept in {RUNS_DIR}/{run_id}/)")
    _monitor_step(job, quiet)
    failed: list[str] = []
    keys, t_run = [s.key for s in steps], time.perf_counter()
    for n, info in enumerate(steps, 1):
        if resume:
            keep, why = resumable(job.step_dir(info.folder), job.to_dict())
            print(f"[{n}/{len(steps)}] {info.folder}: " + (why if keep else f"runs again ({why})"), flush=True)
            if keep:
                continue
        t0 = time.perf_counter()
        print(f"[{n}/{len(steps)}] {info.folder}: {info.title}", flush=True)
        if job.budget_min:  # the step's kernel inherits it: its share of what the run has left (core.process.budget)
            os.environ[LEFT_ENV] = left_env(job.budget_min, keys, time.perf_counter() - t_run, info.key, overhead[0])
        try:
            html = execute_step(info, job, source, root, quiet, execution_timeout)
        except (StepExecutionError, OSError) as e:
            if isinstance(e, StepExecutionError):
                print(f"[{n}/{len(steps)}] {info.folder} FAILED: {e.ename}: {e.evalue}", file=sys.stderr)
                how = "it ran to its end" if isinstance(e, NotPublished) else "with the error"
                print(f"    executed notebook ({how}): {e.notebook}", file=sys.stderr)
            else:  # the step's folder or files could not be written: nothing of the step ran
                print(f"[{n}/{len(steps)}] {info.folder} FAILED: {filesystem_problem(e)}", file=sys.stderr)
            index = job.output_root() / "index.html"
            print(f"    earlier results kept; index: {index if index.is_file() else 'not written (mfu-lab report)'}",
                  file=sys.stderr)
            failed.append(info.folder)
            if not keep_going:
                left = [s.folder for s in steps[n:]]
                if left:
                    print(f"mfu-lab: stopped; not run: {', '.join(left)} (--keep-going runs them anyway; "
                          "--resume later keeps what finished)", file=sys.stderr)
                return failed
            continue
        wall = time.perf_counter() - t0
        print(f"[{n}/{len(steps)}] {info.folder} done in {wall:.0f} s -> {html}")
        record_fixed_costs(job, info, wall)
        if guessed and info.key == "baseline" and (line := minimum_recheck(job, keys, short)):
            print("mfu-lab: " + line)
    print(f"mfu-lab: summary page: {job.output_root() / 'index.html'}")
    _tuned(job, source, run_id)
    if failed:
        print(f"mfu-lab: {len(failed)} step(s) failed: {', '.join(failed)}", file=sys.stderr)
    return failed


def record_fixed_costs(job: Job, info, wall_s: float) -> None:
    """Keep what this machine's step cost beside the step's own work (:mod:`mfu_lab.core.store.fixed_costs`): its
    notebook, the step's wall time less the ``elapsed_s`` its result records; after step 4, its longest measured
    cold compile, under its backend's kind, and its eager trial's start. A result that cannot be read keeps nothing."""
    try:
        data = json.loads((job.step_dir(info.folder) / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    key = fixed_costs.machine_key(job.device)
    elapsed = data.get("elapsed_s")
    if isinstance(elapsed, (int, float)) and 0 <= elapsed <= wall_s:
        fixed_costs.record(key, "notebook_s", wall_s - elapsed)
    if info.key != "compile":
        return
    colds = [t.get("compile_cold_s") for t in data.get("trials") or [] if isinstance(t, dict)]
    colds = [c for c in colds if isinstance(c, (int, float)) and c > 0]
    if colds:
        backend = (data.get("job") if isinstance(data.get("job"), dict) else {}).get("compile_backend")
        fixed_costs.record(key, fixed_costs.cold_compile_kind(backend or job.compile_backend), max(colds))
    eager = data.get("eager")
    if isinstance(eager, dict) and isinstance(eager.get("start_s"), (int, float)):
        fixed_costs.record(key, "trial_start_s", eager["start_s"])


def _monitor_step(job: Job, quiet: bool) -> None:
    """Step 0 when the job names its production monitor's folder: its report into ``<job>/00_monitor/``. A
    missing or empty folder is said and the run goes on (the monitor is read, never required)."""
    folder = job.monitor_path()
    if folder is None:
        return
    t0 = time.perf_counter()
    print(f"[0] 00_monitor: the job in production, from {folder}", flush=True)
    try:
        report, _ = monitor_report(folder, job.output_root() / "00_monitor", quiet=quiet)
    except (MfuLabError, OSError, RuntimeError) as e:  # papermill's execution error is a RuntimeError
        print(f"[0] 00_monitor: not read ({str(e).strip().splitlines()[-1][:300]}); the steps go on", file=sys.stderr)
        return
    print(f"[0] 00_monitor done in {time.perf_counter() - t0:.0f} s -> {report}", flush=True)


def _tuned(job: Job, source: str, run_id: str) -> None:
    """Write ``tuned.yaml`` from the results as they now stand, and say how many changes it adopts."""
    from mfu_lab.steps.verify.tuned import withdrawn_keys, write_tuned

    try:
        path, chosen = write_tuned(job, (), source, run_id)
    except OSError as e:
        print(f"mfu-lab: tuned job not written: {filesystem_problem(e)}", file=sys.stderr)
        return
    adopted, gone = sum(c.adopted for c in chosen), withdrawn_keys(job)
    back = [k for k in gone if k not in {str(c.key) for c in chosen}]  # taken back: no longer a change in the file
    took = f"; step 7 took back {', '.join(gone)} (its changes say why)" if gone else ""
    print(f"mfu-lab: tuned job: {path} ({adopted} change(s) adopted of {len(chosen) + len(back)} recommended{took}; "
          f"mfu-lab run {path} runs it)")



def monitor_report(folder: str | Path, out: str | Path | None = None, quiet: bool = False) -> tuple[Path | None, Path]:
    """Run the ``00_monitor`` notebook over a monitor folder with papermill; export ``report.html`` beside its
    ``summary.json`` in ``out`` (default: the monitor folder). Without papermill (a GPU node without Jupyter)
    only ``summary.json`` is written. Returns (report.html or None, summary.json)."""
    from mfu_lab.steps import monitor

    folder = monitor.check_folder(folder, "DIR").resolve()
    out = Path(out).expanduser().resolve() if out else folder
    out.mkdir(parents=True, exist_ok=True)
    try:
        import papermill  # noqa: F401 - only whether it is there
    except ImportError:
        monitor.run(folder, out)
        return None, out / monitor.SUMMARY_FILE
    root = find_workbook_root()
    src, nb = workbook_file(Path("notebooks") / "00_monitor.ipynb"), out / "00_monitor.ipynb"  # checkout's, or shipped
    if not src.is_file():
        raise MfuLabError(f"notebook {src} not found: this mfu_lab was installed without its notebooks; reinstall "
                          "it from the workbook's source (pip install <checkout>), or run it from the checkout")
    try:
        execute_notebook(src, nb, {"monitor_dir": str(folder), "out": str(out)}, root, quiet)
    finally:
        if nb.is_file():  # a failed cell still leaves a report of what ran, with the error in it
            export_html(nb, out / "report.html")
    return out / "report.html", out / monitor.SUMMARY_FILE
