import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mfu_lab.core.job import Job, load_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


@pytest.fixture
def tiny_job(tmp_path) -> Job:
    """The tiny test job, writing into a temporary folder."""
    return dataclasses.replace(load_job(TINY), out_dir=str(tmp_path / "out"))


SMALL_SWEEP = ["-p", "comm_hooks=[none, allreduce, bf16_compress]", "-p", "comm_bucket_mb=[0.05, 25]",
               "-p", "comm_grad_as_bucket_view=[false]", "-p", "comm_steps=2", "-p", "comm_timeout_s=60",
               "-p", "compile_modes=[default]"]


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """Every step's notebook through ``mfu-lab run`` (papermill) on the tiny CPU job, once per session:
    (the finished process, the job's output folder)."""
    out = tmp_path_factory.mktemp("full")
    p = subprocess.run([sys.executable, "-m", "mfu_lab", "run", str(TINY), "--out", str(out), "-q", *SMALL_SWEEP],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    return p, out / "tiny"
