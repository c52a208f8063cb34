import dataclasses
import math

import pytest
import torch

from mfu_lab.core.engine.workload import GPT, SyntheticTokens, build_loader, build_model, build_train_step
from mfu_lab.core.errors import StepError

SPEC = "tests.fixtures.tiny_models:"


def test_synthetic_data_is_seeded_and_shifted():
    ds = SyntheticTokens(4, 8, 50, seed=3)
    x, y = ds[2]
    x2, y2 = SyntheticTokens(4, 8, 50, seed=3)[2]
    assert torch.equal(x, x2) and torch.equal(x[1:], y[:-1])
    assert not torch.equal(ds[1][0], x)


def test_loader_with_workers_yields_the_same_batches(tiny_job):
    a = [x for x, _ in build_loader(tiny_job, 3, "cpu")]
    b = [x for x, _ in build_loader(dataclasses.replace(tiny_job, num_workers=2), 3, "cpu")]
    assert len(a) == 3 and all(torch.equal(p, q) for p, q in zip(a, b))
    assert a[0].shape == (tiny_job.micro_batch, tiny_job.seq_len)


def test_reference_model_starts_near_uniform_loss_and_learns(tiny_job):
    model = build_model(tiny_job)
    step = build_train_step(tiny_job, model, "cpu")
    x, y = next(iter(build_loader(tiny_job, 1, "cpu")))
    first = step(x, y).item()
    assert first == pytest.approx(math.log(tiny_job.vocab_size), rel=0.05)
    for _ in range(5):
        last = step(x, y).item()
    assert last < first


def test_attention_implementations_agree():
    torch.manual_seed(0)
    m = GPT(2, 2, 32, 64, 16, "sdpa").eval()
    x = torch.randint(64, (2, 16))
    a = m(x)
    m.set_attention("unfused")
    assert torch.allclose(a, m(x), atol=1e-5)


@pytest.mark.parametrize("name", ["bigram", "hf_style"])
def test_user_models_train(tiny_job, name):
    job = dataclasses.replace(tiny_job, model=SPEC + name, model_kwargs={"vocab_size": 128})
    model = build_model(job)
    x, y = next(iter(build_loader(job, 1, "cpu")))
    assert build_train_step(job, model, "cpu")(x, y).item() > 0


@pytest.mark.parametrize("spec,kwargs,expected", [
    ("no_such_module_xyz:f", {}, "no module no_such_module_xyz beside the job file"),
    (SPEC + "missing", {}, "has no function 'missing'"),
    (SPEC + "not_a_module", {}, "returned str"),
])
def test_bad_user_models_are_explained(tiny_job, spec, kwargs, expected):
    with pytest.raises(StepError, match=expected):
        build_model(dataclasses.replace(tiny_job, model=spec, model_kwargs=kwargs))


def test_wrong_vocabulary_or_output_is_explained(tiny_job):
    job = dataclasses.replace(tiny_job, model=SPEC + "bigram", model_kwargs={"vocab_size": 64})
    x, y = next(iter(build_loader(dataclasses.replace(job, vocab_size=64), 1, "cpu")))
    with pytest.raises(StepError, match="vocab_size=128"):
        build_train_step(job, build_model(job), "cpu")(x, y)
    job = dataclasses.replace(tiny_job, model=SPEC + "wrong_output", model_kwargs={})
    with pytest.raises(StepError, match=".logits"):
        build_train_step(job, build_model(job), "cpu")(x, y)


@pytest.mark.parametrize("impl, flag", [("fused", "fused"), ("foreach", "foreach")])
def test_adamw_impl_builds_that_optimizer_and_trains(tiny_job, impl, flag):
    import dataclasses

    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step

    job = dataclasses.replace(tiny_job, adamw_impl=impl)
    model = build_model(job)
    ts = build_train_step(job, model, "cpu")
    assert ts.optimizer.defaults[flag] is True
    x, y = next(iter(build_loader(dataclasses.replace(job, num_workers=0), 1, "cpu")))
    before = [p.detach().clone() for p in model.parameters()]
    assert float(ts(x, y)) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
