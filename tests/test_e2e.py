"""End to end: the real notebook executed by papermill and by ``mfu-lab run`` on a tiny CPU job."""

import json
import re
import subprocess
import sys

import pytest

from .conftest import ROOT, TINY, in_process

pytestmark = pytest.mark.e2e
EXTERNAL = re.compile(r"""<(script|link|img|iframe)[^>]+(src|href)=["']?(https?:)?//""", re.IGNORECASE)


def run(*args, **kw):
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)


def assert_offline(html: str):
    assert not EXTERNAL.search(html), EXTERNAL.search(html).group(0)


def test_mfu_lab_run_builds_result_notebook_report_and_index(full_run):
    """Read from the session's full run (``mfu-lab run`` of every step): step 1's files and the summary page."""
    p, root = full_run
    assert p.returncode == 0, p.stderr
    step = root / "01_baseline"
    result = json.loads((step / "result.json").read_text())
    assert result["metrics"]["mfu"]["value"] > 0
    nb = json.loads((step / "01_baseline.ipynb").read_text())
    assert nb["metadata"]["papermill"]["parameters"]["job_name"] == "tiny"
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # step-time plot and waterfall
    assert not [o for o in outputs if o.get("output_type") == "error"]
    report = (step / "report.html").read_text()
    assert "MFU ledger" in report and "data:image/png;base64" in report
    assert_offline(report)
    index = (root / "index.html").read_text()
    assert 'href="01_baseline/report.html"' in index
    assert_offline(index)
    assert not (root / ".kernels").exists()  # the kernels' connection files went with them


def test_papermill_with_the_same_yaml_and_a_single_value_override(tmp_path):
    out = tmp_path / "out.ipynb"
    p = run(sys.executable, "-m", "papermill", "notebooks/01_baseline.ipynb", str(out), "-f", str(TINY),
            "-p", "out_dir", str(tmp_path), "-p", "micro_batch", "2")
    assert p.returncode == 0, p.stderr
    result = json.loads((tmp_path / "tiny" / "01_baseline" / "result.json").read_text())
    assert result["job"]["micro_batch"] == 2
    assert result["metrics"]["tokens_per_s"]["value"] > 0


def test_papermill_with_a_misspelt_parameter_fails_in_the_job_cell(tmp_path):
    out = tmp_path / "out.ipynb"
    p = run(sys.executable, "-m", "papermill", "notebooks/01_baseline.ipynb", str(out), "-f", str(TINY),
            "-p", "out_dir", str(tmp_path), "-p", "micro_bacth", "2")
    assert p.returncode != 0
    assert "micro_bacth" in p.stderr and "did you mean 'micro_batch'" in p.stderr
    assert not (tmp_path / "tiny").exists()  # nothing measured, nothing written


def test_a_failing_step_exits_1_keeps_the_notebook_and_marks_the_index(tmp_path):
    job = tmp_path / "broken.yaml"
    job.write_text(TINY.read_text() + "model: tests.fixtures.tiny_models:broken\nmodel_kwargs: {}\n"
                   f"factory_paths: [{ROOT}]\n")  # the factory lies in the checkout, not beside this job file
    p = in_process("run", str(job), "--out", str(tmp_path), "-q")
    assert p.returncode == 1
    assert "deliberate failure inside the user's model" in p.stderr
    step = tmp_path / "tiny" / "01_baseline"
    failure = json.loads((step / "failure.json").read_text())
    assert "RuntimeError" in failure["error"]
    nb = json.loads((step / "01_baseline.ipynb").read_text())
    assert any(o.get("output_type") == "error" for c in nb["cells"] for o in c.get("outputs", []))
    assert (step / "report.html").is_file()
    assert "failed" in (tmp_path / "tiny" / "index.html").read_text()
