import json
import os
import stat

import pytest

from mfu_lab.core.measure.environment import environment
from mfu_lab.core.store import files, results
from mfu_lab.core.store.files import write_json_atomic
from mfu_lab.core.store.results import Metric


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    p = tmp_path / "r" / "result.json"
    write_json_atomic(p, {"a": 1})
    write_json_atomic(p, {"a": 2, "m": Metric(0.5, "fraction", "measured")})
    assert json.loads(p.read_text()) == {"a": 2, "m": {"value": 0.5, "unit": "fraction", "source": "measured",
                                                       "note": ""}}
    assert [f.name for f in p.parent.iterdir()] == ["result.json"]
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o644


def test_a_crash_during_the_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "result.json"
    write_json_atomic(p, {"old": True})

    def crash(*a):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(p, {"new": True})
    assert json.loads(p.read_text()) == {"old": True}
    assert [f.name for f in tmp_path.iterdir()] == ["result.json"]


def test_unserialisable_data_never_touches_the_file(tmp_path):
    p = tmp_path / "result.json"
    write_json_atomic(p, {"old": True})
    with pytest.raises(TypeError):
        write_json_atomic(p, {"bad": object()})
    assert json.loads(p.read_text()) == {"old": True}


def test_non_finite_numbers_become_null():
    assert json.loads(json.dumps(results.jsonable({"x": float("nan"), "y": [float("inf")]}))) == {"x": None,
                                                                                                  "y": [None]}


def test_metric_labels_are_checked():
    with pytest.raises(ValueError, match="source"):
        Metric(1.0, "s", "guessed")
    with pytest.raises(ValueError, match="finite"):
        Metric(float("nan"), "s", "measured")


def test_environment_names_versions_and_commit():
    env = environment("cpu name", "cpu")
    assert env["device_name"] == "cpu name" and env["torch"] and env["python"]
    assert env["git_commit"] == "unknown" or len(env["git_commit"].split("+")[0]) == 40


def test_results_are_rebuilt_by_field_name_and_a_foreign_format_is_named(tmp_path):
    from dataclasses import dataclass

    from mfu_lab.core.store.results import ResultFormatError, StepResult, rebuild

    @dataclass
    class Inner:
        a: int
        b: str = "x"

    @dataclass
    class R(StepResult):
        step: str
        metrics: dict[str, Metric]
        inner: list[Inner]
        maybe: Inner | None = None

    r = R("s", {"mfu": Metric(0.5, "fraction", "measured")}, [Inner(1), Inner(2, "y")], Inner(3))
    p = write_json_atomic(tmp_path / "result.json", r)
    d = json.loads(p.read_text())
    assert d["result_format"] == 1
    shuffled = dict(reversed(list(d.items())))  # field order in the file does not matter, only names
    again = R.from_dict(shuffled)
    assert again == r and isinstance(again.inner[1], Inner) and isinstance(again.metrics["mfu"], Metric)
    assert R.from_dict({k: v for k, v in d.items() if k != "result_format"}) == r  # written before the field: 1
    with pytest.raises(ResultFormatError, match="result format 2, this version of mfu-lab reads format 1"):
        R.from_dict(d | {"result_format": 2})
    with pytest.raises(ResultFormatError, match="field 'inner' is missing"):
        rebuild(R, {k: v for k, v in d.items() if k != "inner"})
