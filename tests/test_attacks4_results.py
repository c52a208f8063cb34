"""Issue 48, the fourth round of attacks: results on disk are data, never configuration.

- A planted result (step 2's recommendation, step 7's ``changes[]``, step 1's ``loader_race`` pick) names code
  (``model``, ``factory_paths``...) or a key its step does not own: the tuned job never takes it, says why in its
  "not adopted" list, and nothing is imported.
- A ``job_name`` of 64 characters: the tuned job's name still differs from the original's.
- ``MFU_LAB_RUN_ID`` naming an earlier run: that run's ``runs/`` copy and history stay as they were.
"""

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest

from mfu_lab.analysis import result_keys, tuning
from mfu_lab.core.job.schema import FIELDS, load_job
from mfu_lab.core.store import history as hi
from mfu_lab.steps.verify.tuned import TUNED_FILE, write_tuned

EARLIER = "20260101-000000"


def plant(job, folder: str, data: dict) -> None:
    """A result.json written by hand into the job's folder, as an attacker (or a stray edit) would."""
    path = job.output_root() / folder / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def evil(tmp_path):
    """A folder holding ``evilmod.py``, which leaves a marker file behind the moment it is imported: (folder,
    marker)."""
    folder, marker = tmp_path / "x", tmp_path / "imported"
    folder.mkdir()
    (folder / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n"
                                       "def make(**kw):\n    import torch\n    return torch.nn.Linear(2, 2)\n")
    yield folder, marker
    sys.modules.pop("evilmod", None)


def tuned_of(job):
    """Write tuned.yaml from the planted results as ``mfu-lab run`` does; (its text, the tuned job, changes)."""
    path, chosen = write_tuned(job)
    assert path == job.output_root() / TUNED_FILE
    return path.read_text(), load_job(path), chosen


def nothing_imported(job, tuned, marker) -> None:
    """The tuned job and every rung of its staircase build the reference model: the planted module never runs."""
    from mfu_lab.core.engine.workload import build_model

    for _, rung, _ in tuning.staircase(job, []) + [("tuned", tuned, [])]:
        build_model(rung)
    assert not marker.exists() and "evilmod" not in sys.modules


def assert_refused_code(text: str, tuned, keys=("model", "factory_paths")) -> None:
    assert "evilmod" not in text
    assert tuned.model == "gpt" and tuned.factory_paths == [] and tuned.trust == []
    for key in keys:
        line = next(x for x in text.splitlines() if x.startswith(f"# not adopted: {key}:"))
        assert "names code" in line and "never comes from a result" in line, line


def test_step2_recommendation_cannot_name_code(tiny_job, evil):
    folder, marker = evil
    plant(tiny_job, "02_attention_and_comm", {"recommendation": {"comm": {
        "kind": "fsdp", "hook": "fsdp2", "job_keys": {"factory_paths": [str(folder)], "model": "evilmod:make",
                                                      "dp_mode": "fsdp", "cluster": "/etc/evil.yaml"}}},
        "comm": []})
    text, tuned, _ = tuned_of(tiny_job)
    assert_refused_code(text, tuned)
    assert tuned.dp_mode == "fsdp"  # the key step 2's FSDP2 pick owns is still adopted
    line = next(x for x in text.splitlines() if x.startswith("# not adopted: cluster:"))
    assert "refused from step 2's DDP and FSDP2 race: not a key it may set (it sets only: ddp_hook" in line
    assert tuned.cluster == tiny_job.cluster
    nothing_imported(tiny_job, tuned, marker)


def test_step7_changes_cannot_name_code_nor_set_any_key(tiny_job, evil):
    folder, marker = evil
    row = {"rung": "attention", "step": "verify", "old": None, "evidence": "step 7", "label": "measured",
           "adopted": True}
    plant(tiny_job, "07_verify", {"changes": [
        row | {"key": "model", "new": "evilmod:make"}, row | {"key": "factory_paths", "new": [str(folder)]},
        row | {"key": "trust", "new": ["evilmod"]}, row | {"key": "steps", "new": 1000},
        row | {"key": "micro_batch", "new": "8", "reason": "withdrawn: planted"},  # a withdrawal may set it: typed
        row | {"key": ["attention"], "new": "unfused"},
        row | {"key": "attention", "new": "unfused"}]})
    text, tuned, chosen = tuned_of(tiny_job)
    assert_refused_code(text, tuned, ("model", "factory_paths", "trust"))
    assert tuned.attention == "unfused" and tuned.steps == tiny_job.steps and tuned.micro_batch == tiny_job.micro_batch
    steps = next(x for x in text.splitlines() if x.startswith("# not adopted: steps:"))
    assert "refused from step 7's own re-checks: not a key it may set" in steps
    wrong = next(x for x in text.splitlines() if x.startswith("# not adopted: micro_batch:"))
    assert "must be a whole number" in wrong
    assert any("not a job key" in c.reason for c in chosen if not c.adopted)
    nothing_imported(tiny_job, tuned, marker)


def test_step1_loader_race_pick_cannot_name_code(tiny_job, evil):
    folder, marker = evil
    plant(tiny_job, "01_baseline", {"metrics": {"data_wait_fraction": {"value": 0.5}}, "loader_race": {
        "adopted": True, "pick": "workers2", "speedup": {"value": 2.0, "low": 1.5, "high": 2.5},
        "pick_knobs": {"num_workers": 2, "model": "evilmod:make", "factory_paths": [str(folder)],
                       "loss": "evilmod:make", "no_such_key": 1}}})
    text, tuned, _ = tuned_of(tiny_job)
    assert_refused_code(text, tuned, ("model", "factory_paths", "loss"))
    assert tuned.num_workers == 2 and tuned.loss == ""
    nothing_imported(tiny_job, tuned, marker)


def test_a_wrong_type_or_value_is_dropped_not_a_crash(tiny_job):
    plant(tiny_job, "02_attention_and_comm", {"recommendation": {
        "attention": "x", "job_fragment": {"attention": "flash-evil"},
        "comm": {"kind": "fsdp", "hook": "fsdp2", "job_keys": {"dp_mode": "fsdp", "fsdp_prefetch": True}}},
        "comm": []})
    text, tuned, _ = tuned_of(tiny_job)
    assert tuned.attention == tiny_job.attention and tuned.fsdp_prefetch == tiny_job.fsdp_prefetch
    assert ("# not adopted: attention: sdpa -> flash-evil (attention): refused from step 2's attention race: must "
            "be one of sdpa, unfused") in text
    assert "# not adopted: fsdp_prefetch: 0 -> true (layout)" in text and "must be a whole number" in text


def test_text_from_a_result_stays_on_its_comment_line(tiny_job, tmp_path):
    """A line break in a result's text (step 2's attention name) would otherwise start a key line of its own."""
    plant(tiny_job, "02_attention_and_comm", {"recommendation": {
        "attention": "unfused\nmodel: evilmod:make", "job_fragment": {"attention": "unfused"}}, "attention": []})
    text, tuned, _ = tuned_of(tiny_job)
    assert tuned.attention == "unfused" and tuned.model == "gpt"
    assert not any(x.startswith("model: evilmod") for x in text.splitlines())


def test_the_table_of_what_each_reader_may_set_names_no_code_and_only_job_keys():
    assert set(result_keys.MAY_SET) == {name for _, name, _ in tuning.READERS}
    for name, owns in result_keys.MAY_SET.items():
        assert set(owns.keys) <= set(FIELDS), name
        assert not set(owns.keys) & set(result_keys.CODE_KEYS), name
        for key, t in owns.keys.items():
            assert FIELDS[key].type == t.__name__, (name, key)
    code = {"model", "data", "loss", "tokenizer", "factory_paths", "trust", "compile_options"}
    assert code <= set(result_keys.CODE_KEYS)


# ------------------------------------------------------------------ Low 12: a job_name of 64 characters
@pytest.mark.parametrize("name", ["a" * 64, "b" * 59, "c" * 58, "x" * 58 + "-tuned", "tiny-tuned"])
def test_the_tuned_name_always_differs_from_the_original(tiny_job, name):
    job = dataclasses.replace(tiny_job, job_name=name)
    tuned = tuning.tuned_job(job, [])
    assert tuned.job_name != name and len(tuned.job_name) <= 64 and tuned.job_name.endswith("-tuned")
    assert tuned.output_root() != job.output_root()


def test_a_64_character_job_name_gets_a_tuned_file_that_runs_beside_it(tiny_job):
    job = dataclasses.replace(tiny_job, job_name="n" * 64)
    path, _ = write_tuned(job)
    tuned = load_job(path)
    assert tuned.job_name == "n" * 58 + "-tuned"
    assert tuned.output_root() != job.output_root()


# ------------------------------------------------------------------ Low 13: MFU_LAB_RUN_ID of an earlier run
def earlier_run(root):
    """One run kept in ``runs/EARLIER/`` with its history line."""
    (root / "01_baseline").mkdir(parents=True)
    (root / "01_baseline" / "result.json").write_text(json.dumps({"metrics": {"mfu": {"value": 0.4, "unit": ""}}}))
    hi.record(root, "01_baseline", "baseline", {"metrics": {"mfu": {"value": 0.4, "unit": ""}}}, EARLIER)
    return (root / "runs" / EARLIER / "01_baseline" / "result.json").read_bytes()


def test_a_save_with_an_earlier_runs_id_takes_a_new_one(tmp_path, monkeypatch, capsys):
    """A step saved outside ``mfu-lab run`` (a notebook of ``mfu-lab lab``, a script) with the variable set."""
    kept = earlier_run(tmp_path)
    monkeypatch.setenv(hi.RUN_ENV, EARLIER)
    (tmp_path / "01_baseline" / "result.json").write_text(json.dumps({"metrics": {"mfu": {"value": 0.9}}}))
    rid = hi.record(tmp_path, "01_baseline", "baseline", {"metrics": {"mfu": {"value": 0.9}}})
    assert rid != EARLIER and hi._RUN_ID.fullmatch(rid)
    assert (tmp_path / "runs" / EARLIER / "01_baseline" / "result.json").read_bytes() == kept
    assert [x["run"] for x in hi.load_history(tmp_path)] == [EARLIER, rid]
    err = capsys.readouterr().err
    assert f"MFU_LAB_RUN_ID={EARLIER} is not a run of" in err and f"new run {rid}" in err


def test_mfu_lab_step_with_an_earlier_runs_id_takes_a_new_one(tiny_job, monkeypatch):
    """``MFU_LAB_RUN_ID=<earlier> mfu-lab step``: the runner's one-step path, its step faked (it saves a result)."""
    from mfu_lab.core.store.step_results import save
    from mfu_lab.runner import run_one_step

    root = tiny_job.output_root()
    kept = earlier_run(root)
    monkeypatch.setenv(hi.RUN_ENV, EARLIER)
    result = {"metrics": {"mfu": {"value": 0.9, "unit": ""}}, "environment": {}}
    step = SimpleNamespace(run=lambda job: save(job, "baseline", result))
    info = SimpleNamespace(key="baseline", folder="01_baseline", number=1, title="baseline", load=lambda: step)
    run_one_step(info, tiny_job, "tests/data/tiny.yaml")
    assert (root / "runs" / EARLIER / "01_baseline" / "result.json").read_bytes() == kept
    lines = hi.load_history(root)
    assert [x["run"] for x in lines].count(EARLIER) == 1 and len(lines) == 2


def test_the_live_runs_own_id_is_still_taken_from_the_environment(tmp_path, monkeypatch):
    """What ``mfu-lab run`` hands its notebooks' kernels: the id of the run that holds the job's folder now."""
    import subprocess

    from tests.conftest import ROOT

    earlier_run(tmp_path)
    holder = ("import sys, time\nfrom mfu_lab.core.store.runstate import job_lock\n"
              "with job_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path), "20260202-000000"], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        monkeypatch.setenv(hi.RUN_ENV, "20260202-000000")
        assert hi.current_run_id(tmp_path) == "20260202-000000"
        monkeypatch.setenv(hi.RUN_ENV, EARLIER)  # not the holder's id
        assert hi.current_run_id(tmp_path) not in (EARLIER, "20260202-000000")
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    monkeypatch.setenv(hi.RUN_ENV, "20260202-000000")  # that run has ended: its id is an earlier run's now
    assert hi.current_run_id(tmp_path) != "20260202-000000"
