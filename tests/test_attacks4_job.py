"""Issue 48, the fourth round of attacks on the job: compile options that name a program (High 2), more CPU ranks than
the cores and memory hold (Medium 7), a memory check blind to the cgroup (Medium 8), and small ones (Low 16: base-60
numbers, an out_dir with a newline, a seq_len that runs for hours on a CPU)."""

import dataclasses
from pathlib import Path

import pytest

from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job, validate
from mfu_lab.core.measure import host
from tests.conftest import TINY, in_process

GIB = 2 ** 30


def job_file(tmp_path: Path, extra: str, name: str = "job.yaml") -> Path:
    """The tiny job with ``extra`` lines, writing into tmp_path."""
    p = tmp_path / name
    p.write_text(TINY.read_text() + f"out_dir: {tmp_path / 'out'}\n" + extra)
    return p


def cgroup_v2(root: Path, limit: str, current: int, cpu: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{current}\n")
    if cpu is not None:
        (root / "cpu.max").write_text(cpu + "\n")
    return root


def meminfo(path: Path, available_kib: int) -> Path:
    path.write_text(f"MemTotal:       {2 * available_kib} kB\nMemFree:        1 kB\n"
                    f"MemAvailable:   {available_kib} kB\n")
    return path


# ------------------------------------------------------------------ High 2: compile_options runs a program
def test_compile_options_naming_a_compiler_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    cc = tmp_path / "cc.sh"
    cc.write_text(f"#!/bin/sh\ntouch {marker}\nexec c++ \"$@\"\n")
    cc.chmod(0o755)
    job = job_file(tmp_path, f'compile_mode: options\ncompile_options: {{"cpp.cxx": {cc}}}\n')
    for args in (["validate", job], ["step", "baseline", "--job", job]):
        p = in_process(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert str(job) in p.stderr and "compile_options" in p.stderr and "cpp.cxx" in p.stderr
        assert "allowed: max_autotune" in p.stderr and "triton.cudagraphs" in p.stderr  # the names allowed
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("options,said", [
    ({"max_autotune": "/bin/sh"}, "must be true or false"),
    ({"max_autotune_gemm_backends": "ATEN,os.system"}, "comma-separated list of ATEN"),
    ({"cpp.threads": 10 ** 9}, "whole number from -1 to 1024"),
    ({"trace.debug_dir": "/tmp/x"}, "not an inductor option a job may give"),
    ({"post_grad_custom_post_pass": "pkg.mod:fn"}, "not an inductor option a job may give"),
])
def test_compile_options_take_numbers_booleans_or_words_only(tmp_path, options, said):
    with pytest.raises(JobError) as e:
        validate({"compile_options": options}, "job.yaml")
    (problem,) = e.value.problems
    assert problem.key == "compile_options" and said in problem.expected and next(iter(options)) in problem.expected


def test_validate_lists_the_compile_options_in_force(tmp_path):
    job = job_file(tmp_path, "compile_mode: options\ncompile_options: {max_autotune: true, "
                             "coordinate_descent_tuning: true, max_autotune_gemm_backends: ATEN}\n")
    p = in_process("validate", job)
    assert p.returncode == 0, p.stderr
    assert ("compile options in force (the job trains with them; inductor options from the allowed list): "
            "max_autotune=True, coordinate_descent_tuning=True, max_autotune_gemm_backends='ATEN'") in p.stdout


def test_the_engine_refuses_options_off_the_list_in_a_job_built_by_hand(tiny_job):
    from mfu_lab.core.engine.workload import build_model, build_train_step, compile_kwargs

    assert compile_kwargs("options", "inductor", "auto", {"max_autotune": True})["options"] == {"max_autotune": True}
    job = dataclasses.replace(tiny_job, compile_mode="options", compile_options={"cpp.cxx": "/tmp/cc.sh"})
    with pytest.raises(JobError, match="compile_options.*cpp.cxx.*allowed: max_autotune"):
        build_train_step(job, build_model(job), "cpu")


def test_every_allowed_option_is_one_of_torchs_inductor_knobs():
    import torch._inductor.config as inductor

    from mfu_lab.core.job.compile_options import BOOL, INDUCTOR_OPTIONS

    knobs = inductor.get_config_copy()
    for name, kind in INDUCTOR_OPTIONS.items():
        assert name in knobs, name
        default = knobs[name]
        if kind == BOOL:
            assert isinstance(default, bool) or default is None, name
        elif kind[0] == "int":
            assert default is None or (isinstance(default, int) and not isinstance(default, bool)), name
        else:
            assert isinstance(default, str), name


# ------------------------------------------------------------------ Medium 7: 64 CPU ranks on 2 cores
def test_more_cpu_ranks_than_four_a_core_are_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "CGROUP_ROOT", cgroup_v2(tmp_path / "cg", "max", 0, cpu="200000 100000"))  # 2 cores
    job = job_file(tmp_path, "")
    p = in_process("validate", job, "-p", "nproc_per_node=64")
    assert p.returncode == 2, p.stdout
    assert "nproc_per_node" in p.stderr and "must be at most 8 CPU ranks" in p.stderr and "cpu.max" in p.stderr
    assert "command line (-p KEY=VALUE)" in p.stderr
    from mfu_lab.workers.launch import world_layout

    with pytest.raises(JobError, match="nproc_per_node.*at most 8"):  # every launch checks the same
        world_layout(dataclasses.replace(load_job(job), nproc_per_node=64), "cpu")
    assert world_layout(dataclasses.replace(load_job(job), nproc_per_node=4), "cpu") == (1, 4)  # the tests' 4 on 2


def test_cpu_ranks_beyond_the_cgroups_memory_are_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "CGROUP_ROOT", cgroup_v2(tmp_path / "cg", str(GIB), 0, cpu="max 100000"))
    monkeypatch.setattr(host, "MEMINFO", meminfo(tmp_path / "meminfo", 64 * 2 ** 20))  # the machine: 64 GiB free
    job = job_file(tmp_path, "")
    p = in_process("validate", job, "-p", "nproc_per_node=4")
    assert p.returncode == 2, p.stdout
    assert "nproc_per_node" in p.stderr and "4 CPU ranks need about" in p.stderr
    assert "memory.max" in p.stderr and "use nproc_per_node: 3 or fewer" in p.stderr
    assert in_process("validate", job, "-p", "nproc_per_node=2").returncode == 0


# ------------------------------------------------------------------ Medium 8: the memory check and the cgroup
def test_available_memory_is_the_cgroup_v2_limit_when_lower(tmp_path):
    info = meminfo(tmp_path / "meminfo", 24 * 2 ** 20)  # 24 GiB available on the machine
    root = cgroup_v2(tmp_path / "v2", str(GIB), 256 * 2 ** 20)
    got = host.available_memory(root, info)
    assert got.bytes == GIB - 256 * 2 ** 20 and got.cgroup_limit == GIB
    assert "memory.max" in got.how and "0.75 GiB left of its 1.00 GiB limit" in got.how
    (root / "memory.max").write_text("max\n")  # no limit: the machine's
    assert host.available_memory(root, info).bytes == 24 * GIB


def test_available_memory_is_the_cgroup_v1_limit_when_lower(tmp_path):
    info = meminfo(tmp_path / "meminfo", 24 * 2 ** 20)
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {GIB // 2}\n")  # droppable cache: not used
    got = host.available_memory(tmp_path / "v1", info)
    assert got.bytes == 1.5 * GIB and "memory.limit_in_bytes" in got.how
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host.available_memory(tmp_path / "v1", info).bytes == 24 * GIB


def test_the_fit_check_counts_the_cgroup(tmp_path, monkeypatch, tiny_job):
    from mfu_lab.steps import fit

    monkeypatch.setattr(host, "CGROUP_ROOT", cgroup_v2(tmp_path / "cg", str(GIB), 0))
    monkeypatch.setattr(host, "MEMINFO", meminfo(tmp_path / "meminfo", 23 * 2 ** 20))
    per_rank, how = fit.available_bytes("cpu", 2)
    assert per_rank == GIB / 2 and "cgroup" in how and "shared by 2 rank(s)" in how
    assert fit.check_fit(tiny_job, "cpu", 1)["available_per_rank"] == GIB


# ------------------------------------------------------------------ Low 16: small ones
def test_a_base_60_number_is_refused_not_read_as_90(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text(TINY.read_text().replace("steps: 4\n", "steps: 1:30\n"))
    p = in_process("validate", job)
    assert p.returncode == 2, p.stdout
    assert "key 'steps' = '1:30'" in p.stderr and "base 60" in p.stderr and str(job) in p.stderr
    p = in_process("validate", TINY, "-p", "steps=1:30")  # -p reads values the same way
    assert p.returncode == 2 and "key 'steps' = '1:30'" in p.stderr


def test_an_out_dir_with_a_newline_is_refused(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text(TINY.read_text() + f'out_dir: "{tmp_path}/a\\nb"\n')
    p = in_process("validate", job)
    assert p.returncode == 2, p.stdout
    assert "key 'out_dir'" in p.stderr and "newline" in p.stderr and str(job) in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["j.yaml"]  # no folder made


def test_a_long_cpu_run_is_said_up_front_with_its_estimate(tmp_path):
    from mfu_lab import runner

    job = job_file(tmp_path, "")
    p = in_process("validate", job, "-p", "seq_len=100000", "-p", "steps=100")
    assert p.returncode == 0, p.stderr  # accepted: time is never a reason to refuse
    assert "warning: step 1's training alone is estimated at" in p.stdout and "seq_len 100000" in p.stdout
    assert "estimated at" not in in_process("validate", job).stdout  # the tiny job: nothing said
    said = []
    runner.start_checks(load_job(job, {"seq_len": 100000, "steps": 100}), str(job), ["baseline"], say=said.append)
    assert any("estimated at" in line for line in said)


def test_a_seq_len_memory_cannot_hold_is_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "CGROUP_ROOT", cgroup_v2(tmp_path / "cg", str(GIB), 0))
    p = in_process("validate", job_file(tmp_path, ""), "-p", "seq_len=100000")  # ~1.6 GiB of activations
    assert p.returncode == 2, p.stdout
    assert "key 'seq_len' = 100000" in p.stderr and "does not fit" in p.stderr and "cgroup" in p.stderr

