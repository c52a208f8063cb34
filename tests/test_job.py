import ast
import dataclasses
import json

import pytest
import yaml

from mfu_lab.core.errors import JobError
from mfu_lab.core.job.notebook import from_namespace
from mfu_lab.core.job.schema import FIELDS, Job, load_job, validate

from .conftest import ROOT


def write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_default_yaml_is_the_embedded_default_job():
    """Every key at Job()'s default but the demo's budget, which keeps the README's first command within 5 minutes
    (a job file without budget_min has no budget)."""
    assert load_job(ROOT / "parameters" / "default.yaml") == dataclasses.replace(Job(), budget_min=4.5)
    assert Job().budget_min == 0
    data = yaml.safe_load((ROOT / "parameters" / "default.yaml").read_text())
    assert list(data) == list(FIELDS)  # every key spelled out, in declaration order


def test_every_notebook_parameters_cell_matches_the_job_keys_and_defaults():
    from mfu_lab.core.registry import STEPS

    notebooks = [ROOT / "notebooks" / info.notebook for info in STEPS]  # 00_monitor reads a folder, not a job
    for path in notebooks:  # tools/sync_parameters.py rewrites them
        nb = json.loads(path.read_text())
        cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
        values = {}
        for node in ast.parse("".join(cell["source"])).body:
            assert isinstance(node, ast.AnnAssign), "the parameters cell holds typed literals only"
            values[node.target.id] = ast.literal_eval(node.value)
        assert values == Job().to_dict(), path


def test_every_shipped_job_file_is_valid():
    # own_data.yaml reads examples/data/train.bin, which the README has the user write first (and
    # examples/hf_batches.py writes on first use): written the same way here when missing, so this test holds
    # whichever test runs first, on whichever worker
    from examples.make_train_bin import ensure

    ensure(ROOT / "examples" / "data" / "train.bin")
    files = sorted((ROOT / "parameters").glob("*.yaml"))
    assert len(files) >= 2
    for f in files:
        load_job(f)


def test_unknown_key_names_file_key_and_suggests(tmp_path):
    p = write(tmp_path, "micro_bacth: 4\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    msg = str(e.value)
    assert str(p) in msg and "micro_bacth" in msg and "did you mean 'micro_batch'" in msg
    assert "allowed keys" in msg


@pytest.mark.parametrize("text,key,expected", [
    ("micro_batch: four\n", "micro_batch", "whole number"),
    ("micro_batch: 2.5\n", "micro_batch", "whole number"),
    ("micro_batch: true\n", "micro_batch", "whole number"),
    ("micro_batch: 0\n", "micro_batch", ">= 1"),
    ("steps: 1\n", "steps", ">= 2"),
    ("dtype: fp8\n", "dtype", "one of float32, bfloat16, float16"),
    ("device: tpu\n", "device", "one of auto, cpu, cuda"),
    ("attention: flash\n", "attention", "one of sdpa, unfused"),
    ("job_name: ../escape\n", "job_name", "no path separators"),
    ("job_name: a/b\n", "job_name", "no path separators"),
    ("model: 'os.system'\n", "model", "package.module:function"),
    ("lr: 0\n", "lr", "> 0"),
    ("peak_flops: -1.0\n", "peak_flops", "> 0"),
    ("peak_flops: {float32: 6.7e13, fp8: 1.9e15}\n", "peak_flops", "one of float32, bfloat16, float16"),
    ("peak_flops: {bfloat16: .inf}\n", "peak_flops", "finite number > 0"),
    ("peak_flops: {bfloat16: 0}\n", "peak_flops", "finite number > 0"),
    ("peak_flops: fast\n", "peak_flops", "mapping of dtypes"),
    ("pin_memory: yes please\n", "pin_memory", "true or false"),
    ("model_kwargs: [1, 2]\n", "model_kwargs", "mapping"),
    ("n_heads: 3\n", "n_heads", "divide d_model"),
    ("seq_len: .nan\n", "seq_len", "whole number"),
    ("lr: .inf\n", "lr", "finite"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(tmp_path, text, key, expected):
    p = write(tmp_path, text)
    with pytest.raises(JobError) as e:
        load_job(p)
    msg = str(e.value)
    assert f"key '{key}'" in msg and expected in msg and str(p) in msg


def test_all_problems_are_reported_at_once(tmp_path):
    p = write(tmp_path, "micro_batch: 0\ndtype: fp8\nbogus: 1\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    assert {pr.key for pr in e.value.problems} == {"micro_batch", "dtype", "bogus"}


def test_yaml_that_tries_to_build_python_objects_is_refused(tmp_path):
    p = write(tmp_path, "job_name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(p)


@pytest.mark.parametrize("text,expected", [("- a\n- b\n", "mapping"), ("a: [\n", "not valid YAML")])
def test_file_level_problems(tmp_path, text, expected):
    with pytest.raises(JobError, match=expected):
        load_job(write(tmp_path, text))
    with pytest.raises(JobError, match="no such job file"):
        load_job(tmp_path / "missing.yaml")


def test_numbers_yaml_reads_as_text_are_accepted_for_float_keys(tmp_path):
    # YAML 1.1 reads 989e12 (no dot) as a string; a peak is naturally written that way
    assert load_job(write(tmp_path, "peak_flops: 989e12\n")).peak_flops == 989e12
    assert load_job(write(tmp_path, "lr: 1\n")).lr == 1.0


def test_an_empty_file_is_refused_not_the_default_job(tmp_path):
    """Issue 32, item 14 (was: an empty file is the default job): a file that sets nothing is refused with its
    path; the default job is `mfu-lab run` with no file (tests/test_attacks.py)."""
    with pytest.raises(JobError, match="sets no key"):
        load_job(write(tmp_path, ""))


def test_overrides_win_over_the_file(tmp_path):
    job = load_job(write(tmp_path, "micro_batch: 4\n"), {"micro_batch": 2})
    assert job.micro_batch == 2


def test_notebook_namespace_catches_misspelt_injected_parameters():
    before = {"__name__", "from_namespace"}
    ns = dict.fromkeys(before) | Job().to_dict() | {"micro_bacth": 4, "_private": 1, "helper": print}
    with pytest.raises(JobError, match="micro_bacth"):
        from_namespace(ns, before)
    del ns["micro_bacth"]
    assert from_namespace(ns, before) == Job()


def test_output_root_is_relative_to_the_workbook_root(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")  # as JupyterLab runs a notebook
    assert Job().output_root() == ROOT / "outputs" / "default"
    monkeypatch.chdir(tmp_path)  # outside the checkout: relative to the current folder
    assert Job().output_root() == tmp_path / "outputs" / "default"
    assert validate({"out_dir": str(tmp_path / "x")}, "t").output_root() == tmp_path / "x" / "default"


def test_cross_key_checks_are_reported_with_the_other_problems(tmp_path):
    p = write(tmp_path, "micro_bacth: 4\nnnodes: 2\nn_heads: 3\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    assert {pr.key for pr in e.value.problems} == {"micro_bacth", "rdzv_endpoint", "n_heads"}


def test_papermill_sees_every_key_in_every_notebook():
    import papermill

    from mfu_lab.core.job.schema import FIELDS
    from mfu_lab.core.registry import STEPS

    for nb in [ROOT / "notebooks" / info.notebook for info in STEPS]:
        found = papermill.inspect_notebook(str(nb))
        assert list(found) == list(FIELDS), f"{nb.name}: papermill reads {sorted(set(FIELDS) - set(found))} wrong"
