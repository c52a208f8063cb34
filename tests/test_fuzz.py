"""Property-based tests: random and malformed job files, cluster files and command-line values.

Each must either be accepted (and then name an output folder inside the chosen one) or be refused with a
clear error naming the file and key, never crash with another exception, never run code from the file,
and never write anything outside the chosen folder.
"""

import os
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mfu_lab.analysis.placement.cluster_files import _SPEC, load_cluster  # noqa: E402
from mfu_lab.cli import main  # noqa: E402
from mfu_lab.core.errors import JobError  # noqa: E402
from mfu_lab.core.job.schema import FIELDS, JOB_NAME_RE, load_job  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

nasty_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["../../etc/passwd", "/tmp/x", "a/b", "a\\b", "..", ".", "", " ", "ジョブ", "naïve", "a\x00b",
                     "<script>alert(1)</script>", "${HOME}", "$(touch pwned)", "x" * 300, "con", "nul"]),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 62, max_value=2 ** 80),
    st.integers(max_value=-1), st.floats(allow_nan=True, allow_infinity=True), nasty_text)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
job_keys = st.one_of(st.sampled_from(sorted(FIELDS)), nasty_text)
cluster_keys = st.one_of(st.sampled_from(sorted(_SPEC)), nasty_text)


def _dump(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def _exit_code(args: list[str]) -> int:
    """mfu-lab's exit code, including argparse's own refusals (which exit 2 with a usage line)."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


def _files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@SETTINGS
@given(data=st.dictionaries(job_keys, values, max_size=6))
def test_any_job_mapping_is_accepted_inside_the_output_folder_or_refused_clearly(tmp_path, data):
    import shutil

    shutil.rmtree(tmp_path / "out", ignore_errors=True)  # hypothesis reuses tmp_path across examples
    path = tmp_path / "job.yaml"
    path.write_text(_dump(data), encoding="utf-8")
    try:
        job = load_job(path, {"out_dir": str(tmp_path / "out")})
        job.output_root().mkdir(parents=True)  # a name the file system takes
    except JobError as e:
        text = str(e)
        assert str(path) in text
        for p in e.problems:
            assert p.key is not None and p.expected, p
        return
    assert JOB_NAME_RE.match(job.job_name)
    root = job.output_root().resolve()
    assert root.parent == (tmp_path / "out").resolve()  # the job's folder is directly inside the chosen one
    assert _files_under(tmp_path) - {"job.yaml"} == {"out", f"out/{job.job_name}"}  # nothing else written


@SETTINGS
@given(text=st.text(max_size=200))
def test_any_text_as_a_job_file_is_a_job_or_a_clear_error(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_job(path)
    except JobError as e:
        assert str(path) in str(e)


@SETTINGS
@given(data=st.dictionaries(cluster_keys, values, max_size=8))
def test_any_cluster_mapping_is_a_cluster_or_a_clear_error(tmp_path, data):
    path = tmp_path / "cluster.yaml"
    path.write_text(_dump(data), encoding="utf-8")
    try:
        load_cluster(path)
    except JobError as e:  # ClusterError is a JobError
        assert str(path) in str(e)
        for p in e.problems:
            assert p.key is not None and p.expected, p


@pytest.mark.parametrize("tag", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    "!!python/name:os.system",
    "!!binary aGVsbG8=",
    "!custom_tag 1",
])
@pytest.mark.parametrize("loader", ["job", "cluster"])
def test_yaml_tags_cannot_build_python_objects(tmp_path, tag, loader):
    marker = tmp_path / "pwned"
    path = tmp_path / "file.yaml"
    path.write_text(f"job_name: x\nmicro_batch: {tag.format(marker=marker)}\n" if loader == "job"
                    else f"gpu: {tag.format(marker=marker)}\n")
    with pytest.raises(JobError) as e:
        load_job(path) if loader == "job" else load_cluster(path)
    assert str(path) in str(e.value)
    assert not marker.exists()


@SETTINGS
@given(pairs=st.lists(st.text(max_size=30), min_size=1, max_size=3), steps=st.one_of(st.none(), nasty_text))
def test_command_line_values_are_checked_before_any_work_and_write_nothing(tmp_path, pairs, steps):
    """``mfu-lab validate`` with random -p values, and ``mfu-lab run`` with a random --steps: exit 0 or 2, never
    a traceback, and no file appears anywhere in the folder it ran from."""
    job = tmp_path / "job.yaml"
    job.write_text("job_name: fuzz\nmicro_batch: 0\n")  # invalid on purpose: run must stop before any step
    before = _files_under(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        args = ["validate", str(job)] + [x for p in pairs for x in ("-p", p)]
        assert _exit_code(args) == 2
        run = ["run", str(job), "--out", str(tmp_path / "out")] + (["--steps", steps] if steps is not None else [])
        assert _exit_code(run) == 2
    finally:
        os.chdir(cwd)
    assert _files_under(tmp_path) == before


@pytest.mark.parametrize("key", ["micro_batch", "steps", "d_model", "seed"])
def test_huge_numbers_are_refused_by_name(tmp_path, key):
    path = tmp_path / "job.yaml"
    path.write_text(f"{key}: {2 ** 70}\n")
    with pytest.raises(JobError, match=f"key '{key}' = {2 ** 70}: must be below 2\\*\\*53"):
        load_job(path)


def test_a_job_name_cannot_leave_the_output_folder(tmp_path):
    for name in ("../escape", "a/b", "/abs", "..", "a\\b", ".hidden", "x" * 65, "tab\there"):
        path = tmp_path / "job.yaml"
        path.write_text(_dump({"job_name": name}))
        with pytest.raises(JobError, match="job_name"):
            load_job(path)
