"""FP8 only where it is faster (issue 46): each layer group of the chosen policy timed in FP8 against bf16 on its
own matmul shapes, before the policy's whole-model timing; a group not faster beyond the probe's noise leaves the
policy.

On the first H200 run, GPT-2 124M's policy of every group measured 0.70x of bf16 (torchao float8, tensorwise): at
d_model 768 the casts and scales of FP8 cost more than the smaller matmuls save, and only a large matmul (the
lm_head, 768 x 50304 over 16k tokens) can gain. A whole-model timing says "slower" and drops everything; a per-group
probe keeps the groups that gain.

The probe (GPU with FP8 units and torchao only): per group, each distinct Linear shape of it as one ``nn.Linear``
(the job's tokens per micro-batch x in_features -> out_features), bf16 against the same layer converted by
torchao's ``convert_to_float8_training``, both compiled, forward and backward, timed with CUDA events over
interleaved repetitions. A group is kept when, for every shape of it, the FP8 layer's p90 lies below bf16's p10
(faster beyond the noise, step 4's rule). The rule (:func:`gate`) and the shapes (:func:`group_shapes`) run
anywhere; the timing only where FP8 runs.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.measure.timed import percentile

REPS, ROUNDS = 10, 3  # timed forward+backward passes per round, interleaved rounds per shape


def group_shapes(model: nn.Module, groups: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Group -> its distinct (in_features, out_features) Linear shapes, for the groups asked."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (g := f8.group_of(name)) in groups:
            shape = (mod.in_features, mod.out_features)
            if shape not in out.setdefault(g, []):
                out[g].append(shape)
    return out


def gate(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """(groups kept, dropped group -> why) from the probe's rows (group, in, out, bf16_s and fp8_s lists): a group
    is kept only when every shape of it is faster in FP8 beyond the noise (FP8's p90 below bf16's p10)."""
    whys: dict[str, list[str]] = {}
    for r in rows:
        b, f = r["bf16_s"], r["fp8_s"]
        r["speedup"] = sp = statistics.median(b) / statistics.median(f)
        problems = whys.setdefault(r["group"], [])
        if sp <= 1.0:
            problems.append(f"{r['in']}x{r['out']}: {sp:.2f}x of bf16 (median), slower")
        elif not percentile(f, 90) < percentile(b, 10):
            problems.append(f"{r['in']}x{r['out']}: {sp:.2f}x of bf16 (median), not beyond the noise (FP8's p90 "
                            "not below bf16's p10)")
    return [g for g, w in whys.items() if not w], {g: "; ".join(w) for g, w in whys.items() if w}


def _time_layer(layer: nn.Module, x: torch.Tensor, n: int) -> list[float]:  # pragma: no cover - GPU only
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        layer(x).sum().backward()
        b.record()
        out.append((a, b))
    torch.cuda.synchronize()  # sync point: read the events once every pass has finished
    return [a.elapsed_time(b) / 1e3 for a, b in out]


def probe(model: nn.Module, groups: list[str], tokens: int, recipe: str, device: torch.device,
          say) -> list[dict[str, Any]]:  # pragma: no cover - FP8 GPUs only
    """Each group's shapes timed bf16 against torchao float8 (compiled, forward and backward), interleaved."""
    from torchao.float8 import convert_to_float8_training

    config = fp8_layers.float8_config(recipe)
    rows = []
    for group, shapes in group_shapes(model, groups).items():
        for i, o in shapes:
            say(f"  FP8 probe {group}: {tokens} x {i} -> {o}, bf16 against float8 ({recipe})")
            x = torch.randn(tokens, i, device=device, dtype=torch.bfloat16, requires_grad=True)
            layers = {}
            # every layer here compiles the same Sequential.forward: without a reset each shape and each arm
            # would add a recompile of it (GPT-2: 5 shapes x 2 arms, past dynamo's recompile limit of 8, after
            # which it runs eager unsaid), and automatic dynamic shapes would time later shapes with dynamic
            # kernels; so a fresh cache per shape, static shapes
            torch._dynamo.reset()
            for label in ("bf16", "fp8"):
                lin = nn.Sequential(nn.Linear(i, o, bias=False)).to(device, torch.bfloat16)
                if label == "fp8":
                    convert_to_float8_training(lin, config=config)
                layers[label] = torch.compile(lin, dynamic=False)
                _time_layer(layers[label], x, 3)  # compile and warm up
            times: dict[str, list[float]] = {"bf16": [], "fp8": []}
            for r in range(ROUNDS):
                for label in (("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16")):
                    times[label] += _time_layer(layers[label], x, REPS)
            rows.append({"group": group, "in": i, "out": o, "tokens": tokens, "bf16_s": times["bf16"],
                         "fp8_s": times["fp8"]})
            del layers, x
            torch.cuda.empty_cache()
    return rows
