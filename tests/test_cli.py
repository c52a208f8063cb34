import json

from mfu_lab.cli import main

from .conftest import TINY


def test_validate_reports_bad_file_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("micro_batch: -3\ndtype: fp4\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "key 'micro_batch' = -3" in err and "key 'dtype' = 'fp4'" in err


def test_validate_prints_the_resolved_job(capsys):
    assert main(["validate", str(TINY), "-p", "micro_batch=2"]) == 0
    assert "micro_batch: 2" in capsys.readouterr().out


def test_validate_checks_the_layout_against_this_machines_world(capsys):
    """On a CPU, nproc_per_node 0 is 2 ranks: tp 2 fits, tp 2 x pp 2 does not (tiny.yaml: 2 heads, 2 layers)."""
    assert main(["validate", str(TINY), "-p", "tp=2", "-p", "sp=true"]) == 0
    assert "layout over 2 CPU ranks: ddp 1 x tp 2 + sp x pp 1" in capsys.readouterr().out
    assert main(["validate", str(TINY), "-p", "dp_mode=fsdp"]) == 0
    assert "layout over 2 CPU ranks: fsdp 2 x tp 1 x pp 1" in capsys.readouterr().out
    assert main(["validate", str(TINY), "-p", "tp=2", "-p", "pp=2"]) == 2
    err = capsys.readouterr().err
    assert f"{TINY} and the command line (-p KEY=VALUE)" in err
    assert "key 'tp' = 2: tp x pp (2 x 2 = 4) must divide the world of 2 ranks (nproc_per_node 0: 2 on CPU" in err
    assert main(["validate", str(TINY), "-p", "tp=2", "-p", "pp=2", "-p", "nproc_per_node=4"]) == 0
    assert "layout over 4 CPU ranks: ddp 1 x tp 2 x pp 2" in capsys.readouterr().out
    assert main(["validate", str(TINY)]) == 0
    assert "layout" not in capsys.readouterr().out.splitlines()[0]  # plain DDP: today's line


def test_validate_checks_the_fp8_groups_of_the_reference_model_and_says_a_factorys_wait(tmp_path, capsys):
    """A misspelt group would train without FP8 on every device, and step 1 is the first to say so today; validate
    counts the reference GPT's groups on a meta-device model (step 5's names) and names key, group and groups."""
    assert main(["validate", str(TINY), "-p", "fp8_layers=[attn_qkv,mlp_fc]"]) == 2
    err = capsys.readouterr().err
    assert f"{TINY} and the command line (-p KEY=VALUE)" in err
    assert ("key 'fp8_layers' = ['attn_qkv', 'mlp_fc']: unknown layer group(s) mlp_fc; this model's groups: "
            "attn_qkv, attn_out, mlp_up, mlp_down, lm_head") in err
    assert main(["validate", str(TINY), "-p", "fp8_policies={big: [lm_head, mlp]}"]) == 2
    assert "key 'fp8_policies' = ['lm_head', 'mlp']: policy big: unknown layer group(s) mlp;" in capsys.readouterr().err
    assert main(["validate", str(TINY), "-p", "fp8_layers=[mlp_up,lm_head]"]) == 0
    assert "fp8_layers:\n- mlp_up\n- lm_head" in capsys.readouterr().out
    # under tensor parallel: the shards a GPU's torch._scaled_mm would refuse, which then train in high precision
    assert main(["validate", str(TINY), "-p", "tp=4", "-p", "n_heads=4", "-p", "nproc_per_node=4",
                 "-p", "fp8_layers=[attn_qkv,mlp_up]"]) == 0
    said = capsys.readouterr().out
    assert ("fp8_layers at tp 4: 6 Linear(s) stay in high precision, their shard not divisible by 16 "
            "(torch._scaled_mm's alignment on a GPU): blocks.0.attn.q (colwise: out_features 32 / tp 4 = 8)") in said
    assert "mlp.0" not in said.split("fp8_layers at tp 4")[1].split("\n")[0]  # 128 / 4 = 32: it converts
    assert main(["validate", str(TINY), "-p", "tp=2", "-p", "nproc_per_node=2", "-p", "fp8_layers=[attn_qkv]"]) == 0
    assert "stay in high precision" not in capsys.readouterr().out  # 32 / 2 = 16
    (tmp_path / "never_imported.py").write_text("raise SystemExit('validate imported the factory')\n")
    job = tmp_path / "factory.yaml"
    job.write_text("model: never_imported:build\nfp8_layers: [whatever]\n")
    assert main(["validate", str(job)]) == 0
    said = capsys.readouterr().out
    assert "layer groups of model never_imported:build are checked when step 1 or 5 builds it" in said


def test_bad_command_line_values_exit_2(capsys):
    assert main(["run", str(TINY), "--steps", "baseline,nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["validate", str(TINY), "-p", "micro_batch"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["validate", str(TINY), "-p", "micro_batch=lots"]) == 2


def test_keys_lists_every_key(capsys):
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch" in out and "peak_flops" in out


def test_keys_are_listed_under_their_groups_in_declaration_order(capsys):
    from mfu_lab.core.job.schema import FIELDS, KEY_GROUPS

    assert main(["keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    titles = [line.strip("- ") for line in lines if line.startswith("--- ")]
    assert titles == list(KEY_GROUPS.values())
    listed = [line.split()[0] for line in lines if line and not line.startswith((" ", "--- "))]
    assert listed == list(FIELDS)  # every key once, in the order Job declares them
    group, where = None, {}
    for line in lines:
        if line.startswith("--- "):
            group = line.strip("- ")
        elif line and not line.startswith(" "):
            where[line.split()[0]] = (group, line)
    layout = "layout (the job's own: FSDP, TP, SP, PP)"
    for key in ("dp_mode", "fsdp_reshard_after_forward", "fsdp_prefetch", "fsdp_param_dtype", "fsdp_reduce_dtype",
                "tp", "sp", "pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages", "tp_plan"):
        assert where[key][0] == layout, key
        assert FIELDS[key].metadata["help"] in where[key][1], key
    for key in ("cluster_tp", "cluster_pp", "cluster_interleave"):
        assert where[key][0] == "placement (step 6)", key
    assert "interleave" not in where


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`mfu-lab keys | head`: the reader leaves before the command writes; no traceback, no misleading advice."""
    import subprocess
    import sys

    # keys writes more than Python's 8 KB buffer (the error comes inside the command); validate less (at the flush)
    for command in (["keys"], ["validate", str(TINY)]):
        p = subprocess.Popen([sys.executable, "-m", "mfu_lab", *command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        p.stdout.close()  # closed before the child (still importing) writes a line
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141, (command, err)
        assert "Traceback" not in err and "Broken pipe" not in err and "folder" not in err, (command, err)
        assert "Exception ignored" not in err, (command, err)


def test_step_runs_in_plain_python(tmp_path, capsys):
    assert main(["step", "baseline", "--job", str(TINY), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mfu" in out and "[measured]" in out
    result = json.loads((tmp_path / "tiny" / "01_baseline" / "result.json").read_text())
    assert result["metrics"]["mfu"]["value"] > 0
    assert (tmp_path / "tiny" / "index.html").is_file()


def test_report_needs_an_existing_folder(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_check_html_without_playwright_says_what_to_install(tmp_path, monkeypatch, capsys):
    import sys

    from mfu_lab.cli import main

    (tmp_path / "index.html").write_text("<html></html>")
    monkeypatch.setitem(sys.modules, "playwright", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)
    assert main(["check-html", str(tmp_path)]) == 1
    assert "pip install -e '.[test]'" in capsys.readouterr().err
