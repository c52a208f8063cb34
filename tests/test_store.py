"""The result store: one save (result.json + history line + after-save hooks), one reader of earlier steps."""

import json

import pytest

from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import RESULT_FILE
from mfu_lab.steps.baseline import step as baseline


def test_an_earlier_step_that_has_not_run_says_so(tiny_job):
    e = store.earlier(tiny_job, "kernels")
    assert not e and e.data is None
    assert e.reason == "step 3 (kernels) has not run for this job"
    with pytest.raises(LookupError, match="step 3"):
        e.typed()


def test_save_writes_the_result_the_history_line_and_calls_the_hooks(tiny_job, monkeypatch):
    seen = []
    monkeypatch.setattr(store, "AFTER_SAVE", [seen.append])
    r = baseline.run(tiny_job, progress=lambda msg: None, write=False)
    path = baseline.save(tiny_job, r)
    assert path == tiny_job.output_root() / BY_KEY["baseline"].folder / RESULT_FILE
    assert seen == [tiny_job.output_root()]
    lines = (tiny_job.output_root() / "history.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == ["baseline"]
    e = store.earlier(tiny_job, "baseline")
    assert e and e.path == path
    typed = e.typed()
    assert isinstance(typed, baseline.Result) and typed.metric("mfu") == r.metric("mfu")
