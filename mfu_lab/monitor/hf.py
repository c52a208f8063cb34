"""The production monitor under Hugging Face ``transformers.Trainer``: one callback, one JSON-lines file per rank.

::

    from mfu_lab.monitor.hf import MonitorCallback

    trainer = Trainer(..., args=TrainingArguments(..., include_num_input_tokens_seen=True),
                      callbacks=[MonitorCallback("mon/", every=50)])

What is measured, and how (all host clock readings, no device synchronisation):

- one monitor step per optimizer step (``on_step_begin`` .. ``on_step_end``; under gradient accumulation the
  Trainer fetches all of a step's micro-batches before ``on_step_begin``);
- the step's wall time: from one ``on_step_end`` to the next (the :class:`~mfu_lab.monitor.Monitor` clock);
- evaluation, checkpoint and logging time (``other_s``): after a step the Trainer logs, evaluates and saves, in
  that order, and only then fetches the next batches. Each of ``on_log``, ``on_evaluate`` and ``on_save`` fires
  when its work is done, so the time from the previous mark (``on_step_end``, or ``on_train_begin`` for
  ``eval_on_start``) to the last of them is ``other_s``, kept out of MFU;
- data wait (``data_s``): from that last mark to ``on_step_begin``: the Trainer's fetch of the step's batches (and
  whatever other callbacks do in that gap). Host time outside the step is not separable: it is in these figures,
  and ``host_s`` stays 0;
- FLOPs: counted over one optimizer step, between ``on_step_begin`` and ``on_step_end`` (the evaluation at start
  and between steps lies outside that window);
- tokens per step: ``tokens_per_step`` when given (this rank's tokens per optimizer step); else the growth of
  ``state.num_input_tokens_seen`` over the step (``TrainingArguments(include_num_input_tokens_seen=True)``: without
  it tokens/s is unknown), divided by the world size, since the Trainer sums that count over all ranks; else
  unknown (no tokens/s; MFU from the FLOPs counted per step);
- peak as in :class:`~mfu_lab.monitor.Monitor`, with the ``model`` the Trainer passes to callbacks.
  That is the unwrapped model: under DDP the all-reduces are not timed per interval (the profiler windows still
  show the exposed communication). ``dtype`` defaults to the Trainer's precision (``bf16``: bfloat16, ``fp16``:
  float16), else the parameters' dtype.

Every rank records (each writes its own file; the monitor reads its rank from torchrun's or Slurm's variables,
else torch.distributed). The monitor is created and started on ``on_train_begin`` and closed on ``on_train_end``.
The Trainer has no exception event: a run that raises is closed when the process exits (or when the next
``train()`` begins), with that as the end record's reason, and the Trainer's own FLOP figure (``total_flos``) as it
stood at its last log.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("mfu_lab.monitor.hf needs Hugging Face transformers: pip install transformers") from e

from mfu_lab.monitor.recorder import Monitor


def _trainer_flops(state, since: tuple[float, int], world: int) -> dict[str, Any] | None:
    """What the Trainer itself added to ``state.total_flos`` over this ``train()`` (``since``: its total and step at
    ``on_train_begin``), per optimizer step and rank (``world``: the ranks whose figures the Trainer summed, 1 unless
    its parallel mode is DISTRIBUTED), as it adds it up:
    ``floating_point_ops`` of each batch, 6 x the main input's elements x the parameters less the embeddings
    (a subclass's own method, or a model's under transformers 4, included). None when it added nothing."""
    total, step = float(getattr(state, "total_flos", 0) or 0), int(getattr(state, "global_step", 0) or 0)
    steps = step - since[1]
    if steps <= 0 or total <= since[0]:
        return None
    return {"name": "the Trainer's total_flos", "per_step": (total - since[0]) / steps / max(world, 1),
            "steps": steps, "how": "floating_point_ops: 6 x the main input's elements (input_ids: every token, padding "
            "included; pixel_values: every pixel value) x the parameters less the embeddings"}


def _precision_dtype(args) -> str | None:
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return None


class MonitorCallback(TrainerCallback):
    """``transformers.Trainer`` callback that runs a :class:`~mfu_lab.monitor.Monitor` over ``Trainer.train``
    (see the module's docstring for what is measured). Keyword arguments beyond the named ones go to ``Monitor``."""

    def __init__(self, out_dir, *, every: int = 50, flops_per_token: float | None = None,
                 peak_flops: float | None = None, dtype: str | None = None, profile_every_s: float | None = 1800.0,
                 tokens_per_step: int | None = None, **monitor_kwargs: Any):
        self.out_dir, self.every, self.flops_per_token, self.peak_flops = out_dir, every, flops_per_token, peak_flops
        self.dtype, self.profile_every_s, self.tokens_per_step = dtype, profile_every_s, tokens_per_step
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self._last_end: float | None = None
        self._data_s = self._other_s = 0.0
        self._seen = 0
        self._world = 1
        self._flos0 = (0.0, 0)

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self._close("a new train() began before the previous one ended (an exception?)")
        self.monitor = Monitor(self.out_dir, model=model, flops_per_token=self.flops_per_token,
                               peak_flops=self.peak_flops, every=self.every,
                               dtype=self.dtype or _precision_dtype(args), profile_every_s=self.profile_every_s,
                               **self.monitor_kwargs)
        self.monitor.framework = "Hugging Face Trainer"
        self.monitor.start()
        if self.tokens_per_step is None and getattr(args, "include_num_input_tokens_seen", False) in (False, None,
                                                                                                    "no"):
            import warnings

            warnings.warn("mfu-lab monitor: the Trainer counts no tokens (TrainingArguments("
                          "include_num_input_tokens_seen=True) is not set, nor MonitorCallback(tokens_per_step=)): "
                          "tokens/s is unknown; MFU comes from the FLOPs counted per step", stacklevel=2)
        atexit.register(self._at_exit)
        self._seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._flos0 = (float(getattr(state, "total_flos", 0) or 0), int(getattr(state, "global_step", 0) or 0))
        self._world = max(int(getattr(args, "world_size", 1) or 1), 1)
        self._data_s = self._other_s = 0.0
        self._last_end = time.perf_counter()  # after start(): the monitor's own start-up is not a data wait

    def _done_other(self) -> None:
        """Logging, an evaluation or a checkpoint just finished: the time since the last mark was not data."""
        if self.monitor is not None and self._last_end is not None:
            now = time.perf_counter()
            self._other_s += now - self._last_end
            self._last_end = now

    def on_log(self, args, state, control, **kwargs) -> None:
        self._done_other()
        self._framework_flops(args, state)  # the Trainer stores its FLOPs (store_flos) before each log: a run that
        # dies later keeps the figure up to its last log

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        self._done_other()

    def on_save(self, args, state, control, **kwargs) -> None:
        self._done_other()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.monitor is None:
            return
        if self._last_end is not None:
            self._data_s += time.perf_counter() - self._last_end
            self._last_end = None
        self.monitor.batch_begin()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.monitor is None:
            return
        self.monitor.batch_end()
        tokens = self.tokens_per_step
        if tokens is None:
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            if seen > self._seen:
                tokens = (seen - self._seen) // self._world
            self._seen = seen
        data, other, self._data_s, self._other_s = self._data_s, self._other_s, 0.0, 0.0
        self.monitor.step(tokens=tokens, data_wait_s=data, host_s=0.0, other_s=other)
        self._last_end = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._framework_flops(args, state)  # the Trainer has stored its FLOPs (store_flos) by now
        self._close("closed")

    # ------------------------------------------------------------------ internals
    def _framework_flops(self, args, state) -> None:
        """The Trainer's own FLOP figure so far, kept for the monitor's end record (None until it added some)."""
        if self.monitor is not None:
            summed = str(getattr(getattr(args, "parallel_mode", None), "value", "")) == "distributed"
            found = _trainer_flops(state, self._flos0, self._world if summed else 1)
            self.monitor.framework_flops = found or self.monitor.framework_flops

    def _at_exit(self) -> None:
        self._close("the process exited during training (no on_train_end: an exception, or an interrupt?)")

    def _close(self, why: str) -> None:
        mon, self.monitor = self.monitor, None
        self._last_end = None
        if mon is not None:
            atexit.unregister(self._at_exit)
            mon.close(why)
