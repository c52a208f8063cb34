"""The README's own-data job files run end to end through the CLI (issue 30's "done when"): a nanoGPT-style token
file (step 1) and Hugging Face style dict batches (steps 1, 3 and 7, their labels and mask passed on), each trained
by a transformers Llama."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, in_process

SMALL = ["steps=3", "warmup_steps=1", "micro_batch=2", "seq_len=64", "profile_steps=1", "profile_warmup_steps=1",
         "verify_rounds=2", "verify_steps=2", "verify_warmup_steps=1"]

pytestmark = pytest.mark.e2e


def run(job: str, out: Path, steps: str, *extra: str) -> subprocess.CompletedProcess:
    params = [a for kv in SMALL + list(extra) for a in ("-p", kv)]
    return in_process("run", str(ROOT / "parameters" / job), "--steps", steps, "--out", str(out), "-q", *params)


def result(out: Path, job: str, step: str) -> dict:
    return json.loads((out / job / step / "result.json").read_text())


def test_a_token_file_runs_step_1(tmp_path):
    """Steps 3 and 7 train on its batches as on synthetic ones (plain pairs); the dict batches below take them."""
    pytest.importorskip("transformers")
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "make_train_bin.py"), str(tmp_path / "train.bin")],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    p = run("own_data.yaml", tmp_path / "out", "baseline", f"data=tokens:{tmp_path / 'train.bin'}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r1 = result(tmp_path / "out", "own-data", "01_baseline")
    assert r1["job"]["data"] == f"tokens:{tmp_path / 'train.bin'}" and r1["job"]["vocab_size"] == 0
    assert r1["metrics"]["padding_share"]["value"] == 0.0  # windows of the file: every position has a target
    assert sum(r1["timings"]["tokens"]) == (1 + 3) * 2 * 64  # counted over warm-up and measured steps


def test_dict_batches_run_steps_1_3_4_and_7_and_count_the_labels(tmp_path):
    """Step 4 too (issue 47): own_data_dicts.yaml has vocab_size 0, which its length demo resolves through the
    model's embedding (256 rows) instead of drawing randint(0, ...); dynamo alone (compile_backend eager) keeps the
    trials short, the recompile audit is the same."""
    pytest.importorskip("transformers")
    p = run("own_data_dicts.yaml", tmp_path / "out", "baseline,kernels,compile,verify", "compile_backend=eager",
            "compile_modes=[default]", "compile_warmup_steps=1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r1 = result(tmp_path / "out", "own-data-dicts", "01_baseline")
    sys.path.insert(0, str(ROOT / "examples"))
    from hf_batches import documents

    rows = documents()  # the same rows, counted here: targets after the model's shift, labels[:, 1:] != -100
    useful = [int((rows[i]["labels"][1:] != -100).sum()) for i in range((1 + 3) * 2)]
    assert r1["timings"]["tokens"] == [sum(useful[k:k + 2]) for k in range(0, 8, 2)]
    assert r1["metrics"]["padding_share"]["value"] > 0
    for step in ("03_kernels", "04_compile", "07_verify"):
        assert result(tmp_path / "out", "own-data-dicts", step)["status"] == "ok"
    demo = [x for x in result(tmp_path / "out", "own-data-dicts", "04_compile")["recompiles"]
            if "lengths varied" in x["label"]]
    assert len(demo) == 2 and all(len(x["shapes"]) == 3 for x in demo)
