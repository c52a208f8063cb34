import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Before torch is imported: the suite runs two xdist workers on CI's 2 cores, so each torch process it starts (the
# workers, the notebooks' kernels, the steps' trial processes; torchrun's ranks already get 1) computes on one
# thread instead of two threads per worker spinning against each other: 9% less CPU on test_verify + test_layouts
# (343 -> 312 user CPU-s, AMD EPYC 2 cores). A value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from mfu_lab.core.job.schema import Job, load_job

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.leftovers"]  # no process the suite started outlives it
TINY = ROOT / "tests" / "data" / "tiny.yaml"


def in_process(*args, cwd=ROOT):
    """``mfu-lab ARGS`` through ``cli.main`` in this process, given back as ``subprocess.run`` would (exit code,
    stdout, stderr), without starting an interpreter that imports torch again (3-5 s of CPU each): for commands
    that refuse, read or rewrite pages, plain-Python steps (the step tests run them in process too) and ``run``
    (its notebooks still run in kernels of their own). A test keeps a process of its own where that is what it
    tests: the new process's sys.path (a module in its folder), a lock this process holds, a kill, a timeout."""
    import contextlib
    import io

    from mfu_lab.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture
def tiny_job(tmp_path) -> Job:
    """The tiny test job, writing into a temporary folder."""
    return dataclasses.replace(load_job(TINY), out_dir=str(tmp_path / "out"))


SMALL_SWEEP = ["-p", "comm_hooks=[none, allreduce, bf16_compress]", "-p", "comm_bucket_mb=[0.05, 25]",
               "-p", "comm_grad_as_bucket_view=[false]", "-p", "comm_steps=2", "-p", "comm_timeout_s=60",
               "-p", "compile_modes=[default]"]


@pytest.fixture(scope="session")
def full_run(tmp_path_factory, two_ranks):
    """Every step's notebook through ``mfu-lab run`` (papermill) on the tiny CPU job, once per session, with the
    job naming a production monitor's folder (step 0 reads it first): (the finished process, the job's output
    folder)."""
    out = tmp_path_factory.mktemp("full")
    p = subprocess.run([sys.executable, "-m", "mfu_lab", "run", str(TINY), "--out", str(out), "-q", *SMALL_SWEEP,
                        "-p", f"monitor_dir={two_ranks}"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    return p, out / "tiny"


MONITOR_JOB = ROOT / "tests" / "fixtures" / "monitor_job.py"
# the slow rank's extra sleep far above a busy host's scheduling jitter (at 40 ms, rank 0 measured 18 ms of
# wait per step while the suite shared the 2 cores with another run), the loader's above it (the verdict: data)
MONITOR_LOADER_MS, MONITOR_SLOW_MS, MONITOR_STEPS = 150.0, 100.0, 31


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Path:
    """A monitor folder from a real two-rank gloo DDP loop under torchrun, once per session: every rank's loader
    sleeps MONITOR_LOADER_MS, rank 1 sleeps MONITOR_SLOW_MS more in each forward pass, a profiler window every
    half second."""
    out = tmp_path_factory.mktemp("mon2")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    f"--log-dir={out}.logs", str(MONITOR_JOB), str(out), "--steps", str(MONITOR_STEPS), "--every", "5",
                    "--loader-ms", str(MONITOR_LOADER_MS), "--slow-rank", "1", "--slow-ms", str(MONITOR_SLOW_MS),
                    "--profile-every-s", "0.5"],
                   check=True, cwd=ROOT, timeout=300, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    return out


@pytest.fixture(autouse=True, scope="session")
def _temp_peak_cache(tmp_path_factory):
    """The whole suite keeps measured peaks (core.measure.peak_cache) in a temporary folder, never the user's
    ~/.cache/mfu-lab: CI never reads a stale cache, and subprocesses inherit the variable."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``, pyproject's addopts): the tests that use the session's full
    run share one worker, so it runs once; every other test runs on the worker that holds its file, so a
    module-scoped fixture is built once."""
    for item in items:
        shared = {"full_run", "two_ranks"} & set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("full_run" if shared else item.path.name))


@pytest.fixture
def world_of_one(tmp_path):
    """An in-process gloo world of one rank: a layout's step (core.engine.parallelize) without a launch."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
