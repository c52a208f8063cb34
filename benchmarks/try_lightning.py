"""The production monitor against Lightning's own meter on the same run: Lightning's demo Transformer
(``pytorch_lightning.demos.transformer``, an ``nn.Transformer`` encoder-decoder nobody here wrote) trained by a
Lightning ``Trainer`` on the CPU with both callbacks at once:

- Lightning's ``ThroughputMonitor``, its FLOPs per batch from ``measure_flops`` as Lightning's documentation
  writes it (``torch.utils.flop_counter`` over a forward and the loss's backward; on a real copy of the model, as
  ``nn.Transformer`` reads its mask's values, which the meta device the documentation uses cannot give), its
  ``device/flops_per_sec`` over a sliding window of batch ends (validation left out);
- mfu_lab's ``MonitorCallback``, its FLOPs counted over one real optimizer step by the workbook's own counter, its
  MFU per interval of ``every`` steps over the wall time less evaluation, checkpoints and logging.

    python benchmarks/try_lightning.py [--steps 80] [--every 20] [--window 10] [--out DIR]

Prints both FLOPs per batch and both achieved FLOP/s over each of mfu_lab's intervals (mfu_lab's: its MFU x the
peak it was given; Lightning's: its FLOPs per batch over its own clock's time for the same batches, and its
sliding window ending there, which covers other batches). The peak is a stated number given to both
(``--peak``, default 1e12): the comparison is of achieved FLOP/s, which does not depend on it. A validation pass
every ``--val-every`` steps (with a sleep of ``--val-sleep-ms``) checks that both leave it out.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    """Random token pairs (inputs, targets) of one length: the demo's WikiText2 needs a download."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


def build(args):
    from lightning_fabric.utilities.throughput import measure_flops
    from pytorch_lightning.demos.transformer import LightningTransformer, Transformer

    class Demo(LightningTransformer):
        def setup(self, stage):  # as ThroughputMonitor's documentation writes it, on a real copy: nn.Transformer
            model = Transformer(vocab_size=args.vocab)  # reads its mask's values (.item() fails on the meta device)
            x = torch.randint(0, args.vocab, (args.batch, args.seq))

            def sample_forward():
                return model(x, x)

            self.flops_per_batch = measure_flops(model, sample_forward, loss_fn=torch.Tensor.sum)

        def prepare_data(self):  # the demo's own downloads WikiText2
            pass

        def train_dataloader(self):
            return DataLoader(Tokens(args.batch * (args.steps + 5), args.seq, args.vocab), batch_size=args.batch)

        def val_dataloader(self):
            return DataLoader(Tokens(args.batch * 2, args.seq, args.vocab, seed=1), batch_size=args.batch)

        def validation_step(self, batch, batch_idx):
            time.sleep(args.val_sleep_ms / 1e3)
            inputs, target = batch
            return torch.nn.functional.nll_loss(self(inputs, target), target.view(-1))

    return Demo(vocab_size=args.vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=20, help="mfu_lab's interval, in optimizer steps")
    ap.add_argument("--window", type=int, default=10, help="Lightning's window, in batches")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--peak", type=float, default=1e12, help="the same stated peak FLOP/s for both")
    ap.add_argument("--val-every", type=int, default=30, help="a validation pass every N steps")
    ap.add_argument("--val-sleep-ms", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ThroughputMonitor
    from pytorch_lightning.loggers import CSVLogger

    from mfu_lab.monitor.lightning import MonitorCallback

    torch.manual_seed(0)
    out = args.out or Path(tempfile.mkdtemp(prefix="try_lightning_"))
    mon = out / "mon"
    model = build(args)
    theirs = ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel(),
                               window_size=args.window)
    ours = MonitorCallback(mon, every=args.every, peak_flops=args.peak, profile_every_s=None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[theirs, ours],
                         logger=CSVLogger(out, name="lightning"), log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=2)
    t0 = time.perf_counter()
    trainer.fit(model)
    wall = time.perf_counter() - t0

    rows = list(csv.DictReader(next(out.glob("lightning/version_*/metrics.csv")).open()))
    # Lightning's own clock: train/time at the end of each batch, since fit began, validation taken out
    clock = {int(float(r["train/batches"])): float(r["train/time"]) for r in rows if r.get("train/time")}
    window = {int(float(r["train/batches"])): float(r["train/device/flops_per_sec"]) for r in rows
              if r.get("train/device/flops_per_sec")}
    recs = [json.loads(line) for f in sorted(mon.glob("*.jsonl")) for line in f.read_text().splitlines()]
    flops = next(r for r in recs if r["kind"] == "flops")
    ivs = [r for r in recs if r["kind"] == "interval" and not r["partial"] and r["mfu"] is not None]
    print(f"Lightning's demo Transformer, batch {args.batch} x {args.seq} tokens, vocab {args.vocab}, "
          f"{args.steps} steps on the CPU ({torch.get_num_threads()} threads) in {wall:.1f} s; {out}")
    per_step = flops["per_step"]
    print(f"FLOPs per batch: Lightning's measure_flops {model.flops_per_batch:,} (forward + loss backward); "
          f"mfu_lab {per_step:,.0f} ({flops['source']} over step {flops['step']}); "
          f"ratio {per_step / model.flops_per_batch:.4f}")
    print("achieved FLOP/s over each of mfu_lab's intervals: mfu_lab's MFU x the stated peak; Lightning's FLOPs per "
          "batch over its own clock's time for the same batches (train/time, validation out); and its "
          f"ThroughputMonitor's window of the last {args.window} batches there:")
    ratios = []
    for r in ivs:
        mine, b, n = r["mfu"] * args.peak, r["step"], r["steps"]
        span = clock[b] - clock[b - n] if b in clock and b - n in clock else None
        same = model.flops_per_batch * n / span if span else None
        if same:
            ratios.append(mine / same)
        train = r["wall_s"] - r["other_s"]
        print(f"  batches {b - n + 1:3d}-{b:3d}: mfu_lab {mine / 1e9:6.2f} GFLOP/s over {train:.3f} s "
              f"({r['other_s']:.2f} s of validation left out)"
              + (f"; Lightning {same / 1e9:6.2f} GFLOP/s over {span:.3f} s, ratio {mine / same:.3f}" if same else "")
              + (f"; its window {window[b] / 1e9:6.2f} GFLOP/s" if b in window else ""))
    if ratios:
        print(f"mfu_lab / Lightning over the same batches: {min(ratios):.3f} to {max(ratios):.3f} "
              f"({len(ratios)} intervals)")

if __name__ == "__main__":
    main()
