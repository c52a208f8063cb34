import math

import pytest
import torch

from mfu_lab.analysis import attention as att

CPU = torch.device("cpu")
SHAPE = (2, 2, 32, 8)


def no_mask(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)  # forgets the causal mask


def wrong_scale(q, k, v):
    return att.unfused(q * 2, k, v)


@pytest.mark.parametrize("fn", [no_mask, wrong_scale])
def test_a_deliberately_wrong_attention_is_caught(fn):
    c = att.check(fn, SHAPE, "float32", CPU)
    assert not c.ok and c.rel_error > c.tolerance and not c.error


def test_correct_implementations_pass_in_every_dtype():
    impls = {i.name: i for i in att.candidates("cpu", "float32")}
    for dtype in ("float32", "bfloat16"):
        for name in ("unfused", "sdpa (torch's choice)", "sdpa math", "sdpa flash"):
            c = att.check(impls[name].fn, SHAPE, dtype, CPU)
            assert c.ok, (name, dtype, c)


def test_unavailable_implementations_keep_their_reason():
    impls = {i.name: i for i in att.candidates("cpu", "float32")}
    assert "flash_attn" in impls["flash_attn package"].skipped or impls["flash_attn package"].fn
    c = att.check(impls["sdpa efficient"].fn, SHAPE, "float32", CPU)  # a CUDA-only backend
    assert not c.ok and c.rel_error is None and "RuntimeError" in c.error


def test_unfused_matches_the_definition():
    q, k, v = (torch.randn(1, 1, 3, 2) for _ in range(3))
    scores = (q @ k.transpose(-2, -1))[0, 0] / math.sqrt(2)
    row1 = torch.softmax(scores[1, :2], dim=0)  # position 1 sees positions 0 and 1
    assert torch.allclose(att.unfused(q, k, v)[0, 0, 1], row1 @ v[0, 0, :2], atol=1e-6)


def test_timing_reports_a_spread():
    s = att.time_fwd_bwd(att.unfused, SHAPE, "float32", CPU, warmup=1, reps=4)
    assert s.n == 4 and s.p10 <= s.median <= s.p90


def test_kernel_signature_tells_same_kernels_apart_from_different_ones():
    impls = {i.name: i for i in att.candidates("cpu", "float32")}
    sig = {n: att.kernel_signature(impls[n].fn, SHAPE, "float32", CPU)
           for n in ("unfused", "sdpa (torch's choice)", "sdpa flash", "sdpa math")}
    assert sig["sdpa (torch's choice)"] == sig["sdpa flash"]  # on CPU torch picks the flash kernel
    assert sig["unfused"] != sig["sdpa flash"] and sig["sdpa math"] != sig["sdpa flash"]
    assert "flash" in sig["sdpa flash"]


def test_a_broken_flash_attn_install_is_reported_with_its_error(monkeypatch, tmp_path):
    import sys

    from mfu_lab.analysis.attention import candidates

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(
        "raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    impl = next(i for i in candidates("cpu", "float32") if i.name == "flash_attn package")
    assert "installed but does not import" in impl.skipped and "libcudart.so.12" in impl.skipped
