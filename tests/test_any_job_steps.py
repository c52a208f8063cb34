"""Every step on a job that is not a token-id language model (issue 47), in process where a kernel is not what is
tested: step 2's FSDP2 candidates and step 6's layouts train with the job's own ``loss:``. (Step 4 on a factory
language model whose vocab_size is 0: tests/test_data_e2e.py's dict batches; the whole workbook on images:
tests/test_vision_e2e.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from mfu_lab.core.job.schema import load_job
from mfu_lab.workers.comm_configs import is_fsdp

from .conftest import ROOT

pytestmark = pytest.mark.e2e

SMALL_VIT = {"image_size": 64, "patch": 16, "dim": 32, "depth": 1, "heads": 2, "classes": 10}  # the data: 64x64


def small_vision(tmp_path, **kw):
    job = load_job(ROOT / "parameters" / "vision.yaml")
    return dataclasses.replace(job, out_dir=str(tmp_path), model_kwargs=SMALL_VIT, micro_batch=4, **kw)


def test_step_2s_fsdp2_candidates_train_with_the_jobs_loss(tmp_path):
    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.attention_comm import comm_race
    from mfu_lab.steps.attention_comm.comm_rows import comm_rows_of

    job = small_vision(tmp_path, comm_hooks=["none"], comm_bucket_mb=[25], comm_grad_as_bucket_view=[False],
                       comm_steps=2, comm_warmup_steps=1, comm_fsdp_reshard=[True], comm_fsdp_prefetch=[0],
                       comm_fsdp_reduce_dtype=["float32"], comm_screen="product")
    sweep, _, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 16,
                                           reference=("none", 25.0, False), clock=Clock(None))
    assert sum(is_fsdp(c) for c in configs) == 1
    rows = comm_rows_of(configs, sweep, 1.0, 1.0, 2)
    fsdp = [r for r in rows if r.kind == "fsdp"]
    assert fsdp and all(r.status == "ok" and r.loss is not None for r in fsdp), [vars(r) for r in rows]
    ddp = next(r for r in rows if r.kind != "fsdp")
    # the same loss function, the same batches and seed: the first losses agree (cross-entropy of 10 classes)
    assert ddp.loss == pytest.approx(fsdp[0].loss, rel=0.05)


def test_step_6s_ddp_and_fsdp2_layouts_train_with_the_jobs_loss_and_pp_says_why_not(tmp_path):
    from mfu_lab.core.measure import device as dev
    from mfu_lab.core.process.progress import as_progress
    from mfu_lab.steps.placement.layouts import measure_layouts
    from mfu_lab.steps.placement.step import job_shape

    job = small_vision(tmp_path, comm_steps=2, comm_warmup_steps=1)
    shape, _ = job_shape(job, dev.resolve_device("cpu"))
    layouts, run = measure_layouts(job, "cpu", tmp_path / "layouts", shape, None, as_progress(None), 300.0,
                                   (0.01, "a test's step"))
    ok = [x for x in layouts if x.get("status") == "ok"]
    assert len(ok) >= 2, json.dumps(layouts, default=str)[:2000]
    refused = [x for x in layouts if x.get("status") == "refused"]
    assert any("key 'loss'" in str(x.get("reason", "")) for x in refused), [x.get("reason") for x in refused]
