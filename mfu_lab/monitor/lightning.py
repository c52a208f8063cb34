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
- evaluation and checkpoint time (``other_s``): after a batch Lightning logs, runs validation when due
  (``on_validation_start`` .. ``on_validation_end``) and saves checkpoints (``trainer.save_checkpoint``, timed
  around the call, and ``on_save_checkpoint``), and only then fetches the next batch. The time from the previous
  batch's end to the end of the last of these is ``other_s``, kept out of MFU (as Lightning's
  ``ThroughputMonitor`` leaves validation out);
- data wait (``data_s``): from that mark to this batch's ``on_train_batch_start``: Lightning's fetch of the batch
  and its copy to the device (its logging at a batch's end, which has no hook, and other callbacks' work in that
  gap land here too). Host time outside the step is not separable under a framework: ``host_s`` stays 0;
- FLOPs: counted over one optimizer step, between ``on_train_batch_start`` and ``on_train_batch_end`` of its
  micro-batches (validation, the sanity check and checkpoints lie outside that window);
- tokens: ``tokens_fn(batch)`` when given; else ``batch.numel()`` for a tensor batch, the first tensor's for a
  tuple or list, ``batch["input_ids"].numel()`` for a dict with ``input_ids``; else unknown (no tokens/s; MFU from
  the FLOPs counted per step). Tokens are this rank's (its own batches);
- peak as in :class:`~mfu_lab.monitor.Monitor`, with the model as the strategy runs it (the DDP
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


def _module_flops(trainer, pl_module, steps: int) -> dict[str, Any] | None:
    """The LightningModule's own ``flops_per_batch`` (what Lightning's ThroughputMonitor reads every batch, often
    ``measure_flops`` of a forward and the loss's backward) per optimizer step: x the micro-batches in one. None when
    the module has none."""
    try:
        per_batch = getattr(pl_module, "flops_per_batch", None)
    except Exception:  # noqa: BLE001 - the module's own property failed: nothing to compare with, the fit goes on
        return None
    if isinstance(per_batch, bool) or not isinstance(per_batch, (int, float)) or per_batch <= 0 or steps <= 0:
        return None
    k = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    return {"name": "the module's flops_per_batch (Lightning's ThroughputMonitor)", "per_step": float(per_batch) * k,
            "steps": steps, "how": f"flops_per_batch x {k} micro-batch(es) a step; ThroughputMonitor reads it as "
            "given (measure_flops counts a forward and the loss's backward)"}


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
        self._data_s = self._other_s = 0.0
        self._tokens: int | None = None
        self._global_step = self._step0 = 0
        self._in_validation: float | None = None
        self._trainer = self._save = None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        self._close("a new fit began before the previous one ended")
        self.monitor = Monitor(self.out_dir, model=_trained_model(trainer, pl_module),
                               flops_per_token=self.flops_per_token, peak_flops=self.peak_flops, every=self.every,
                               dtype=self.dtype or _precision_dtype(getattr(trainer, "precision", None)),
                               profile_every_s=self.profile_every_s, **self.monitor_kwargs)
        self.monitor.framework = "PyTorch Lightning"
        self.monitor.start()
        self._data_s, self._other_s, self._tokens, self._in_validation = 0.0, 0.0, None, None
        self._global_step = self._step0 = trainer.global_step
        self._time_saves(trainer)
        self._last_end = time.perf_counter()  # after start(): the monitor's own start-up is not a data wait

    def _time_saves(self, trainer) -> None:
        """Time ``trainer.save_checkpoint`` (what ModelCheckpoint and the user call) as other time: the call is
        wrapped on this trainer object for the fit, and given back at its end."""
        original = getattr(trainer, "save_checkpoint", None)
        if original is None or getattr(original, "mfu_lab_timed", False):
            return

        def save_checkpoint(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                self._done_other()

        save_checkpoint.mfu_lab_timed = True
        self._trainer, self._save = trainer, original
        trainer.save_checkpoint = save_checkpoint

    def _done_other(self) -> None:
        """Validation, a checkpoint or logging just finished: the time since the last mark was not data."""
        if self.monitor is not None and self._last_end is not None:
            now = time.perf_counter()
            self._other_s += now - self._last_end
            self._last_end = now

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.monitor is None:
            return
        self._done_other()  # logging and checkpoints after the batch, before validation
        self._in_validation, self._last_end = time.perf_counter(), None
        self.monitor.batch_end()  # never count a validation (a window is never open here; belt and braces)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.monitor is None or self._in_validation is None:
            return
        now = time.perf_counter()
        self._other_s += now - self._in_validation
        self._in_validation, self._last_end = None, now

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._done_other()  # the checkpoint is being built: the time since the batch's end was not data

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor is None:
            return
        if self._last_end is not None:
            self._data_s += time.perf_counter() - self._last_end
            self._last_end = None
        self.monitor.batch_begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor is None:
            return
        self.monitor.batch_end()
        try:
            n = self.tokens_fn(batch) if self.tokens_fn is not None else batch_tokens(batch)
        except Exception:  # the monitor never stops the job over a token count
            n = None
        if n is not None:
            self._tokens = (self._tokens or 0) + int(n)
        if trainer.global_step != self._global_step:  # an optimizer step ran: the training step ends here
            self._global_step = trainer.global_step
            data, other, tokens = self._data_s, self._other_s, self._tokens
            self._data_s, self._other_s, self._tokens = 0.0, 0.0, None
            self.monitor.step(tokens=tokens, data_wait_s=data, host_s=0.0, other_s=other)
        self._last_end = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.framework_flops = _module_flops(trainer, pl_module, trainer.global_step - self._step0)
        self._close("closed")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close("".join(traceback.format_exception_only(type(exception), exception)).strip())

    # ------------------------------------------------------------------ internals
    def _close(self, why: str) -> None:
        mon, self.monitor = self.monitor, None
        self._last_end = None
        if self._trainer is not None:  # give the trainer its own save_checkpoint back
            try:
                del self._trainer.save_checkpoint
            except AttributeError:
                pass
            self._trainer = self._save = None
        if mon is not None:
            mon.close(why)
