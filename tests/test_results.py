import json
import os
import stat

import pytest

from mfu_lab.core import files, results
from mfu_lab.core.files import write_json_atomic
from mfu_lab.core.results import Metric


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
    env = results.environment("cpu name", "cpu")
    assert env["device_name"] == "cpu name" and env["torch"] and env["python"]
    assert env["git_commit"] == "unknown" or len(env["git_commit"].split("+")[0]) == 40
