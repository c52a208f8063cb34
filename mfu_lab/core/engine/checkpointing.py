"""Activation checkpointing of the reference model's blocks, all or selective (job keys ``activation_checkpointing``
and ``checkpoint_policy``).

``full`` (PyTorch's non-reentrant ``checkpoint``): each block keeps only its input and re-runs its whole forward in
the backward, matmuls included (about a third more compute). ``selective``: the same checkpoint with a policy
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that keeps the outputs of the compute-bound ops
(the linear layers' ``mm``/``addmm`` and fused attention) and recomputes the cheap ones (layer norms, GELU, adds,
casts, views): most of the memory of the elementwise intermediates back for little compute. It is torchtitan's
op-level selective recipe, without its every-other-matmul rule. The unfused attention's ``bmm`` is recomputed (its
outputs are the T x T scores a checkpoint is there to drop), so its FLOPs show in the hardware FLOPs.

What each policy saves, per layer (:func:`mfu_lab.analysis.placement.model.activation_bytes`): full, the block's
input; selective, that input and the q/k/v, attention, projection, MLP-up and MLP-down outputs, 10 x
batch x seq x d_model elements at one tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# the ops whose outputs a selective checkpoint keeps: matmuls of the linear layers and fused attention kernels
# (the CPU's flash kernel among them); an op this torch lacks is left out
_SAVE_NAMES = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _save_ops() -> frozenset:
    ops = set()
    for name in _SAVE_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


SAVE_OPS = _save_ops()


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def run_block(block: torch.nn.Module, x: torch.Tensor, policy: str) -> torch.Tensor:
    """``block(x)`` under a checkpoint: ``full`` re-runs the block's forward in the backward, ``selective`` only its
    cheap ops (:data:`SAVE_OPS` kept)."""
    if policy == "selective":
        return checkpoint(block, x, use_reentrant=False, context_fn=_selective_context)
    return checkpoint(block, x, use_reentrant=False)


__all__ = ["SAVE_OPS", "run_block"]
