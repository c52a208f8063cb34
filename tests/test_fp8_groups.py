"""FP8 only where it is faster (issue 46): each group of the chosen policy probed on its own shapes, a group not
faster beyond the noise left out of the policy, and a policy with no faster group never adopted."""

from __future__ import annotations

import dataclasses

from mfu_lab.analysis import tuning
from mfu_lab.core.engine.workload import build_model
from mfu_lab.steps.fp8 import group_speed


def test_the_shapes_of_each_group_asked(tiny_job):
    j = dataclasses.replace(tiny_job, d_model=32, vocab_size=128)
    shapes = group_speed.group_shapes(build_model(j), ["attn_qkv", "mlp_up", "lm_head"])
    assert shapes == {"attn_qkv": [(32, 96)], "mlp_up": [(32, 128)], "lm_head": [(32, 128)]}


def row(group, bf16, fp8, i=768, o=768):
    return {"group": group, "in": i, "out": o, "bf16_s": bf16, "fp8_s": fp8}


def test_a_group_is_kept_only_when_every_shape_is_faster_beyond_the_noise():
    fast, slow = [1.0, 1.01, 0.99, 1.02, 1.0], [0.6, 0.61, 0.59, 0.6, 0.62]
    rows = [row("lm_head", fast, slow, 768, 50304),          # 1.67x, intervals apart: kept
            row("mlp_up", slow, fast),                       # 0.60x: slower
            row("attn_qkv", [1.0, 1.2, 0.8, 1.1, 0.9], [0.95, 1.15, 0.75, 1.05, 0.85]),  # 1.05x inside the noise
            row("attn_out", fast, slow), row("attn_out", slow, fast)]  # one shape faster, one slower: dropped
    kept, dropped = group_speed.gate(rows)
    assert kept == ["lm_head"]
    assert "slower" in dropped["mlp_up"] and "not beyond the noise" in dropped["attn_qkv"]
    assert "slower" in dropped["attn_out"] and rows[0]["speedup"] > 1.6


def _fp8_result(speed: dict) -> dict:
    return {"path": "torchao", "choice": {"groups": ["attn_qkv", "mlp_up", "lm_head"], "recipe": "tensorwise"},
            "speed": speed, "metrics": {}}


def test_the_tuned_job_takes_only_the_faster_groups(tiny_job):
    speed = {"status": "ok", "speedup": 1.08, "groups_kept": ["lm_head"],
             "groups_dropped": {"attn_qkv": "768x2304: 0.71x of bf16 (median), slower",
                                "mlp_up": "768x3072: 0.69x of bf16 (median), slower"}}
    chosen = tuning.changes(tiny_job, {"fp8": _fp8_result(speed)})
    fp8 = [c for c in chosen if c.key == "fp8_layers"]
    assert fp8 and fp8[0].adopted and fp8[0].new == ["lm_head"]
    assert "attn_qkv (768x2304: 0.71x" in fp8[0].evidence


def test_a_policy_with_no_faster_group_is_not_adopted(tiny_job):
    speed = {"status": "slower", "speedup": None, "groups_kept": [],
             "groups_dropped": {"lm_head": "768x50304: 0.93x of bf16 (median), slower"},
             "reason": "no group of the policy is faster in FP8 than in bf16 beyond the noise"}
    chosen = tuning.changes(tiny_job, {"fp8": _fp8_result(speed)})
    fp8 = [c for c in chosen if c.key == "fp8_layers"]
    assert fp8 and not fp8[0].adopted and "no group" in fp8[0].reason


def test_the_report_shows_each_groups_probe():
    import json

    from mfu_lab.report.tables.fp8 import fp8_section

    from .conftest import ROOT

    d = json.loads((ROOT / "tests" / "data" / "h200" / "small_job_05_fp8_result.json").read_text())
    rows = [row("lm_head", [1.0] * 5, [0.6] * 5, 768, 50304), row("mlp_up", [0.6] * 5, [1.0] * 5)]
    for r in rows:
        r["tokens"] = 16384
    d["speed"] |= {"group_probe": rows, "groups_kept": group_speed.gate(rows)[0]}
    html = str(fp8_section(d))
    assert "FP8 speed per group" in html and "16384 x 768 -> 50304" in html
    assert "1.67x" in html and "0.60x" in html


def test_fp8_units_without_a_timing_adopt_nothing(tiny_job):
    """torchao missing, the timing failed or the budget cut it: FP8's speed was not measured, so not adopted."""
    for speed in ({"status": "skipped", "reason": "torchao is not installed"}, {"status": "failed", "reason": "x"}):
        chosen = tuning.changes(tiny_job, {"fp8": _fp8_result(speed)})
        fp8 = [c for c in chosen if c.key == "fp8_layers"]
        assert fp8 and not fp8[0].adopted and fp8[0].reason.startswith("FP8's speed was not measured here")
