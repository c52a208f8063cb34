"""FP8 training numerics: emulation, per-layer sensitivity, policies and a divergence watch (step 5).

Emulation is a quantise-dequantise through ``torch.float8_e4m3fn`` (forward: inputs and weights)
and ``torch.float8_e5m2`` (backward: output gradients), the formats and the scaling torchao's
float8 training uses, with the matmuls themselves done in float32. It reproduces FP8's *numerics*
(rounding, underflow, saturation) on any device and says nothing about FP8 *speed*: every figure
from it is labelled ``emulated``.

Scaling, per tensor before the cast, following torchao's recipes:

- ``tensorwise``: one scale per tensor, ``scale = fmax / amax(|t|)``; gradients in e5m2;
- ``rowwise``: one scale per row (the last dimension's amax), floored to a power of two; e4m3 for
  gradients too (``rowwise_with_gw_hp`` also keeps the weight gradient in high precision);
- ``none``: a plain cast. Small gradients underflow to zero and large activations saturate,
  which is why a scaler is not optional.

Values beyond the format's largest finite value saturate (clamp), as torchao does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mfu_lab.core.engine.fp8 import group_of  # noqa: F401  (the groups' names live with the conversion)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
SCALINGS = ("tensorwise", "rowwise", "none")
# torchao's recipes: scaling, whether grad_weight is quantised, the gradients' format, power-of-2 scales.
# Tensorwise casts gradients to e5m2; rowwise uses e4m3 everywhere, with scales floored to a power of two.
RECIPES = {"tensorwise": ("tensorwise", True, E5M2, False), "rowwise": ("rowwise", True, E4M3, True),
           "rowwise_with_gw_hp": ("rowwise", False, E4M3, True), "none": ("none", True, E5M2, False)}
SCALING_RECIPE = {"tensorwise": "tensorwise", "rowwise": "rowwise", "none": "none"}  # sensitivity columns


def _scale(t32: torch.Tensor, dtype: torch.dtype, scaling: str, pow2: bool = False) -> torch.Tensor:
    fmax = FMAX[dtype]
    if scaling == "none":
        return torch.ones((), dtype=torch.float32, device=t32.device)
    if scaling == "tensorwise":
        scale = fmax / t32.abs().amax().clamp(min=1e-12)
    elif scaling == "rowwise":
        scale = fmax / t32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    else:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def quantise(t: torch.Tensor, dtype: torch.dtype, scaling: str, pow2: bool = False) -> torch.Tensor:
    """``t`` through FP8 and back (float32): scale, saturate, cast, cast back, unscale."""
    t32 = t.detach().float()
    scale = _scale(t32, dtype, scaling, pow2)
    fmax = FMAX[dtype]
    return (t32 * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def cast_stats(t: torch.Tensor, dtype: torch.dtype, scaling: str, pow2: bool = False) -> dict[str, float]:
    """How ``t`` survives the cast: signal-to-noise (dB), share of nonzero values that underflow to
    zero, share beyond the format's largest finite value (saturated by the clamp)."""
    t32 = t.detach().float()
    q = quantise(t32, dtype, scaling, pow2)
    nonzero = t32 != 0
    n = int(nonzero.sum()) or 1
    under = int(((q == 0) & nonzero).sum()) / n
    sat = int(((t32 * _scale(t32, dtype, scaling, pow2)).abs() > FMAX[dtype] * (1 + 1e-6)).sum()) / n  # float slack
    return {"snr_db": snr_db(t32, q), "underflow": under, "saturated": sat}


def snr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(signal power / error power); +inf when exact."""
    ref, approx = ref.detach().double(), approx.detach().double()
    sig = float(ref.pow(2).sum())
    err = float((ref - approx).pow(2).sum())
    if err == 0:
        return math.inf
    if sig == 0:
        return -math.inf
    return 10 * math.log10(sig / err)


class _Fp8Matmul(torch.autograd.Function):
    """y = q(x) q(w)^T + b; backward with q(grad_y) (e5m2); grad_w in high precision when asked."""

    @staticmethod
    def forward(ctx, x, w, b, recipe: str):
        scaling, qgw, gdtype, pow2 = RECIPES[recipe]
        xq, wq = quantise(x, E4M3, scaling, pow2), quantise(w, E4M3, scaling, pow2)
        ctx.save_for_backward(x, xq, wq)
        ctx.spec, ctx.has_bias = (scaling, qgw, gdtype, pow2), b is not None
        with torch.autocast(x.device.type, enabled=False):  # the caller's autocast would run these in bf16/fp16
            y = xq.float() @ wq.float().t()
            if b is not None:
                y = y + b.float()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, xq, wq = ctx.saved_tensors
        scaling, qgw, gdtype, pow2 = ctx.spec
        with torch.autocast(g.device.type, enabled=False):  # float32 matmuls, whatever autocast is around
            gq = quantise(g, gdtype, scaling, pow2)
            gx = (gq.float() @ wq.float()).to(x.dtype)
            g2, x2 = g.reshape(-1, g.shape[-1]).float(), (xq if qgw else x).float().reshape(-1, x.shape[-1])
            gw = (quantise(g2, gdtype, scaling, pow2) if qgw else g2).float().t() @ x2
        gb = g2.sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


class EmulatedFp8Linear(nn.Linear):
    """An nn.Linear whose matmuls see FP8 numerics (see the module docstring). Made by changing an
    existing Linear's class, so its parameters (and any weight tying) stay as they are."""

    fp8_recipe: str = "tensorwise"

    def forward(self, x):
        return _Fp8Matmul.apply(x, self.weight, self.bias, self.fp8_recipe)


# ------------------------------------------------------------------ layer groups and policies
def linear_groups(model: nn.Module) -> dict[str, list[str]]:
    """Group -> names of the nn.Linear modules in it, in model order."""
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.setdefault(group_of(name), []).append(name)
    return out


def group_flops_share(model: nn.Module) -> dict[str, float]:
    """Each group's share of the model's linear-layer FLOPs (in x out per token, the same for every token)."""
    per = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            per[group_of(name)] = per.get(group_of(name), 0) + m.in_features * m.out_features
    total = sum(per.values())
    return {g: v / total for g, v in per.items()}


def apply_policy(model: nn.Module, groups: list[str], recipe: str) -> int:
    """Switch the linears of ``groups`` to emulated FP8 under ``recipe`` (a key of RECIPES); returns how many."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    n = 0
    for name, m in model.named_modules():
        if type(m) is nn.Linear and group_of(name) in groups:
            m.__class__ = EmulatedFp8Linear
            m.fp8_recipe = recipe
            n += 1
    return n


# ------------------------------------------------------------------ sensitivity
@dataclass
class GroupSensitivity:
    group: str
    layers: int
    flops_share: float
    output_snr_db: float  # forward output, worst layer of the group
    grad_input_snr_db: float
    grad_weight_snr_db: float
    input_underflow: float  # shares of nonzero values, worst layer, under the scaling studied
    input_saturated: float
    grad_underflow: float
    grad_saturated: float

    @property
    def worst_snr_db(self) -> float:
        return min(self.output_snr_db, self.grad_input_snr_db, self.grad_weight_snr_db)


def layer_sensitivity(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, scaling: str) -> dict[str, float]:
    """One linear layer's FP8 error against float32, from its recorded input, weight and output gradient,
    with the formats and scales of the recipe that uses ``scaling`` (SCALING_RECIPE)."""
    _, _, gdtype, pow2 = RECIPES[SCALING_RECIPE[scaling]]
    x2 = x.detach().float().reshape(-1, x.shape[-1])
    g2 = g.detach().float().reshape(-1, g.shape[-1])
    w = w.detach().float()
    xq, wq = quantise(x2, E4M3, scaling, pow2), quantise(w, E4M3, scaling, pow2)
    gq = quantise(g2, gdtype, scaling, pow2)
    xs, gs = cast_stats(x2, E4M3, scaling, pow2), cast_stats(g2, gdtype, scaling, pow2)
    return {"output_snr_db": snr_db(x2 @ w.t(), xq @ wq.t()), "grad_input_snr_db": snr_db(g2 @ w, gq @ wq),
            "grad_weight_snr_db": snr_db(g2.t() @ x2, gq.t() @ xq),
            "input_underflow": xs["underflow"], "input_saturated": xs["saturated"],
            "grad_underflow": gs["underflow"], "grad_saturated": gs["saturated"]}


def sensitivity(model: nn.Module, loss_fn, batches, scalings=SCALINGS) -> dict[str, list[GroupSensitivity]]:
    """Record every linear layer's input and output gradient over ``batches`` (forward + backward with
    ``loss_fn(model, x, y)``), then measure each group's FP8 error under each scaling. The worst layer
    speaks for its group."""
    records: dict[str, dict[str, Any]] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def fwd(mod, inp, out, name=name):
                records.setdefault(name, {})["x"] = inp[0].detach()

            def bwd(mod, gin, gout, name=name):
                records.setdefault(name, {})["g"] = gout[0].detach()

            hooks += [m.register_forward_hook(fwd), m.register_full_backward_hook(bwd)]
    per_layer: dict[tuple[str, str], list[dict[str, float]]] = {}
    modules = dict(model.named_modules())
    try:
        for x, y in batches:
            loss_fn(model, x, y).backward()
            for name, r in records.items():
                if "x" in r and "g" in r:
                    for sc in scalings:
                        per_layer.setdefault((sc, name), []).append(
                            layer_sensitivity(r["x"], modules[name].weight, r["g"], sc))
            model.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    share = group_flops_share(model)
    out: dict[str, list[GroupSensitivity]] = {}
    for sc in scalings:
        for group, names in linear_groups(model).items():
            rows = [r for n in names for r in per_layer.get((sc, n), [])]
            if not rows:
                continue
            worst = lambda k, rows=rows: min(r[k] for r in rows)  # noqa: E731
            most = lambda k, rows=rows: max(r[k] for r in rows)  # noqa: E731
            out.setdefault(sc, []).append(GroupSensitivity(
                group, len(names), share[group], worst("output_snr_db"), worst("grad_input_snr_db"),
                worst("grad_weight_snr_db"), most("input_underflow"), most("input_saturated"),
                most("grad_underflow"), most("grad_saturated")))
    return out


# ------------------------------------------------------------------ divergence watch
@dataclass
class Watch:
    """Stops a trial when training goes wrong: a non-finite loss or gradient, a loss above the reference by
    more than ``tolerance`` (relative) averaged over ``window`` steps, or a gradient norm more than
    ``spike`` times the median of the norms before it."""

    reference: list[float] | None
    tolerance: float
    window: int
    spike: float
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def check(self, loss: float, grad_norm: float) -> str | None:
        step = len(self.losses)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm at step {step}"
        prior = sorted(self.grad_norms[:-1])
        if len(prior) >= 5 and grad_norm > self.spike * prior[len(prior) // 2]:
            return (f"gradient-norm spike at step {step}: {grad_norm:.3g}, {grad_norm / prior[len(prior) // 2]:.0f}x "
                    "the median so far")
        if self.reference and len(self.losses) >= self.window and len(self.reference) > step:
            mine = sum(self.losses[-self.window:]) / self.window
            ref = sum(self.reference[step - self.window + 1:step + 1]) / self.window
            if mine > ref * (1 + self.tolerance):
                return (f"loss above the reference by {mine / ref - 1:.1%} over steps {step - self.window + 1}-{step} "
                        f"(tolerance {self.tolerance:.0%})")
        return None
