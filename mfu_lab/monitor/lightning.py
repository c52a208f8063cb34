"""The production monitor under PyTorch Lightning: one callback, one JSON-lines file per rank.

::

    from mfu_lab.monitor.lightning import MonitorCallback

    trainer = Trainer(..., callbacks=[MonitorCallback("mon/", every=50)])

Works with ``lightning`` (``lightning.pytorch``) and with the older ``pytorch_lightning`` package; when both are
installed the callback is a ``Callback`` of each, so either package's ``Trainer`` takes it.

What is measured, and how (all host clock readings, no device synchronisation):

- one monitor step per optimizer step: a batch whose ``on_train_batch_end`` finds ``trainer.global_step``
  advanced ends a step; under gradient accumulation the micro-batches before it are carried into that step
  (their data waits and tokens summed);
- the step's wall time: from one step's end to the next (the :class:`~mfu_lab.monitor.Monitor` clock);
- data wait: from the previous ``on_train_batch_end`` (for the first batch: ``on_train_start``) to this batch's
  ``on_train_batch_start``, given to the monitor as ``step(data_wait_s=...)``. That gap holds Lightning's fetch
  of the batch and its copy to the device, and also everything else Lightning runs between two batches:
  validation inside the epoch (``val_check_interval``), checkpoints, logging, other callbacks. Host time outside
  the step is not separable under a framework: it lands inside this data wait figure, and ``host_s`` stays 0;
- tokens: ``tokens_fn(batch)`` when given; else ``batch.numel()`` for a tensor batch, the first tensor's for a
  tuple or list, ``batch["input_ids"].numel()`` for a dict with ``input_ids``; else unknown (no tokens/s; MFU from
  the FLOPs counted per step). Tokens are this rank's (its own batches);
- FLOPs and peak as in :class:`~mfu_lab.monitor.Monitor`, with the model as the strategy runs it (the DDP
  wrapper when Lightning made one, so its all-reduces are timed; otherwise the LightningModule). ``dtype``
  defaults to the Trainer's precision (``bf16-*``: bfloat16, ``16-*``: float16), else the parameters' dtype.

Every rank records (each writes its own file; the monitor reads its rank from torchrun's or Slurm's variables,
else torch.distributed). The monitor is created and started on ``on_train_start``, closed on ``on_train_end``,
or on ``on_exception`` with the exception's text as the end record's reason.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from mfu_lab.monitor.recorder import Monitor

_BASES: list[type] = []
try:
    from lightning.pytorch import Callback as _LightningCallback

    _BASES.append(_LightningCallback)
except ImportError:
    pass
try:
    from pytorch_lightning import Callback as _PLCallback

    if _PLCallback not in _BASES:
        _BASES.append(_PLCallback)
except ImportError:
    pass
if not _BASES:
    raise ImportError("mfu_lab.monitor.lightning needs PyTorch Lightning: pip install lightning "
                      "(or the older pip install pytorch-lightning)")


def batch_tokens(batch: Any) -> int | None:
    """Tokens in one batch, when its shape says so: a tensor's elements, the first tensor's of a tuple or list,
    a dict's ``input_ids``; else None (unknown)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, (tuple, list)):
        first = next((b for b in batch if isinstance(b, torch.Tensor)), None)
        return first.numel() if first is not None else None
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
        return ids.numel() if isinstance(ids, torch.Tensor) else None
    return None


def _precision_dtype(precision: Any) -> str | None:
    p = str(precision or "")
    if p.startswith("bf16"):
        return "bfloat16"
    if p.startswith("16"):
        return "float16"
    return None


def _trained_model(trainer, pl_module) -> torch.nn.Module:
    """The model as the strategy runs it: the DDP wrapper when it made one (a timed communication hook then
    times the all-reduces), an FSDP one (the start record then says why collectives are not timed); else the
    LightningModule."""
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    return wrapped if isinstance(wrapped, torch.nn.Module) else pl_module


class MonitorCallback(*_BASES):
    """Lightning callback that runs a :class:`~mfu_lab.monitor.Monitor` over ``Trainer.fit`` (see the module's
    docstring for what is measured). Keyword arguments beyond the named ones go to ``Monitor``."""

    def __init__(self, out_dir, *, every: int = 50, flops_per_token: float | None = None,
                 peak_flops: float | None = None, dtype: str | None = None, profile_every_s: float | None = 1800.0,
                 tokens_fn: Callable[[Any], int | None] | None = None, **monitor_kwargs: Any):
        super().__init__()
        self.out_dir, self.every, self.flops_per_token, self.peak_flops = out_dir, every, flops_per_token, peak_flops
        self.dtype, self.profile_every_s, self.tokens_fn = dtype, profile_every_s, tokens_fn
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self._last_end: float | None = None
        self._data_s = 0.0
        self._tokens: int | None = None
        self._global_step = 0

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        self._close("a new fit began before the previous one ended")
        self.monitor = Monitor(self.out_dir, model=_trained_model(trainer, pl_module),
                               flops_per_token=self.flops_per_token, peak_flops=self.peak_flops, every=self.every,
                               dtype=self.dtype or _precision_dtype(getattr(trainer, "precision", None)),
                               profile_every_s=self.profile_every_s, **self.monitor_kwargs).start()
        self._data_s, self._tokens = 0.0, None
        self._global_step = trainer.global_step
        self._last_end = time.perf_counter()  # after start(): the monitor's own start-up is not a data wait

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor is None or self._last_end is None:
            return
        self._data_s += time.perf_counter() - self._last_end
        self._last_end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor is None:
            return
        n = self.tokens_fn(batch) if self.tokens_fn is not None else batch_tokens(batch)
        if n is not None:
            self._tokens = (self._tokens or 0) + int(n)
        if trainer.global_step != self._global_step:  # an optimizer step ran: the training step ends here
            self._global_step = trainer.global_step
            data, tokens, self._data_s, self._tokens = self._data_s, self._tokens, 0.0, None
            self.monitor.step(tokens=tokens, data_wait_s=data)
        self._last_end = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self._close("closed")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close("".join(traceback.format_exception_only(type(exception), exception)).strip())

    # ------------------------------------------------------------------ internals
    def _close(self, why: str) -> None:
        mon, self.monitor = self.monitor, None
        self._last_end = None
        if mon is not None:
            mon.close(why)
