import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mfu_lab.core.engine.workload import GPT
from mfu_lab.core.measure.flops import count_flops, hardware_flops_per_token, mfu, transformer_flops_per_token


def test_palm_540b_mfu_reproduces_the_paper():
    # PaLM (Chowdhery et al. 2022), table 3 / appendix B: 540.35B parameters, L=118, H=48, Q=256,
    # T=2048, 238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s peak -> 46.2% MFU.
    f = transformer_flops_per_token(540.35e9, 118, 48 * 256, 2048)
    assert mfu(f, 238.3e3, 6144 * 275e12) == pytest.approx(0.462, abs=0.0005)


def test_formula_against_hand_worked_values():
    # 6*1000 + 12*2*4*8 = 6000 + 768
    assert transformer_flops_per_token(1000, 2, 4, 8) == 6768
    # causal halves only the attention term: 6000 + 384
    assert transformer_flops_per_token(1000, 2, 4, 8, convention="causal") == 6384
    # full recompute of 800 block params over 2 layers: + 2*800 + 768/3
    assert hardware_flops_per_token(1000, 2, 4, 8, recomputed_params=800, recomputed_layers=2) == 6768 + 1600 + 256
    assert hardware_flops_per_token(1000, 2, 4, 8) == 6768
    assert mfu(100.0, 10.0, 4000.0) == 0.25


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="convention"):
        transformer_flops_per_token(1, 1, 1, 1, convention="megatron")
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 1.0, 0.0)


def _fwd_bwd(model, batch=2, seq=16, vocab=64):
    x = torch.randint(vocab, (batch, seq))
    return lambda: model(x).sum().backward()


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_counted_and_analytic_flops_agree_for_every_attention(attention, checkpointing):
    torch.manual_seed(0)
    model = GPT(n_layers=2, n_heads=2, d_model=32, vocab_size=64, seq_len=16, attention=attention,
                activation_checkpointing=checkpointing)
    counted = count_flops(_fwd_bwd(model)).total
    n, tokens = model.matmul_params(), 2 * 16
    if checkpointing:
        expected = hardware_flops_per_token(n, 2, 32, 16, model.recomputed_matmul_params(), 2) * tokens
    else:
        expected = transformer_flops_per_token(n, 2, 32, 16) * tokens
    assert counted == pytest.approx(expected, rel=0.02)


def test_cpu_fused_attention_is_counted_where_torch_alone_counts_nothing():
    q = torch.randn(2, 2, 16, 8, requires_grad=True)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    with FlopCounterMode(display=False) as plain:
        run()
    ours = count_flops(run)
    assert plain.get_total_flops() == 0  # torch's registry lacks the CPU flash op (why we register one)
    # forward 2 matmuls of 2*16*16*8 per head, backward 4: 6 * (2*2*16*16*8*2)... counted by hand:
    per_matmul = 2 * (2 * 2) * 16 * 16 * 8
    assert ours.total == 6 * per_matmul


def test_module_docstring_example_runs():
    import doctest

    import mfu_lab.core.measure.flops

    assert doctest.testmod(mfu_lab.core.measure.flops).failed == 0


def test_hfu_counts_the_score_recompute_of_flash_style_attention():
    """FlashAttention's backward recomputes S = QK^T: one of the six attention matmuls, 2*L*d*T per token."""
    from mfu_lab.core.measure.flops import hardware_flops_per_token, transformer_flops_per_token

    n, L, d, T = 1e9, 24, 2048, 4096
    assert hardware_flops_per_token(n, L, d, T, flash_layers=L) - transformer_flops_per_token(n, L, d, T) == \
        pytest.approx(2 * L * d * T)


@pytest.mark.parametrize("attention, flash", [("sdpa", True), ("unfused", False)])
def test_the_counted_step_adds_the_recompute_only_for_a_flash_style_kernel(tiny_job, attention, flash):
    import dataclasses

    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.measure.flops import count_step_flops

    job = dataclasses.replace(tiny_job, attention=attention)
    model = build_model(job)
    x, y = next(iter(build_loader(dataclasses.replace(job, num_workers=0), 1, "cpu")))
    r = count_step_flops(model, build_train_step(job, model, "cpu"), x, y)
    expected = 2 * job.n_layers * job.d_model * job.seq_len * x.numel() if flash else 0.0
    assert r.flash_recompute_flops_per_step == pytest.approx(expected)  # analytic
    assert r.hardware_flops_per_step - r.model_flops_per_step == pytest.approx(expected)
    assert r.counted_hardware_flops_per_step - r.counted_flops_per_step == pytest.approx(expected)  # counted


def test_one_count_per_job_is_shared_and_anything_that_changes_it_changes_the_key(tmp_path, monkeypatch):
    """Issue 20: the steps of one job count FLOPs once (a cache in the job's folder); a different batch shape or
    attention implementation is a different count, and a damaged entry is counted again."""
    import dataclasses as dc

    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.job.schema import load_job
    from mfu_lab.core.measure import flops as fl

    from .conftest import TINY

    job = dc.replace(load_job(TINY), out_dir=str(tmp_path))
    model = build_model(job)
    x, y = next(iter(build_loader(job, 1, "cpu")))
    ts = build_train_step(job, model, "cpu")
    first = fl.count_step_flops(model, ts, x, y, cache_dir=tmp_path)
    calls = []
    monkeypatch.setattr(fl, "count_flops", lambda fn: calls.append(fn) or pytest.fail("counted again"))
    assert fl.count_step_flops(model, ts, x, y, cache_dir=tmp_path) == first and not calls
    key = fl.count_key(model, ts, x, y)
    assert fl.count_key(model, ts, x[:, :16], y[:, :16]) != key
    model.set_attention(lambda q, k, v: q)
    assert fl.count_key(model, ts, x, y) != key
    monkeypatch.undo()
    model.set_attention("sdpa")
    (tmp_path / ".flops" / f"{key}.json").write_text("{truncated")
    assert fl.count_step_flops(model, ts, x, y, cache_dir=tmp_path) == first


def test_the_count_cache_is_keyed_on_model_kwargs_the_repr_does_not_show(tmp_path):
    """Issue 32, item 4: a factory whose kwargs change the work but not the model's repr gets its own count, through
    a step's own call (steps pass the job's model spec and kwargs as key material)."""
    import dataclasses as dc

    from mfu_lab.core.job.schema import load_job
    from mfu_lab.core.measure import flops as fl
    from mfu_lab.steps.baseline.layout import meta_flops

    from .conftest import TINY

    base = dc.replace(load_job(TINY), out_dir=str(tmp_path), model="tests.fixtures.tiny_models:repeated")
    v = base.vocab_size
    one = dc.replace(base, model_kwargs={"repeats": 1, "vocab_size": v})
    many = dc.replace(base, model_kwargs={"repeats": 16, "vocab_size": v})
    assert fl.job_key_extra(one) != fl.job_key_extra(many)
    sixteen = meta_flops(many, "cpu").counted_flops_per_step  # the 16x model first, as in the report
    single = meta_flops(one, "cpu").counted_flops_per_step  # was served the 16x count before
    assert single < sixteen and len(list((one.output_root() / ".flops").glob("*.json"))) == 2
    assert meta_flops(many, "cpu").counted_flops_per_step == sixteen  # still shared when nothing changed
    assert fl.job_key_extra(dc.replace(base, model_kwargs={"a": 1, "b": 2})) == \
        fl.job_key_extra(dc.replace(base, model_kwargs={"b": 2, "a": 1}))
