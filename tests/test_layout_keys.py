"""The job's own layout keys (issue 28, item 1): their refusals, the old names' hints, and the checks against the
world and a factory model built on the meta device. No process is launched; about 15 s here (transformers' import
is most of it)."""

import pytest

from mfu_lab.core.engine.layout_check import check_layout, dp_degree, model_shape, read_shape
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import Job, load_job, validate

TINY = "tests.fixtures.tiny_models"


def problems(values: dict) -> dict[str, str]:
    """key -> the problem's line, for a job expected to be refused."""
    with pytest.raises(JobError) as e:
        validate(values, "job.yaml")
    return {p.key: str(p) for p in e.value.problems}


def layout_problems(job: Job, world: int, device_type: str = "cpu") -> list[str]:
    with pytest.raises(JobError) as e:
        check_layout(job, world, device_type)
    assert str(e.value).startswith("job layout: ")
    return [str(p) for p in e.value.problems]


# ------------------------------------------------------------------ validate: the keys alone
def test_the_default_layout_is_plain_ddp_and_the_issues_layouts_are_accepted():
    job = Job()
    assert (job.dp_mode, job.tp, job.sp, job.pp, job.pp_virtual_stages, job.tp_plan) == ("ddp", 1, False, 1, 1, {})
    validate({"dp_mode": "fsdp", "fsdp_prefetch": 1, "fsdp_param_dtype": "bfloat16"}, "t")
    validate({"tp": 2, "sp": True}, "t")
    validate({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 4}, "t")
    validate({"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}, "t")
    validate({"model": f"{TINY}:hf_llama", "tp": 2, "tp_plan": {"model.layers.*.self_attn.q_proj": "colwise",
                                                               "model.layers.*.self_attn.o_proj": "rowwise",
                                                               "model.norm": "sequence"}}, "t")


@pytest.mark.parametrize("values,key,words", [
    ({"sp": True}, "sp", ["key 'sp' = True", "needs tp > 1", "tp is 1"]),
    ({"tp": 3}, "tp", ["key 'tp' = 3", "must divide n_heads (4", "4 % 3 = 1"]),
    ({"pp": 3}, "pp", ["key 'pp' = 3", "pp x pp_virtual_stages (3 x 1 = 3)", "n_layers (4)"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 3, "pp_microbatches": 4, "micro_batch": 8},
     "pp", ["key 'pp' = 2", "(2 x 3 = 6)", "n_layers (4)"]),
    ({"pp": 4, "pp_microbatches": 2}, "pp_microbatches", ["key 'pp_microbatches' = 2", "must be >= pp (4)"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 5,
      "micro_batch": 10, "global_batch": 510}, "pp_microbatches",
     ["key 'pp_microbatches' = 5", "interleaved_1f1b", "pp 2", "max(1, pp_microbatches // pp) = 2 rounds",
      "pp_microbatches % 2 == 0", "e.g. 4"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, "pp_virtual_stages",
     ["key 'pp_virtual_stages' = 1", "must be >= 2", "interleaved_1f1b"]),
    ({"pp": 2, "pp_schedule": "gpipe", "pp_virtual_stages": 2}, "pp_virtual_stages",
     ["key 'pp_virtual_stages' = 2", "must be 1", "gpipe", "single-stage"]),
    ({"pp": 2, "pp_virtual_stages": 2}, "pp_virtual_stages", ["key 'pp_virtual_stages' = 2", "1f1b"]),
    ({"pp": 2, "pp_microbatches": 3}, "micro_batch",
     ["key 'micro_batch' = 8", "multiple of pp_microbatches (3)", "pp is 2"]),
    ({"fsdp_prefetch": 2}, "fsdp_prefetch", ["key 'fsdp_prefetch' = 2", "needs dp_mode: fsdp", "dp_mode is ddp"]),
    ({"fsdp_reshard_after_forward": False}, "fsdp_reshard_after_forward", ["= False", "needs dp_mode: fsdp"]),
    ({"fsdp_param_dtype": "bfloat16"}, "fsdp_param_dtype", ["= 'bfloat16'", "needs dp_mode: fsdp"]),
    ({"fsdp_reduce_dtype": "float32"}, "fsdp_reduce_dtype", ["= 'float32'", "needs dp_mode: fsdp"]),
    ({"tp_plan": {"blocks.*.attn": "colwise"}}, "tp_plan", ["key 'tp_plan'", "must be {} when model is gpt",
                                                             "built-in plan"]),
    ({"model": f"{TINY}:blocks", "tp_plan": {"layers.*.mlp": "diagonal"}}, "tp_plan",
     ["item 'layers.*.mlp': 'diagonal'", "one of colwise, rowwise, sequence"]),
    ({"model": f"{TINY}:blocks", "tp_plan": {" ": "colwise"}}, "tp_plan", ["item ' '", "non-empty module-name"]),
    ({"model": f"{TINY}:blocks", "tp_plan": {"layers": 2}}, "tp_plan", ["item 'layers': 2", "one of colwise"]),
])
def test_each_layout_refusal_names_the_keys_and_the_numbers(values, key, words):
    found = problems(values)
    assert key in found, found
    for w in words:
        assert w in found[key], (w, found[key])


def test_layout_refusals_come_with_every_other_problem_at_once(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("sp: true\nfsdp_prefetch: 1\nmicro_bacth: 2\npp: 3\npp_microbatches: 1\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    assert {pr.key for pr in e.value.problems} == {"sp", "pp", "fsdp_prefetch", "micro_bacth", "pp_microbatches"}
    assert str(p) in str(e.value)


def test_a_key_already_refused_is_not_checked_again_across_keys():
    found = problems({"tp": "two", "sp": True})
    assert set(found) == {"tp"} and "whole number" in found["tp"]  # no 'needs tp > 1' from a tp never read


def test_a_factory_models_heads_and_blocks_wait_for_check_layout():
    """n_heads and n_layers describe the reference GPT only: validate does not hold a factory model to them."""
    validate({"model": f"{TINY}:blocks", "tp": 3, "pp": 3}, "t")


# ------------------------------------------------------------------ the old meanings, in one line
@pytest.mark.parametrize("text,key,line", [
    ("tp: 0\n", "tp", "key 'tp' = 0: tp is now the job's own tensor-parallel degree (>= 1); step 6's cluster choice "
                      "is cluster_tp (0: the model picks)"),
    ("pp: 0\n", "pp", "key 'pp' = 0: pp is now the job's own number of pipeline stages (>= 1); step 6's cluster "
                      "choice is cluster_pp (0: the model picks)"),
    ("interleave: 2\n", "interleave", "key 'interleave' = 2: unknown key; did you mean 'cluster_interleave' (step "
                                      "6's interleaved chunks per stage on the cluster, formerly interleave) or "
                                      "'pp_virtual_stages' (the job's own model chunks per pipeline rank)?"),
])
def test_a_job_file_with_the_old_step6_names_is_told_the_new_key(tmp_path, text, key, line):
    p = tmp_path / "old.yaml"
    p.write_text(text)
    with pytest.raises(JobError) as e:
        load_job(p)
    assert [str(pr) for pr in e.value.problems] == [line]
    assert "\n" not in line and str(p) in str(e.value)


def test_a_whole_old_job_file_gets_every_hint_and_no_generic_guess(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("tp: 0\npp: 0\ninterleave: 1\nkeep: [interleave]\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    found = {pr.key: str(pr) for pr in e.value.problems}
    assert set(found) == {"tp", "pp", "interleave", "keep"}
    assert "cluster_tp" in found["tp"] and "cluster_pp" in found["pp"]
    for k in ("interleave", "keep"):
        assert "'cluster_interleave'" in found[k] and "'pp_virtual_stages'" in found[k], found[k]
        assert "allowed keys" not in found[k]
    with pytest.raises(JobError, match="cluster_tp"):  # the command line is told the same
        load_job(tmp_path / "old.yaml", {"tp": 0, "pp": 1, "keep": []})
    assert "cluster_tp" in str(problems({"tp": 0})["tp"])


def test_the_old_meanings_are_only_for_zero():
    assert "must be >= 1" in problems({"tp": -1})["tp"]
    assert validate({"cluster_tp": 0, "cluster_pp": 0, "cluster_interleave": 2}, "t").cluster_interleave == 2


# ------------------------------------------------------------------ check_layout: the world and the model
@pytest.mark.parametrize("world,layout,dp", [
    (2, {"tp": 2}, 1), (2, {"pp": 2}, 1), (2, {"dp_mode": "fsdp"}, 2), (4, {"tp": 2}, 2),
    (4, {"tp": 2, "pp": 2}, 1), (8, {"tp": 2, "pp": 2}, 2), (8, {"tp": 4}, 2), (8, {}, 8),
])
def test_check_layout_accepts_a_layout_that_divides_the_world(world, layout, dp):
    job = validate(layout, "t")
    check_layout(job, world, "cpu")
    assert dp_degree(job, world) == dp


@pytest.mark.parametrize("world,layout,key,words", [
    (2, {"tp": 4}, "tp", ["key 'tp' = 4", "tp x pp (4 x 1 = 4)", "world of 2 ranks", "nproc_per_node 0: 2 on CPU"]),
    (2, {"pp": 4, "n_layers": 8, "nproc_per_node": 2}, "pp",
     ["key 'pp' = 4", "(1 x 4 = 4)", "world of 2 ranks (nproc_per_node 2 x nnodes 1)"]),
    (4, {"tp": 2, "pp": 4, "n_layers": 8}, "tp", ["(2 x 4 = 8)", "world of 4 ranks"]),
    (8, {"tp": 2, "pp": 2, "nproc_per_node": 3, "nnodes": 2, "rdzv_endpoint": "n1:29500"}, "tp",
     ["(2 x 2 = 4)", "world of 6 ranks (nproc_per_node 3 x nnodes 2)"]),
])
def test_check_layout_refuses_a_degree_that_does_not_divide_the_world(world, layout, key, words):
    job = validate(layout, "t")
    world = job.nproc_per_node * job.nnodes if job.nproc_per_node else world
    [line] = layout_problems(job, world)
    assert line.startswith(f"key '{key}'")
    for w in words:
        assert w in line, (w, line)
    with pytest.raises(JobError, match="must divide the world"):
        dp_degree(job, world)


def test_check_layout_says_how_nproc_per_node_0_was_read_on_gpus():
    [line] = layout_problems(validate({"tp": 4}, "t"), 2, "cuda")
    assert "nproc_per_node 0: one per visible GPU; nnodes 1" in line


def test_check_layout_names_the_job_file_when_the_caller_knows_it():
    with pytest.raises(JobError) as e:
        check_layout(validate({"tp": 4}, "t"), 2, "cpu", source="my_job.yaml")
    assert str(e.value).startswith("my_job.yaml: 1 invalid value(s)")


def test_a_hand_built_reference_job_is_checked_for_heads_and_blocks():
    job = Job(tp=3, pp=2, n_layers=3)  # never validated
    lines = layout_problems(job, 6)
    assert any("must divide the heads of gpt (n_heads = 4; 4 % 3 = 1)" in line for line in lines), lines
    assert any("(2 x 1 = 2) must divide the blocks of gpt (n_layers: 3)" in line for line in lines), lines


def test_a_factory_models_heads_and_blocks_are_read_on_the_meta_device():
    shape = model_shape(validate({"model": f"{TINY}:blocks"}, "t"))
    assert shape.heads == {"MultiheadAttention.num_heads": 6} and shape.blocks == 3
    assert shape.blocks_where == "layers: 3 x _Block"
    job = validate({"model": f"{TINY}:blocks", "tp": 2, "pp": 3, "n_heads": 1, "n_layers": 1}, "t")
    check_layout(job, 6, "cpu")  # 6 heads / 2, 3 blocks / 3; the keys n_heads and n_layers are the GPT's
    lines = layout_problems(validate({"model": f"{TINY}:blocks", "tp": 4, "pp": 2}, "t"), 8)
    assert any("key 'tp' = 4: must divide the heads of tests.fixtures.tiny_models:blocks "
               "(MultiheadAttention.num_heads = 6; 6 % 4 = 2)" in line for line in lines), lines
    assert any("key 'pp' = 2: pp x pp_virtual_stages (2 x 1 = 2) must divide the blocks of "
               "tests.fixtures.tiny_models:blocks (layers: 3 x _Block)" in line for line in lines), lines


def test_a_hugging_face_llama_is_read_on_the_meta_device_without_a_download():
    import torch

    from tests.fixtures.tiny_models import hf_llama

    with torch.device("meta"):
        model = hf_llama()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    shape = read_shape(model)
    assert shape.heads == {"config.num_attention_heads": 4, "config.num_key_value_heads": 4}
    assert (shape.blocks, shape.blocks_where) == (2, "model.layers: 2 x LlamaDecoderLayer")
    job = validate({"model": f"{TINY}:hf_llama", "tp": 2, "pp": 2}, "t")
    check_layout(job, 4, "cpu")
    check_layout(job, 8, "cpu")
    assert dp_degree(job, 8) == 2
    lines = layout_problems(validate({"model": f"{TINY}:hf_llama", "tp": 4, "model_kwargs": {"heads": 8,
                                                                                             "kv_heads": 2}}, "t"), 4)
    assert lines == ["key 'tp' = 4: must divide the heads of tests.fixtures.tiny_models:hf_llama "
                     "(config.num_key_value_heads = 2; 2 % 4 = 2): tensor parallel gives each rank whole heads"]
    lines = layout_problems(validate({"model": f"{TINY}:hf_llama", "pp": 2, "pp_virtual_stages": 2,
                                      "pp_schedule": "interleaved_1f1b"}, "t"), 2)
    assert lines == ["key 'pp' = 2: pp x pp_virtual_stages (2 x 2 = 4) must divide the blocks of "
                     "tests.fixtures.tiny_models:hf_llama (model.layers: 2 x LlamaDecoderLayer): each model chunk "
                     "holds whole blocks"]


def test_a_model_without_findable_heads_or_blocks_is_told_so():
    lines = layout_problems(validate({"model": f"{TINY}:bigram", "tp": 2, "pp": 2}, "t"), 4)
    assert len(lines) == 2
    assert "key 'tp' = 2: needs the attention heads of tests.fixtures.tiny_models:bigram, which could not be " \
           "found" in lines[0] and "config.num_attention_heads" in lines[0]
    assert "key 'pp' = 2: needs the repeated blocks of tests.fixtures.tiny_models:bigram" in lines[1]
    check_layout(validate({"model": f"{TINY}:bigram"}, "t"), 2, "cpu")  # tp 1, pp 1: the model is not built


def test_a_factory_that_fails_on_the_meta_device_is_named_with_the_world_problem():
    lines = layout_problems(validate({"model": f"{TINY}:broken_on_meta", "tp": 4}, "t"), 2)
    assert lines[0].startswith("key 'tp' = 4: tp x pp (4 x 1 = 4) must divide the world")
    assert lines[1].startswith("key 'model' = 'tests.fixtures.tiny_models:broken_on_meta': could not be built on "
                               "the meta device") and "RuntimeError" in lines[1]
