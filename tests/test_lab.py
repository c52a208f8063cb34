"""``mfu-lab lab``: the job's own copy of the step notebooks (parameters injected, nothing run) under
``outputs/<job>/lab/``; an existing lab notebook kept unless --fresh; --allow-root exactly when root; the committed
notebooks never touched; a prepared notebook runs from the lab folder and writes where ``mfu-lab run`` writes."""

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from mfu_lab import lab
from mfu_lab.cli import main
from mfu_lab.core.registry import STEPS

from .conftest import ROOT, TINY

STEP_NOTEBOOKS = [s.notebook for s in STEPS]


def committed() -> dict[str, str]:
    """Each committed notebook's digest."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}


def injected(notebook: Path) -> str:
    (cell,) = [c for c in json.loads(notebook.read_text())["cells"] if "injected-parameters" in
               c["metadata"].get("tags", [])]
    return "".join(cell["source"])


def test_prepare_only_puts_each_step_notebook_with_the_jobs_parameters_and_nothing_run(tmp_path, capsys):
    before = committed()
    assert main(["lab", str(TINY), "-p", "micro_batch=8", "--out", str(tmp_path), "--prepare-only"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "tiny" / "lab"
    assert f"lab for job 'tiny' from {TINY}: {folder}" in out
    assert sorted(p.name for p in folder.iterdir()) == STEP_NOTEBOOKS  # no monitor folder named: no 00_monitor
    assert "prepared (parameters injected, not run): " + ", ".join(STEP_NOTEBOOKS) in out
    assert f"results land in {tmp_path / 'tiny'}/NN_step/, as with mfu-lab run" in out
    assert f"-m jupyter lab --ServerApp.root_dir={folder}" in out
    # the kernels get the -p overrides, as under mfu-lab run: each step's result records them beside its figures
    assert """MFU_LAB_OVERRIDES='{"micro_batch": 8}'""" in out
    assert ("--allow-root" in out) == (os.geteuid() == 0) and (lab.ROOT_NOTE in out) == (os.geteuid() == 0)
    for name in STEP_NOTEBOOKS:
        nb = json.loads((folder / name).read_text())
        text = injected(folder / name)
        assert "micro_batch = 8" in text and 'job_name = "tiny"' in text and "n_layers = 2" in text
        assert f'out_dir = "{tmp_path}"' in text  # absolute: results land in the job's folder from any cwd
        assert nb["metadata"]["papermill"]["parameters"]["micro_batch"] == 8
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(c["outputs"] == [] and c["execution_count"] is None for c in code), name
    assert not (tmp_path / "tiny" / "01_baseline").exists()  # nothing ran
    assert committed() == before


def test_a_lab_notebook_is_kept_unless_fresh(tmp_path, capsys):
    args = ["lab", str(TINY), "--out", str(tmp_path), "--prepare-only"]
    assert main(args) == 0
    mine = tmp_path / "tiny" / "lab" / STEP_NOTEBOOKS[0]
    nb = json.loads(mine.read_text())
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "my own notes"})
    mine.write_text(json.dumps(nb))
    edited = mine.read_bytes()
    capsys.readouterr()

    assert main([*args, "-p", "seed=5"]) == 0
    out = capsys.readouterr().out
    assert mine.read_bytes() == edited
    assert "kept as they were (your work; --fresh replaces them): " + ", ".join(STEP_NOTEBOOKS) in out
    assert "prepared with other parameters than the job's now (seed 0 -> 5)" in out  # the kept ones run with seed 0

    mine.unlink()  # a notebook the user deleted is prepared again; the others stay kept
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"prepared (parameters injected, not run): {STEP_NOTEBOOKS[0]}\n" in out
    assert "kept as they were" in out and "other parameters" not in out

    mine.write_bytes(edited)
    assert main([*args, "--fresh", "-p", "seed=5"]) == 0
    out = capsys.readouterr().out
    assert "prepared afresh (--fresh; the earlier copies replaced): " + ", ".join(STEP_NOTEBOOKS) in out
    assert "my own notes" not in mine.read_text() and "seed = 5" in injected(mine)
    assert not list((tmp_path / "tiny" / "lab").glob(".*"))  # no partial file left behind


@pytest.mark.parametrize("euid", [0, 1000])
def test_allow_root_is_added_exactly_when_root(monkeypatch, tmp_path, euid):
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    cmd = lab.lab_command(tmp_path, 8899, False)
    assert cmd[:4] == [sys.executable, "-m", "jupyter", "lab"]
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--port=8899" in cmd and "--no-browser" in cmd
    assert ("--allow-root" in cmd) == (euid == 0)
    assert "--no-browser" not in lab.lab_command(tmp_path) and not any("--port" in a for a in lab.lab_command(tmp_path))


def test_a_bad_job_gives_the_usual_error_and_prepares_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job_name: bad\nmicro_batch: -3\n")
    assert main(["lab", str(bad), "--out", str(tmp_path), "--prepare-only"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "key 'micro_batch' = -3" in err
    assert main(["lab", str(tmp_path / "nope.yaml"), "--prepare-only"]) == 2
    assert "no such job file" in capsys.readouterr().err
    assert main(["lab", str(TINY), "-p", "micro_bacth=2", "--out", str(tmp_path), "--prepare-only"]) == 2
    assert "did you mean 'micro_batch'" in capsys.readouterr().err
    assert main(["lab", str(TINY), "--port", "0", "--prepare-only"]) == 2
    assert not list(tmp_path.rglob("*.ipynb"))


def test_relative_paths_that_point_elsewhere_from_the_lab_are_injected_absolute(tmp_path, monkeypatch, capsys):
    """A kernel starts in the notebook's folder, the runner's in the workbook root: a relative monitor_dir found
    from here is injected as its absolute path, and the lab gets 00_monitor, reading it."""
    (tmp_path / "mon").mkdir()
    monkeypatch.chdir(tmp_path)  # outside any checkout: relative paths are taken from here
    assert main(["lab", str(TINY), "-p", "monitor_dir=mon", "--out", str(tmp_path / "o"), "--prepare-only"]) == 0
    folder = tmp_path / "o" / "tiny" / "lab"
    assert sorted(p.name for p in folder.iterdir()) == ["00_monitor.ipynb", *STEP_NOTEBOOKS]
    assert f'monitor_dir = "{tmp_path / "mon"}"' in injected(folder / STEP_NOTEBOOKS[0])
    monitor = injected(folder / "00_monitor.ipynb")
    assert f'monitor_dir = "{tmp_path / "mon"}"' in monitor and f'out = "{tmp_path / "o" / "tiny" / "00_monitor"}"' \
        in monitor
    assert 'cluster = "parameters/clusters/' in injected(folder / STEP_NOTEBOOKS[0])  # found the same way there


@pytest.mark.e2e
def test_a_prepared_notebook_runs_from_the_lab_folder_into_the_jobs_output(tmp_path, capsys):
    import papermill as pm

    before = (ROOT / "notebooks" / STEP_NOTEBOOKS[0]).read_bytes()
    out = tmp_path / "out"
    assert main(["lab", str(TINY), "--out", str(out), "--prepare-only"]) == 0
    folder = out / "tiny" / "lab"
    nb = folder / STEP_NOTEBOOKS[0]
    # as JupyterLab runs it: the kernel in the lab folder, the notebook saved in place
    pm.execute_notebook(str(nb), str(nb), cwd=str(folder), kernel_name="python3", progress_bar=False)
    result = json.loads((out / "tiny" / STEPS[0].folder / "result.json").read_text())
    assert result["metrics"]["mfu"]["value"] > 0 and result["job"]["out_dir"] == str(out)
    assert (out / "tiny" / "index.html").is_file()
    assert not (folder / STEPS[0].folder).exists() and not (folder / "outputs").exists()  # nothing under the lab
    assert (ROOT / "notebooks" / STEP_NOTEBOOKS[0]).read_bytes() == before
