import dataclasses
from pathlib import Path

import pytest

from mfu_lab.job import Job, load_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


@pytest.fixture
def tiny_job(tmp_path) -> Job:
    """The tiny test job, writing into a temporary folder."""
    return dataclasses.replace(load_job(TINY), out_dir=str(tmp_path / "out"))
