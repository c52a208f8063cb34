"""The vision example through the whole workbook, as the README runs it (``mfu-lab run parameters/vision.yaml
--budget ...``): one papermill run of every step on a job of images and labels with its own loss (issue 47). Its
MFU is the hand formula's FLOPs per step over the measured steps' wall time and the peak; nothing calls an image
a token."""

from __future__ import annotations

import html
import json
import re

import pytest

from examples.vision import vit as vis

from .conftest import ROOT, in_process

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vision_e2e")]

MICRO_BATCH = 8
STEPS = ["01_baseline", "02_attention_and_comm", "03_kernels", "04_compile", "05_fp8", "06_placement", "07_verify"]


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    small = [f"micro_batch={MICRO_BATCH}", "steps=6", "warmup_steps=1", "compile_modes=[default]",
             "compile_backend=eager",
             "verify_rounds=2", "verify_steps=2", "verify_warmup_steps=1", "profile_steps=2", "profile_warmup_steps=1",
             "fp8_steps=4", "coloc_steps=2", "placement_layouts=false"]  # step 6's layouts: test_any_job_steps.py
    p = in_process("run", ROOT / "parameters" / "vision.yaml", "--budget", "2", "--out", out, "-q",
                   *[a for kv in small for a in ("-p", kv)])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return out / "vision"


def result(root, step: str) -> dict:
    return json.loads((root / step / "result.json").read_text())


SAID = "(tokens/s, or samples/s where the batches are not token ids)"  # step 7's narrative names both units


def text_of(path) -> str:
    s = re.sub(r"<style.*?</style>|<script.*?</script>", "", path.read_text(), flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", s))).replace(SAID, "")


def test_every_step_runs_on_the_vision_job(vision_run):
    for step in STEPS:
        assert result(vision_run, step)["status"] == "ok", step
        assert "did not finish" not in text_of(vision_run / step / "report.html"), step


def test_its_mfu_is_the_hand_formula_over_the_measured_steps(vision_run):
    r = result(vision_run, "01_baseline")
    m, t = r["metrics"], r["timings"]
    per_step = MICRO_BATCH * vis.flops_per_sample()  # 738,480,384 FLOPs per sample, by hand
    assert m["model_flops_per_step"]["value"] == per_step and m["model_flops_per_step"]["source"] == "counted"
    wall = t["wall_s"][t["warmup_steps"]:]
    expected = per_step * len(wall) / (sum(wall) * m["peak_flops_per_s"]["value"])
    assert m["mfu"]["value"] == pytest.approx(expected, rel=0.05)
    assert m["tokens_per_s"]["value"] is None and "not token ids" in m["tokens_per_s"]["note"]
    assert m["samples_per_s"]["value"] == pytest.approx(MICRO_BATCH * len(wall) / sum(wall), rel=1e-9)
    assert m["padding_share"]["value"] is None


def test_no_figure_calls_an_image_a_token(vision_run):
    page = text_of(vision_run / "index.html")
    assert "tokens/s" not in page
    assert "samples/s" in page
    for step in STEPS:
        text = text_of(vision_run / step / "report.html")
        assert "tokens/s" not in text, step


def test_steps_2_4_and_6_say_what_does_not_apply(vision_run):
    skipped = {s["what"]: s["reason"] for s in result(vision_run, "02_attention_and_comm")["skipped"]}
    assert "attention comparison" in skipped
    skipped = {s["what"]: s["reason"] for s in result(vision_run, "04_compile")["skipped"]}
    assert "not token ids" in skipped["the length-variation demo"]
    r6 = result(vision_run, "06_placement")
    assert r6["unit"] == "samples" and r6["per_unit"] == 256  # the model's tokens are samples x seq_len
    assert r6["metrics"]["predicted_tokens_per_s"]["value"] is None
