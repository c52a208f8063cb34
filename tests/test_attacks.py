"""Attacks a hostile or careless user could make through a job or cluster file, each reproduced (issue 19)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mfu_lab.analysis.placement.cluster_files import ClusterError, load_cluster
from mfu_lab.core.engine.workload import build_model
from mfu_lab.core.errors import JobError, JobProblem, StepError
from mfu_lab.core.job import yamlfile
from mfu_lab.core.job.schema import Job, load_job, validate

from .conftest import ROOT, TINY, in_process


def mfu_lab(*args, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, "-m", "mfu_lab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_job_file_cannot_run_a_shell_command_through_the_standard_library(tmp_path):
    for model in ("subprocess:getoutput", "os:system", "builtins:exec"):
        job = tmp_path / "evil.yaml"
        job.write_text(TINY.read_text() + f"model: '{model}'\nmodel_kwargs: {{cmd: 'touch {tmp_path}/pwned'}}\n")
        p = in_process("validate", str(job), cwd=tmp_path)
        assert p.returncode == 2, p.stdout
        assert "standard library" in p.stderr and "valid" not in p.stdout
        command = mfu_lab if model == "subprocess:getoutput" else in_process  # one in a process of its own
        p = command("run", str(job), "--steps", "baseline", "--out", str(tmp_path / "out"), "-q", cwd=tmp_path)
        assert p.returncode == 2
        assert not (tmp_path / "pwned").exists()
    with pytest.raises(Exception, match="standard library"):  # a Job built by hand is refused at import time too
        build_model(Job(model="subprocess:getoutput", model_kwargs={"cmd": "true"}))


def test_validate_says_which_code_a_job_names_and_does_not_import_it(tmp_path):
    (tmp_path / "sideeffect.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                            "def make():\n    return None\n")
    job = tmp_path / "job.yaml"
    job.write_text(TINY.read_text() + "model: sideeffect:make\n"
                   f"cluster: {ROOT / 'parameters' / 'clusters' / 'example_h100.yaml'}\n")
    p = mfu_lab("validate", str(job), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "import the module 'sideeffect'" in p.stdout and "make(**model_kwargs)" in p.stdout
    assert "did not import it" in p.stdout
    assert not (tmp_path / "imported").exists()
    assert mfu_lab("keys", cwd=tmp_path).returncode == 0 and not (tmp_path / "imported").exists()


def alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    job = tmp_path / "bomb.yaml"
    body = alias_bomb(9).replace("\n", "\n  ")
    job.write_text(TINY.read_text() + "model_kwargs:\n  " + body)
    t0 = time.perf_counter()
    p = mfu_lab("validate", str(job), cwd=tmp_path, timeout=60)  # a process: a bomb that got through would hang here
    took = time.perf_counter() - t0
    assert p.returncode == 2
    assert "expands to more than 100,000 values" in p.stderr and "bomb.yaml" in p.stderr
    assert len(p.stdout) + len(p.stderr) < 4000, "the value is never echoed whole"
    assert took < 60
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(alias_bomb(9))
    with pytest.raises(ClusterError, match="expands to more than"):
        load_cluster(cluster)


def test_a_recursive_alias_and_an_oversized_file_are_refused(tmp_path):
    with pytest.raises(yamlfile.YamlProblem, match="recursive alias"):
        yamlfile.loads("a: &a [1, *a]\n")
    big = tmp_path / "big.yaml"
    big.write_text("seed: 0\n" + "# padding\n" * 120_000)
    with pytest.raises(JobError, match="may hold at most 1,000,000"):
        load_job(big)


def test_a_bad_value_is_never_echoed_whole():
    text = str(JobProblem("seed", "x" * 10_000, "must be a whole number"))
    assert len(text) < 250 and "(10,002 characters)" in text


def test_a_name_ending_in_a_newline_is_refused():
    with pytest.raises(JobError, match="job_name"):
        validate({"job_name": "tiny\n"}, "test")
    with pytest.raises(JobError, match="model"):
        validate({"model": "gpt\n"}, "test")
    with pytest.raises(JobError, match="rdzv_endpoint"):
        validate({"nnodes": 2, "rdzv_endpoint": "node01:29500\n"}, "test")


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    job = tmp_path / "twice.yaml"
    job.write_text("job_name: tiny\nmicro_batch: 4\nsteps: 4\nmicro_batch: 8\n")
    with pytest.raises(JobError, match="key 'micro_batch' is given twice, on lines 2 and 4"):
        load_job(job)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpu: H100 SXM\ngpu: A100\n")
    with pytest.raises(ClusterError, match="given twice, on lines 1 and 2"):
        load_cluster(cluster)


def test_a_job_file_that_is_not_utf8_is_named(tmp_path):
    job = tmp_path / "latin1.yaml"
    job.write_bytes("job_name: caf\xe9\n".encode("latin-1"))
    p = in_process("validate", str(job), cwd=tmp_path)
    assert p.returncode == 2
    assert "latin1.yaml" in p.stderr and "is not UTF-8 text" in p.stderr


def test_a_second_run_of_the_same_job_is_refused_naming_the_holder_or_waits(tmp_path):
    import os
    import threading

    from mfu_lab.core.store.runstate import job_lock

    root = tmp_path / "tiny"
    with job_lock(root, "20261130-120000"):
        p = mfu_lab("step", "baseline", "--job", str(TINY), "--out", str(tmp_path))
        assert p.returncode == 2
        assert f"in use by run 20261130-120000 (pid {os.getpid()}" in p.stderr and "--wait" in p.stderr
        assert not (root / "01_baseline").exists()  # nothing measured, nothing written
    release = threading.Event()

    def hold():
        with job_lock(root, "20261130-120001"):
            release.wait(120)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        waiter = subprocess.Popen([sys.executable, "-m", "mfu_lab", "step", "baseline", "--job", str(TINY), "--out",
                                   str(tmp_path), "--wait"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        seen = []
        for line in waiter.stdout:  # the waiting line comes before any work
            seen.append(line)
            if "waiting for it to finish (--wait)" in line:
                break
        assert "in use by run 20261130-120001" in seen[-1], seen
        assert waiter.poll() is None and not (root / "01_baseline").exists()
    finally:
        release.set()
        holder.join()
    out, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err
    assert (root / "01_baseline" / "result.json").is_file()


def test_two_runs_in_one_second_get_different_ids(tmp_path):
    import datetime as dt

    from mfu_lab.core.store.history import new_run_id

    now = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.UTC)
    ids = [new_run_id(now, job_root=tmp_path) for _ in range(3)]
    assert ids == ["20261130-120000", "20261130-120000-2", "20261130-120000-3"]


def test_a_resumed_run_goes_on_with_the_run_that_made_the_same_job(tmp_path):
    import json

    from mfu_lab.core.store.history import HISTORY_FILE, job_digest, resumed_run_id

    job = {"job_name": "tiny", "seed": 0}
    a = {"run": "20261130-100000", "step": "baseline", "job_digest": job_digest(job), "source_digest": "aaa"}
    b = {"run": "20261130-110000", "step": "baseline", "job_digest": job_digest({**job, "seed": 1})}
    history = tmp_path / HISTORY_FILE
    history.write_text(json.dumps(a) + "\n")
    assert resumed_run_id(tmp_path, job) == "20261130-100000"  # the interrupted run goes on
    assert resumed_run_id(tmp_path, job, {"source_digest": "bbb"}) is None  # edited code: a new run
    assert resumed_run_id(tmp_path, {**job, "seed": 2}) is None
    history.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert resumed_run_id(tmp_path, job) is None  # another run came in between: run A's record is not reopened


def test_resume_does_not_keep_a_result_made_by_edited_code(tmp_path):
    from mfu_lab.core.store.files import write_json_atomic
    from mfu_lab.core.store.runstate import resumable, workbook_version

    job = Job().to_dict()
    env = {**workbook_version(), "created_at": "t0"}
    write_json_atomic(tmp_path / "result.json", {"status": "ok", "job": job, "environment": env})
    assert resumable(tmp_path, job)[0]
    write_json_atomic(tmp_path / "result.json", {"status": "ok", "job": job,
                                                 "environment": {**env, "source_digest": "0" * 12}})
    keep, why = resumable(tmp_path, job)
    assert not keep and why.startswith("workbook source changed since it ran (edited files, same commit)")


def test_report_rewrites_no_index_in_a_folder_no_run_made(tmp_path):
    page = tmp_path / "index.html"
    page.write_text("<p>someone else's page</p>")
    p = in_process("report", str(tmp_path))
    assert p.returncode == 2
    assert "holds no mfu-lab results" in p.stderr and ".mfu-lab marker" in p.stderr
    assert page.read_text() == "<p>someone else's page</p>"
    from mfu_lab.core.store.files import JOB_MARKER, is_job_root, mark_job_root

    assert not is_job_root(tmp_path)
    mark_job_root(tmp_path / "job")
    assert (tmp_path / "job" / JOB_MARKER).is_file() and is_job_root(tmp_path / "job")


def test_a_damaged_file_is_named_and_blocks_nothing_that_does_not_depend_on_it(tmp_path):
    out, root = str(tmp_path), tmp_path / "tiny"
    assert in_process("step", "baseline", "--job", str(TINY), "--out", out).returncode == 0
    result = root / "01_baseline" / "result.json"
    result.write_text(result.read_text()[:200])  # truncated, as by a full disk
    (root / "02_attention_and_comm").mkdir()
    (root / "02_attention_and_comm" / "failure.json").write_text('{"status": "fai')
    with open(root / "history.jsonl", "ab") as f:  # a line in another encoding, one with fields of the wrong type
        f.write('{"run": "caf\xe9", "step": "x"}\n'.encode("latin-1"))
        f.write(b'{"run": 1, "step": ["baseline"], "metrics": "mfu"}\n')

    p = in_process("report", out + "/tiny")
    assert p.returncode == 0, p.stderr
    index = (root / "index.html").read_text()
    assert "damaged" in index and "rerun step 1 (baseline)" in index
    assert "failure record is damaged" in index
    p = in_process("history", out + "/tiny")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr

    p = in_process("step", "kernels", "--job", str(TINY), "--out", out, "-p", "profile_ddp=false")
    assert p.returncode == 0, p.stderr
    assert f"warning: {result} is damaged (not complete JSON" in p.stderr and "going on without it" in p.stderr
    assert (root / "03_kernels" / "result.json").is_file()

    p = in_process("run", str(TINY), "--steps", "baseline", "--out", out, "-q", "--resume")
    assert p.returncode == 0, p.stderr
    assert "01_baseline: runs again" in p.stdout and "is damaged" in p.stdout
    assert json.loads(result.read_text())["metrics"]["mfu"]["value"] > 0


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    p = in_process("validate", str(TINY), "-p", f"out_dir={blocker}")
    assert p.returncode == 2
    assert "key 'out_dir'" in p.stderr and "is a file, not a folder" in p.stderr
    p = in_process("run", str(TINY), "--steps", "baseline", "--out", str(blocker), "-q")
    assert p.returncode == 2 and "is a file, not a folder" in p.stderr and "Traceback" not in p.stderr

    from mfu_lab import runner

    def read_only(*a, **k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(runner.tempfile, "mkstemp", read_only)
    with pytest.raises(JobError, match="nothing can be written in .*Read-only file system"):
        runner.check_output_folder(Job(out_dir=str(tmp_path / "new" / "deeper")), "job.yaml")
    assert not (tmp_path / "new").exists()


def test_keep_going_goes_past_a_step_whose_folder_cannot_be_written(tmp_path):
    from mfu_lab.core.store.files import mark_job_root

    root = mark_job_root(tmp_path / "tiny")  # an earlier run's folder (issue 48: a run refuses one it did not make)
    (root / "01_baseline").write_text("a file where the step's folder should be")
    p = in_process("run", str(TINY), "--steps", "baseline,kernels", "--out", str(tmp_path), "-q", "--keep-going",
                   "-p", "profile_ddp=false")
    assert p.returncode == 1, p.stderr
    assert "01_baseline FAILED:" in p.stderr and "choose another out_dir" in p.stderr and "Traceback" not in p.stderr
    assert (root / "03_kernels" / "result.json").is_file()


def test_smaller_ones_nan_wording_infinite_buckets_and_a_dead_kernel(tmp_path):
    from mfu_lab.core.process.faults import NonFiniteLoss
    from mfu_lab.publish import _failure

    text = str(NonFiniteLoss(3, float("nan")))
    assert "training step 3" in text and "stopped" not in text  # all steps may have run before the check
    with pytest.raises(JobError, match="finite number > 0"):
        validate({"comm_bucket_mb": [float("inf")]}, "test")

    class DeadKernelError(RuntimeError):
        pass

    status, ename, evalue = _failure(DeadKernelError("Kernel died"), tmp_path / "nb.ipynb", None, Job(micro_batch=8))
    assert status == "failed" and ename == "DeadKernelError"
    assert "running out of memory" in evalue and "Host memory now: host: total" in evalue and "micro_batch: 4" in evalue


def test_kernel_connection_files_stay_in_the_job_folder_and_are_removed(tmp_path):
    import tempfile

    from mfu_lab.runner import kernel_files_in

    folder = tmp_path / ".kernels"
    folder.mkdir()
    (folder / "tmpstale.json").write_text("{}")  # left by a killed run
    before = tempfile.tempdir
    with kernel_files_in(folder):
        fd, name = tempfile.mkstemp(".json")  # as jupyter_client writes a connection file
        os.close(fd)
        assert Path(name).parent == folder and not (folder / "tmpstale.json").exists()
    assert tempfile.tempdir == before and not folder.exists()


def test_merge_keys_stay_allowed_and_a_local_module_may_not_share_a_stdlib_name(tmp_path, monkeypatch):
    import yaml

    for text in ("base: &b {x: 1, y: 2}\nc: {<<: *b, y: 3}\n",
                 "defs:\n  base: &base {a: 1}\n  mid: &mid {<<: *base, a: 2}\ntop: {<<: *mid}\n",
                 "a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b], z: 3}\n"):
        assert yamlfile.loads(text) == yaml.safe_load(text)
    with pytest.raises(yamlfile.YamlProblem, match="given twice"):
        yamlfile.loads("d:\n  m: &m\n    y: 1\n    y: 2\nt: {<<: *m}\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "__init__.py").write_text("")
    (tmp_path / "code" / "models.py").write_text("def build():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    # issue 32 item 9: a stdlib name is never a factory's module (importing it would find the stdlib's if loaded)
    with pytest.raises(JobError, match="standard library.*renamed"):
        validate({"model": "code.models:build"}, "test")
    (tmp_path / "code").rename(tmp_path / "mycode")
    assert validate({"model": "mycode.models:build"}, "test").model == "mycode.models:build"
    with pytest.raises(JobError, match="standard library"):
        validate({"model": "subprocess:getoutput"}, "test")


def test_a_plain_python_step_saves_under_the_id_it_reserved_and_locked(tmp_path):
    p = in_process("step", "baseline", "--job", str(TINY), "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    (line,) = [json.loads(x) for x in (tmp_path / "tiny" / "history.jsonl").read_text().splitlines()]
    assert (tmp_path / "tiny" / "runs" / line["run"] / "01_baseline" / "result.json").is_file()
    assert sorted(x.name for x in (tmp_path / "tiny" / "runs").iterdir()) == [line["run"]]


# ------------------------------------------------------------------ issue 32, item 2: links planted in the job folder
def _victim(tmp_path):
    """A file and a folder outside the job's folder that a planted link points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    return outside


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path):
    from mfu_lab.core.store.files import PlantedLink, mark_job_root
    from mfu_lab.core.store.runstate import job_lock

    outside, root = _victim(tmp_path), mark_job_root(tmp_path / "out" / "tiny")
    (root / ".lock").symlink_to(outside / "precious.txt")
    with pytest.raises(PlantedLink, match="symbolic link inside the job's output folder") as e:
        with job_lock(root, "20261130-120000"):
            pass
    assert e.value.filename == str(root / ".lock")
    assert (outside / "precious.txt").read_text() == "keep me\n"


def test_the_history_is_never_appended_through_a_link(tmp_path):
    from mfu_lab.core.store.files import PlantedLink, mark_job_root, write_json_atomic
    from mfu_lab.core.store.history import record

    outside, root = _victim(tmp_path), mark_job_root(tmp_path / "tiny")
    write_json_atomic(root / "01_baseline" / "result.json", {"metrics": {}})
    (root / "history.jsonl").symlink_to(outside / "precious.txt")
    with pytest.raises(PlantedLink) as e:
        record(root, "01_baseline", "baseline", {"metrics": {}}, run_id="20261130-120000")
    assert e.value.filename == str(root / "history.jsonl")
    assert (outside / "precious.txt").read_text() == "keep me\n"


@pytest.mark.parametrize("planted", ["01_baseline", "runs"])
def test_a_folder_of_the_job_made_a_link_gets_nothing_written_through_it(tmp_path, tiny_job, planted):
    """A step folder (or runs/) replaced by a link: the save, the run's id, the lock's look at the job's folder
    and the runner's look at the step's folder each refuse it, naming it; nothing lands where it points."""
    import dataclasses

    from mfu_lab.core.registry import BY_KEY
    from mfu_lab.core.store import step_results as store
    from mfu_lab.core.store.files import PlantedLink, mark_job_root
    from mfu_lab.core.store.history import new_run_id
    from mfu_lab.core.store.runstate import job_lock
    from mfu_lab.runner import fresh_step_folder

    outside = _victim(tmp_path)
    root = mark_job_root(tiny_job.output_root())
    (root / planted).symlink_to(outside, target_is_directory=True)
    named = str(root / planted)
    with pytest.raises(PlantedLink) as e:
        with job_lock(root, "20261130-120000"):
            pass
    assert e.value.filename == named
    with pytest.raises(PlantedLink) as e:
        if planted == "runs":
            new_run_id(job_root=root)
        else:
            store.save(tiny_job, "baseline", {"metrics": {}, "environment": {}})
    assert e.value.filename == named
    if planted == "01_baseline":
        with pytest.raises(PlantedLink):
            fresh_step_folder(tiny_job, BY_KEY["baseline"])
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    # a link deeper in a step's folder is refused before the step runs
    (root / planted).unlink()
    (root / "04_compile" / "trials").mkdir(parents=True)
    (root / "04_compile" / "trials" / "eager.spec.json").symlink_to(outside / "precious.txt")
    with pytest.raises(PlantedLink, match="eager.spec.json"):
        fresh_step_folder(dataclasses.replace(tiny_job), BY_KEY["compile"])


def test_out_dir_and_the_job_folder_may_be_the_users_own_links(tmp_path, tiny_job):
    import dataclasses

    from mfu_lab.core.store import step_results as store
    from mfu_lab.core.store.history import load_history
    from mfu_lab.core.store.runstate import job_lock

    real = tmp_path / "scratch"
    (real / "tiny").mkdir(parents=True)
    (tmp_path / "out_link").symlink_to(real, target_is_directory=True)  # out_dir a link
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "tiny").symlink_to(real / "tiny", target_is_directory=True)  # the job folder a link
    for out in (tmp_path / "out_link", tmp_path / "jobs"):
        job = dataclasses.replace(tiny_job, out_dir=str(out))
        with job_lock(job.output_root(), "20261130-120000"):
            store.save(job, "baseline", {"metrics": {}, "environment": {}})
    assert (real / "tiny" / "01_baseline" / "result.json").is_file() and len(load_history(real / "tiny")) == 2


def test_mfu_lab_step_refuses_a_planted_step_folder_before_any_work(tmp_path):
    outside = _victim(tmp_path)
    root = tmp_path / "out" / "tiny"
    root.mkdir(parents=True)
    (root / "01_baseline").symlink_to(outside, target_is_directory=True)
    p = in_process("step", "baseline", "--job", str(TINY), "--out", str(tmp_path / "out"))
    assert p.returncode == 2, p.stderr
    assert f"{root / '01_baseline'}: is a symbolic link inside the job's output folder" in p.stderr
    assert sorted(x.name for x in outside.iterdir()) == ["precious.txt"]


def test_a_key_that_is_code_is_named_as_the_attack_it_is(tmp_path):
    """Issue 32, item 3: `papermill -f` writes each key as `key = value`; validate (and run) refuse a key that is not a
    Python name, naming it, and run nothing."""
    job = tmp_path / "evil.yaml"
    job.write_text(TINY.read_text() + f"\"x = 1; __import__('os').system('touch {tmp_path}/pwned'); y\": 1\n"
                   "class: 2\n")
    for args in (("validate", str(job)), ("run", str(job), "--out", str(tmp_path / "out"), "-q")):
        p = mfu_lab(*args, cwd=tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        assert p.stderr.count("not a Python name: papermill -f would run it as code") == 2, p.stderr
        assert "key 'x = 1; __import__" in p.stderr and "key 'class'" in p.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()
    with pytest.raises(JobError, match="not a Python name"):
        validate({"micro batch": 4}, "values")


def test_an_empty_job_file_is_refused_with_its_path_and_no_file_means_the_default_job(tmp_path):
    """Issue 32, item 14: a job file that sets nothing (0 bytes, only comments, `{}`) is refused naming it."""
    for i, text in enumerate(("", "# a truncated copy\n\n# nothing else\n", "{}\n")):
        job = tmp_path / f"empty{i}.yaml"
        job.write_text(text)
        with pytest.raises(JobError, match="sets no key"):
            load_job(job)
        p = in_process("validate", str(job), cwd=tmp_path)
        assert p.returncode == 2 and str(job) in p.stderr and "sets no key" in p.stderr, p.stderr
    p = in_process("run", str(job), "--out", str(tmp_path / "out"), "-q", cwd=tmp_path)
    assert p.returncode == 2 and "sets no key" in p.stderr and not (tmp_path / "out").exists()
    from mfu_lab.runner import resolve_job

    job, source = resolve_job(None, {}, str(tmp_path / "out"), writable=False)  # no file: the default job
    assert source.endswith("default.yaml") and job.job_name == load_job(ROOT / "parameters" / "default.yaml").job_name


def _result(value) -> str:
    return json.dumps({"status": "ok", "job": {}, "environment": {"device_name": "cpu"},
                       "metrics": {"mfu": {"value": value, "unit": "", "source": "measured"}}})


def test_a_result_of_the_wrong_types_or_a_cut_notebook_is_damaged_not_a_crash(tmp_path):
    """Issue 32, items 6 and 7: a result.json whose fields have the wrong types (a metric's value "0.5") is damaged
    like a truncated one, named by report and compare; a notebook cut by a kill (NotJSONError) is named by report,
    which goes on with the others."""
    from mfu_lab.core.store.files import DamagedFile, read_json

    root = tmp_path / "tiny"
    for where in (root, root / "runs" / "20260101-000000", root / "runs" / "20260102-000000"):
        (where / "01_baseline").mkdir(parents=True)
        (where / "01_baseline" / "result.json").write_text(_result("0.5"))
        (where / "03_kernels").mkdir()
        (where / "03_kernels" / "result.json").write_text(_result(0.25))
    (root / ".mfu-lab").write_text("")
    (root / "01_baseline" / "01_baseline.ipynb").write_text('{"cells": [{"cell_type": "co')
    with pytest.raises(DamagedFile, match="metrics.mfu.value is text"):
        read_json(root / "01_baseline" / "result.json")
    for bad in ({"status": 1}, {"metrics": {"mfu": {"value": True, "unit": "", "source": "measured"}}},
                {"metrics": {"mfu": 0.5}}, {"candidates": [{"m": {"value": [1], "unit": "", "source": "counted"}}]}):
        (root / "03_kernels" / "x").mkdir(exist_ok=True)
        (root / "03_kernels" / "x" / "result.json").write_text(json.dumps(bad))
        with pytest.raises(DamagedFile, match="wrong type"):
            read_json(root / "03_kernels" / "x" / "result.json")
    p = in_process("report", str(root))
    assert p.returncode == 0, p.stderr
    assert "01_baseline.ipynb is damaged (not a complete notebook" in p.stderr and "Traceback" not in p.stderr
    index = (root / "index.html").read_text()
    assert "metrics.mfu.value is text" in index and "rerun step 1 (baseline)" in index
    p = in_process("compare", "latest", "previous", "--job-dir", str(root))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("01_baseline/result.json is damaged (wrong type") == 2, p.stderr


def test_a_list_of_numbers_reads_number_text_as_a_scalar_key_does(tmp_path):
    """Issue 32, item 11: YAML reads 1e-9 (no dot) as text; comm_bucket_mb: [1e-9] is a number, as lr: 1e-9 is."""
    job = tmp_path / "job.yaml"
    job.write_text(TINY.read_text() + "comm_bucket_mb: [1e-9, 25]\nlr: 1e-9\n")
    j = load_job(job)
    assert j.comm_bucket_mb == [1e-9, 25] and j.lr == 1e-9
    assert in_process("validate", str(job), cwd=tmp_path).returncode == 0
    for bad, why in (("[.inf]", "finite number > 0"), ("[1e-9, 1e-9]", "must not repeat"), ("[abc]", "item 'abc'")):
        job.write_text(TINY.read_text() + f"comm_bucket_mb: {bad}\n")
        with pytest.raises(JobError, match=why):
            load_job(job)


def test_a_model_with_no_parameters_is_named_not_torchs_empty_parameter_list(tiny_job):
    """Issue 32, item 13: a factory returning a model with nothing to train gets a StepError naming the factory."""
    import dataclasses as dc

    from mfu_lab.core.errors import StepError

    job = dc.replace(tiny_job, model="tests.fixtures.tiny_models:no_parameters")
    with pytest.raises(StepError, match="model: tests.fixtures.tiny_models:no_parameters returned a _NoParameters "
                                        "with no parameters to train"):
        build_model(job)


def test_an_execution_timeout_that_is_not_whole_seconds_is_refused_up_front(tmp_path):
    """Issue 32, item 10: nbclient takes whole seconds; inf or 600.5 failed every step with a TraitError."""
    for bad in ("inf", "600.5", "nan", "0", "-3"):
        command = mfu_lab if bad == "inf" else in_process  # one in a process of its own
        p = command("run", str(TINY), "--steps", "baseline", "--out", str(tmp_path / "out"), "-q",
                    "--execution-timeout", bad, cwd=tmp_path)
        assert p.returncode == 2, (bad, p.stdout, p.stderr)
        assert "--execution-timeout" in p.stderr and "whole number of seconds > 0" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and not (tmp_path / "out" / "tiny" / "01_baseline").exists()


# ------------------------------------------------------------------ issue 32 item 9: where a factory may come from
def _factory(folder: Path, name: str = "my_models", marker: Path | None = None) -> Path:
    """A model factory module ``name.py`` in ``folder`` whose import writes ``marker`` (when given)."""
    folder.mkdir(parents=True, exist_ok=True)
    touch = f"open({str(marker)!r}, 'w').close()\n" if marker else ""
    (folder / f"{name}.py").write_text(touch + "import torch\n\n\ndef build(vocab_size=128):\n"
                                       "    return torch.nn.Sequential(torch.nn.Embedding(vocab_size, 8), "
                                       "torch.nn.Linear(8, vocab_size))\n")
    return folder / f"{name}.py"


def test_an_installed_package_function_is_refused_by_validate_and_at_load_time(tmp_path, monkeypatch):
    """Issue 32 item 9: IPython.utils.process:system with a cmd ran a shell command;
    mfu_lab.core.store.files:write_atomic wrote a file. Both are refused by validate (the CLI's too) and again when a
    step builds the model."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    attacks = {"IPython.utils.process:system": {"cmd": f"touch {marker}"},
               "mfu_lab.core.store.files:write_atomic": {"path": str(marker), "text": "x"},
               "os:system": {"command": f"touch {marker}"}, "json.decoder:JSONDecoder": {}}
    for spec, kwargs in attacks.items():
        job = tmp_path / "evil.yaml"
        job.write_text(TINY.read_text() + f"model: '{spec}'\nmodel_kwargs: {json.dumps(kwargs)}\n")
        with pytest.raises(JobError, match="the rule: a factory's module must be") as e:
            load_job(job)
        assert e.value.problems[0].key == "model" and spec in str(e.value)
        if spec.startswith("IPython"):  # the command line says the same (one run: each takes seconds)
            p = mfu_lab("validate", str(job), cwd=tmp_path)
            assert p.returncode == 2 and "the rule: a factory's module must be" in p.stderr, p.stderr
        with pytest.raises(StepError, match=f"job key 'model' = '{spec}': .*the rule: .*it is not imported"):
            build_model(Job(model=spec, model_kwargs=kwargs))
        assert not marker.exists(), spec
    with pytest.raises(JobError, match="package 'IPython', which the job does not trust.*trust: \\[IPython\\]"):
        validate({"model": "IPython.utils.process:system"}, "t")


def test_validate_imports_nothing_and_accepts_a_factory_beside_the_job_or_in_factory_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading puts the factory's folder on sys.path
    for name in ("beside_mod", "listed_mod"):  # recorded as absent, so the modules imported here go at teardown
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    marker = tmp_path / "imported"
    jobs, elsewhere = tmp_path / "jobs", tmp_path / "models"
    _factory(jobs, "beside_mod", marker)
    _factory(elsewhere, "listed_mod", marker)
    beside = jobs / "a.yaml"
    beside.write_text(TINY.read_text() + "model: beside_mod:build\n")
    job = load_job(beside)
    assert job.factory_paths == [str(jobs.resolve())]  # the file's folder is held: a kernel elsewhere finds it too
    listed = jobs / "b.yaml"
    listed.write_text(TINY.read_text() + "model: listed_mod:build\nfactory_paths: [../models]\n")
    assert load_job(listed).factory_paths == [str(elsewhere.resolve())]
    assert not marker.exists() and "beside_mod" not in sys.modules and "listed_mod" not in sys.modules
    outside = jobs / "c.yaml"  # listed_mod is neither beside c.yaml nor in its factory_paths
    outside.write_text(TINY.read_text() + "model: listed_mod:build\n")
    with pytest.raises(JobError, match="no module listed_mod beside the job file .*the rule: a factory's module "
                                       "must be .*list its folder in factory_paths") as e:
        load_job(outside)
    assert e.value.problems[0].key == "model"
    missing = jobs / "d.yaml"
    missing.write_text(TINY.read_text() + "model: listed_mod:build\nfactory_paths: [nowhere]\n")
    with pytest.raises(JobError, match="key 'factory_paths'.*no such folder"):
        load_job(missing)
    monkeypatch.chdir(ROOT)  # loading in another folder (a notebook's kernel) finds the same files
    model = build_model(dataclasses.replace(job, out_dir=str(tmp_path / "out")))
    assert isinstance(model, torch.nn.Module) and marker.exists()
    assert Path(sys.modules["beside_mod"].__file__).resolve() == (jobs / "beside_mod.py").resolve()
    assert isinstance(build_model(load_job(listed)), torch.nn.Module)


def test_trust_allows_an_installed_package_but_never_mfu_lab_or_the_standard_library(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"  # an installed package, as pip would lay it out
    _factory(site / "somepkg", "models")
    (site / "somepkg" / "__init__.py").write_text(f"open({str(tmp_path / 'pkg-imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    job = jobs / "j.yaml"
    job.write_text(TINY.read_text() + "model: somepkg.models:build\n")
    with pytest.raises(JobError, match="installed package 'somepkg', which the job does not trust"):
        load_job(job)
    job.write_text(TINY.read_text() + "model: somepkg.models:build\ntrust: [somepkg]\n")
    loaded = load_job(job)
    assert not (tmp_path / "pkg-imported").exists() and "somepkg" not in sys.modules  # validate imported nothing
    listed = jobs / "k.yaml"  # an installed package reached through factory_paths still needs trust
    listed.write_text(TINY.read_text() + f"model: somepkg.models:build\nfactory_paths: [{site}]\n")
    with pytest.raises(JobError, match="installed package's module .*trust: \\[somepkg\\]"):
        load_job(listed)
    try:
        assert isinstance(build_model(dataclasses.replace(loaded, out_dir=str(tmp_path / "out"))), torch.nn.Module)
        assert (tmp_path / "pkg-imported").exists() and str(site) in sys.path
    finally:
        for name in ("somepkg.models", "somepkg"):
            sys.modules.pop(name, None)
    for trusted, spec in (("mfu_lab", "mfu_lab.core.store.files:write_atomic"), ("os", "os:system"),
                          ("subprocess", "subprocess:getoutput"), ("builtins", "builtins:exec")):
        job.write_text(TINY.read_text() + f"model: '{spec}'\ntrust: [{trusted}]\n")
        with pytest.raises(JobError) as e:
            load_job(job)
        assert {p.key for p in e.value.problems} == {"trust"} and "never trusted" in str(e.value)
        with pytest.raises(StepError, match="the rule"):  # a Job built by hand is refused when loaded
            build_model(Job(model=spec, trust=[trusted]))
    job.write_text(TINY.read_text() + "model: 'x:y'\ntrust: [some.pkg]\n")
    with pytest.raises(JobError, match="top-level package name"):
        load_job(job)
