"""A step's new files are published as one set or not at all (issue 32, item 5: a full disk while the report is
exported left result.json and the history holding the new run, report.html the previous one's, the index saying
"running" and no failure.json). The steps here are fakes that save a result in the test's own process: the
bracket, the staging and the publication are the real ones."""

import errno
import json
import os
import platform
import shutil
import subprocess

import pytest

from mfu_lab import publish, runner
from mfu_lab.core.errors import StepExecutionError
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import RESULT_FILE, load_results, read_json, write_atomic, write_json_atomic
from mfu_lab.core.store.history import HISTORY_FILE, append_history, load_history
from mfu_lab.core.store.runstate import FAILURE_FILE, RUNNING_FILE, resumable, step_state
from mfu_lab.core.store.staging import STAGE_ENV, staged

from .conftest import ROOT, TINY

INFO = BY_KEY["baseline"]


def result(mfu: float, job) -> dict:
    return {"status": "ok", "elapsed_s": 1.0, "job": job.to_dict(), "environment": {"created_at": f"run {mfu}"},
            "metrics": {"mfu": {"value": mfu, "unit": "", "source": "measured"}}}


def fake_export(notebook, html, result=None):
    """export_html without nbconvert: the report names the result it summarises (the staged one, when given)."""
    figure = read_json(result)["metrics"]["mfu"]["value"] if result else "none"
    return write_atomic(html, f"report of {notebook.name}: mfu {figure}\n")


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(args[-1] if args else "somewhere"))


def one_run(job, mfu: float, run_id: str, with_notebook: bool = True) -> None:
    """One step through the bracket, as ``mfu-lab run`` (a notebook) or ``mfu-lab step`` (none) would run it."""
    folder = job.step_dir(INFO.folder)
    notebook = folder / INFO.notebook if with_notebook else None
    with publish.step_bracket(job, INFO, "job.yaml", run_id, notebook=notebook):
        assert (folder / RUNNING_FILE).is_file()
        store.save(job, INFO.key, result(mfu, job))
        if notebook is not None:
            shutil.copy(ROOT / "notebooks" / INFO.notebook, notebook)


def the_set(job) -> dict[str, bytes | None]:
    """Every file of the published set, as bytes (None: absent)."""
    root, folder = job.output_root(), job.step_dir(INFO.folder)
    paths = {"result": folder / RESULT_FILE, "report": folder / "report.html", "history": root / HISTORY_FILE}
    return {k: p.read_bytes() if p.is_file() else None for k, p in paths.items()}


def no_leftovers(job) -> None:
    root = job.output_root()
    assert not [p for p in root.rglob("*") if p.name.endswith((".staged", ".kept", ".tmp"))]


@pytest.fixture
def previous(tiny_job, monkeypatch):
    """A job whose step 1 has a published set (result, report, history line, the run's copy, the index)."""
    monkeypatch.setattr(publish, "export_html", fake_export)
    one_run(tiny_job, 0.1, "20261201-000000")
    before = the_set(tiny_job)
    assert json.loads(before["result"])["metrics"]["mfu"]["value"] == 0.1
    assert before["report"].startswith(b"report of 01_baseline.ipynb: mfu 0.1")  # the staged result, summarised
    assert [x["run"] for x in load_history(tiny_job.output_root())] == ["20261201-000000"]
    assert (tiny_job.output_root() / "runs" / "20261201-000000" / INFO.folder / RESULT_FILE).is_file()
    assert (tiny_job.output_root() / "index.html").is_file()
    no_leftovers(tiny_job)
    return before


def test_a_full_disk_while_the_report_is_exported_leaves_the_previous_set_whole(tiny_job, previous, monkeypatch):
    monkeypatch.setattr(publish, "export_html", full_disk)
    with pytest.raises(publish.NotPublished) as e:
        one_run(tiny_job, 0.2, "20261201-000100")
    assert the_set(tiny_job) == previous  # result, report and history: the previous run's, whole
    assert not (tiny_job.output_root() / "runs" / "20261201-000100" / INFO.folder / RESULT_FILE).exists()
    no_leftovers(tiny_job)
    folder = tiny_job.step_dir(INFO.folder)
    failure = read_json(folder / FAILURE_FILE)
    assert failure["status"] == "failed" and "No space left on device" in failure["error"]
    assert "none of them was published" in failure["error"]
    assert not (folder / RUNNING_FILE).exists()
    st = step_state(folder)
    assert st.status == "failed" and st.result["metrics"]["mfu"]["value"] == 0.1
    page = (tiny_job.output_root() / "index.html").read_text()
    assert "No space left on device" in page and "(pid " not in page
    assert "No space left on device" in e.value.evalue and "ran to its end" in e.value.evalue
    assert not resumable(folder, tiny_job.to_dict())[0]  # a resumed run runs it again


def test_a_failure_writing_the_index_undoes_the_publication(tiny_job, previous, monkeypatch):
    calls = []

    def index_once_full(root):  # the index after the renames fails; the failure's own rewrite succeeds
        calls.append(root)
        if len(calls) == 2:
            full_disk(root / "index.html")
        return real_index(root)

    real_index = publish.write_index
    monkeypatch.setattr(publish, "write_index", index_once_full)
    with pytest.raises(publish.NotPublished, match="No space left on device"):
        one_run(tiny_job, 0.2, "20261201-000100")
    assert len(calls) == 3  # while running, after the renames (full), after the failure
    assert the_set(tiny_job) == previous  # the renames and the history line taken back
    assert not (tiny_job.output_root() / "runs" / "20261201-000100" / INFO.folder / RESULT_FILE).exists()
    no_leftovers(tiny_job)
    assert read_json(tiny_job.step_dir(INFO.folder) / FAILURE_FILE)["status"] == "failed"
    page = (tiny_job.output_root() / "index.html").read_text()
    assert "(pid " not in page and "No space left on device" in page


def test_an_index_that_cannot_be_written_at_all_is_removed_not_left_saying_running(tiny_job, previous, monkeypatch):
    monkeypatch.setattr(publish, "write_index", full_disk)
    with pytest.raises(StepExecutionError) as e:
        one_run(tiny_job, 0.2, "20261201-000100", with_notebook=False)  # mfu-lab step's path
    assert the_set(tiny_job) == previous
    no_leftovers(tiny_job)
    assert not (tiny_job.output_root() / "index.html").exists()
    assert "index.html could not be rewritten" in e.value.evalue and "mfu-lab report" in e.value.evalue
    assert read_json(tiny_job.step_dir(INFO.folder) / FAILURE_FILE)["status"] == "failed"


def test_failure_json_on_a_full_disk_too_says_so_and_still_clears_the_running_mark(tiny_job, previous, monkeypatch):
    monkeypatch.setattr(publish, "export_html", full_disk)
    monkeypatch.setattr(publish, "mark_failed", lambda folder, *a, **k: full_disk(folder / FAILURE_FILE))
    with pytest.raises(publish.NotPublished) as e:
        one_run(tiny_job, 0.2, "20261201-000100")
    folder = tiny_job.step_dir(INFO.folder)
    assert not (folder / RUNNING_FILE).exists() and not (folder / FAILURE_FILE).exists()
    assert "failure.json could not be written" in e.value.evalue
    assert the_set(tiny_job)["result"] == previous["result"]
    assert "(pid " not in (tiny_job.output_root() / "index.html").read_text()


def test_a_step_that_fails_after_saving_publishes_nothing(tiny_job, previous, monkeypatch):
    def fails_after_save(job, key, data):
        store.save(job, key, data)
        raise RuntimeError("a cell after the save")

    with pytest.raises(StepExecutionError, match="a cell after the save"), \
            publish.step_bracket(tiny_job, INFO, "job.yaml", "20261201-000100"):
        fails_after_save(tiny_job, INFO.key, result(0.2, tiny_job))
    assert the_set(tiny_job)["result"] == previous["result"]
    assert the_set(tiny_job)["history"] == previous["history"]
    no_leftovers(tiny_job)
    assert STAGE_ENV not in os.environ


def test_the_cli_says_what_was_kept_and_exits_non_zero(tiny_job, previous, monkeypatch, capsys):
    """``mfu-lab run`` with the notebook's kernel faked in this process (it saves as the kernel would, staged)."""
    from mfu_lab.cli import main

    def fake_notebook(src, out, params, cwd, quiet, timeout=None):
        store.save(tiny_job, INFO.key, result(0.2, tiny_job))
        shutil.copy(src, out)

    monkeypatch.setattr(runner, "execute_notebook", fake_notebook)
    monkeypatch.setattr(publish, "export_html", full_disk)
    code = main(["run", str(TINY), "--steps", "baseline", "--out", str(tiny_job.output_root().parent), "-q"])
    err = capsys.readouterr().err
    assert code == 1
    assert "01_baseline FAILED: OSError" in err and "No space left on device" in err
    assert "none of them was published" in err and "executed notebook (it ran to its end)" in err
    assert "earlier results kept" in err
    assert the_set(tiny_job)["result"] == previous["result"]
    assert the_set(tiny_job)["history"] == previous["history"]


def test_a_running_mark_left_by_a_dead_process_is_not_shown_as_running(tiny_job, previous):
    p = subprocess.Popen(["true"])
    p.wait()  # its pid: ended
    folder = tiny_job.step_dir(INFO.folder)
    mark = {"step": INFO.key, "run": "20261201-000100", "pid": p.pid, "host": platform.node(),
            "started_at": "2026-12-01T00:01:00+00:00"}
    write_json_atomic(folder / RUNNING_FILE, mark)
    assert step_state(folder).status == "interrupted"
    publish.write_index(tiny_job.output_root())
    page = (tiny_job.output_root() / "index.html").read_text()
    assert f"(pid {p.pid})" not in page and "never finished" in page


def test_readers_never_take_a_staged_file_for_a_result_and_the_next_run_removes_it(tiny_job, monkeypatch):
    folder = tiny_job.step_dir(INFO.folder)
    monkeypatch.setenv(STAGE_ENV, "1")  # as the runner's bracket sets it for a notebook's kernel
    path = store.save(tiny_job, INFO.key, result(0.3, tiny_job))
    monkeypatch.delenv(STAGE_ENV)
    assert path == staged(folder / RESULT_FILE) and path.is_file()
    assert not (folder / RESULT_FILE).exists() and not (tiny_job.output_root() / HISTORY_FILE).exists()
    assert load_results(tiny_job.output_root()) == {} and step_state(folder).status == "not run"
    assert not store.earlier(tiny_job, INFO.key) and not resumable(folder, tiny_job.to_dict())[0]
    (folder / "report.html.kept").write_text("left by a killed publication")
    runner.fresh_step_folder(tiny_job, INFO)
    assert not path.exists() and not (folder / "report.html.kept").exists()


def test_a_history_line_whose_write_fails_is_taken_back(tiny_job, monkeypatch):
    from mfu_lab.core.store import history

    root = tiny_job.output_root()
    root.mkdir(parents=True)
    append_history(root, '{"run": "a", "step": "baseline"}\n')
    real = os.write

    def half_then_full(fd, data):
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(history.os, "write", half_then_full)
    with pytest.raises(OSError):
        append_history(root, '{"run": "b", "step": "baseline"}\n')
    monkeypatch.setattr(history.os, "write", real)
    assert (root / HISTORY_FILE).read_text() == '{"run": "a", "step": "baseline"}\n'


def test_a_fault_in_the_index_pages_own_code_leaves_the_measured_set_published(tiny_job, previous, monkeypatch,
                                                                                 capsys):
    def broken_page(root):
        raise ValueError("a template bug")

    monkeypatch.setattr(publish, "write_index", broken_page)
    one_run(tiny_job, 0.2, "20261201-000100", with_notebook=False)
    now = the_set(tiny_job)
    assert json.loads(now["result"])["metrics"]["mfu"]["value"] == 0.2
    assert [x["run"] for x in load_history(tiny_job.output_root())][-1] == "20261201-000100"
    no_leftovers(tiny_job)
    err = capsys.readouterr().err
    assert "new result is published, but the index page could not be written (ValueError: a template bug)" in err
    assert not (tiny_job.output_root() / "index.html").exists()  # never left saying "running"
