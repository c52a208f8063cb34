"""The monitor inside strangers' training loops (issue 31): FLOPs of one training step only, checked against an
independent formula; data wait only where it was timed; evaluation, checkpoint and logging time apart; and the
monitor never a harm to the job (its own checkpoint file stays intact whatever fails inside the monitor)."""

from __future__ import annotations

import errno
import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mfu_lab.core.store.monitor_files import RecordWriter, rank_files, record_path
from mfu_lab.monitor import Monitor

L, H, D, T, V, B = 2, 4, 64, 32, 256, 4  # a nanoGPT-shaped GPT small enough for a slow CPU
SLEEP_S = 0.03  # the injected data wait per batch
SAVE_S = 0.1  # the injected time of a checkpoint save
PEAK = 1e11  # given, so no peak is measured in these tests


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D, bias=False), nn.LayerNorm(D, bias=False)
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.fc, self.out = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused SDPA, as nanoGPT's flash path
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's model, cut down: token and position embeddings, pre-LN blocks, a tied head."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.lnf = nn.LayerNorm(D, bias=False)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x, y=None):
        z = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for blk in self.h:
            z = blk(z)
        logits = self.head(self.lnf(z))
        return logits, (F.cross_entropy(logits.view(-1, V), y.view(-1)) if y is not None else None)


def nanogpt_flops_per_token(model: GPT) -> float:
    """nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T, N the parameters less the position embedding."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * L * H * (D // H) * T


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(Path(folder).glob("*.jsonl")) for line in f.read_text().splitlines()]


def of(recs: list[dict], kind: str) -> list[dict]:
    return [r for r in recs if r["kind"] == kind]


def get_batch():
    time.sleep(SLEEP_S)
    x = torch.randint(0, V, (B, T))
    return x, torch.roll(x, -1, 1)


def nanogpt_loop(out: Path, timed_fetch: bool, iters: int = 7, evals=(0, 4)) -> tuple[GPT, list[dict]]:
    """nanoGPT's train.py loop, its shape kept: estimate_loss (no_grad, eval mode) at the iterations ``evals``
    (nanoGPT: 0 and every eval_interval), the next batch fetched between the forward and the backward, the monitor's
    lines added as the README says."""
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        for _ in range(3):
            model(*get_batch())
        model.train()

    mon = Monitor(out, model=model, every=3, profile_every_s=None, peak_flops=PEAK)  # step() starts it
    x, y = get_batch()
    for it in range(iters):
        if it in evals:
            estimate_loss()
        _, loss = model(x, y)
        if timed_fetch:
            with mon.fetch():
                x, y = get_batch()
        else:
            x, y = get_batch()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step(tokens=B * T)
    mon.close()
    return model, records(out)


def test_plain_loop_evaluating_before_its_first_step_counts_one_training_step(tmp_path):
    model, recs = nanogpt_loop(tmp_path, timed_fetch=True)
    (fl,) = of(recs, "flops")
    assert fl["source"] == "counted" and fl["step"] == 2 and fl["rejected_windows"] == []
    ratio = fl["per_token"] / nanogpt_flops_per_token(model)
    assert abs(ratio - 1) < 0.02, ratio  # 13x too many before: the 40 evaluation forwards were counted
    assert any("scaled_dot_product" in op for op in fl["attention_ops"])  # fused SDPA counted, not 0
    ivs = of(recs, "interval")
    assert sum(r["steps"] for r in ivs) == 7 - 2  # the warm-up and the counted step are not timed
    for r in ivs:  # the injected sleep, timed through Monitor.fetch()
        assert r["data_timed"] and r["data_s"] >= SLEEP_S * r["steps"], r
        assert r["mfu"] == pytest.approx(fl["per_token"] * r["tokens"] / ((r["wall_s"] - r["other_s"]) * PEAK))
    assert recs[0]["kind"] == "start" and recs[0]["run"] and of(recs, "end")[0]["errors"] == {}


def test_a_window_with_an_evaluation_is_replaced_by_the_next_and_untimed_data_is_said_so(tmp_path):
    model, recs = nanogpt_loop(tmp_path, timed_fetch=False, iters=4, evals=range(4))  # evaluates every iteration
    (fl,) = of(recs, "flops")  # every window held an evaluation: the run ended before one was clean, said so
    assert fl["source"] is None and len(fl["rejected_windows"]) == 3, fl
    assert "evaluation" in fl["rejected_windows"][0]["why"]
    _, recs = nanogpt_loop(tmp_path / "b", timed_fetch=False, iters=6, evals=(0, 1))  # iteration 1's window: out
    (fl,) = of(recs, "flops")
    assert fl["source"] == "counted" and fl["step"] == 3 and [w["step"] for w in fl["rejected_windows"]] == [2]
    assert abs(fl["per_token"] / nanogpt_flops_per_token(model) - 1) < 0.02
    for r in of(recs, "interval"):  # no fetch timed: not timed, never a measured 0
        assert r["data_timed"] is False and r["data_s"] is None and r["host_s"] is None


def test_the_loader_and_step_data_wait_are_timed_and_other_time_is_kept_out_of_mfu(tmp_path):
    model = nn.Linear(8, 8)
    with Monitor(tmp_path, model=model, every=2, profile_every_s=None, peak_flops=PEAK) as mon:
        for i, x in enumerate(mon.loader(torch.randn(2, 8) for _ in range(7))):
            model(x).sum().backward()
            if i == 4:
                with mon.other():
                    time.sleep(0.05)  # an evaluation the loop marks
            mon.step(tokens=2, data_wait_s=0.01)
    ivs = of(records(tmp_path), "interval")
    assert all(r["data_timed"] and r["data_s"] >= 0.01 * r["steps"] for r in ivs)
    marked = [r for r in ivs if r["other_s"] > 0]
    assert len(marked) == 1 and marked[0]["other_s"] >= 0.05
    r = marked[0]
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["wall_s"] - r["other_s"]))
    assert r["step_s"]["max"] < 0.05 or r["wall_s"] - r["other_s"] < 0.05 * r["steps"]


def _lightning_module():
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = GPT()

        def training_step(self, batch, batch_idx):
            return self.net(*batch)[1]

        def validation_step(self, batch, batch_idx):
            return self.net(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Module()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def slow_pairs(samples):
    time.sleep(SLEEP_S)
    x = torch.stack([s["input_ids"] for s in samples])
    return x, torch.roll(x, -1, 1)


def test_lightning_with_validation_every_few_steps(tmp_path):
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl

    from mfu_lab.monitor.lightning import MonitorCallback

    steps = 10
    train = torch.utils.data.DataLoader(Tokens((steps + 2) * B), batch_size=B, collate_fn=slow_pairs)
    val = torch.utils.data.DataLoader(Tokens(2 * B), batch_size=B, collate_fn=slow_pairs)
    module = _lightning_module()

    class SlowSave(pl.Callback):  # a checkpoint that takes SAVE_S to write, saved after steps 4 and 8
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            time.sleep(SAVE_S)

    saves = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, max_steps=steps,
                         val_check_interval=3, num_sanity_val_steps=1,
                         callbacks=[MonitorCallback(tmp_path / "mon", every=3, profile_every_s=None, peak_flops=PEAK),
                                    SlowSave(), saves])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train, val)
    recs = records(tmp_path / "mon")
    (fl,) = of(recs, "flops")
    assert fl["source"] == "counted" and fl["step"] == 1 and "hooks" in fl["window"]
    assert abs(fl["per_token"] / nanogpt_flops_per_token(module.net) - 1) < 0.02, fl
    ivs = of(recs, "interval")
    assert sum(r["steps"] for r in ivs) == steps - 1
    for r in ivs:
        assert r["data_timed"] and r["data_s"] >= SLEEP_S * r["steps"], r
    # validation after steps 3, 6 and 9 (two slow batches each) and checkpoints after 4 and 8, in timed steps
    assert sum(r["other_s"] for r in ivs) >= 3 * 2 * SLEEP_S + 2 * SAVE_S
    assert trainer.save_checkpoint.__func__ is pl.Trainer.save_checkpoint  # the trainer's own, given back
    assert of(recs, "start")[0]["framework"] == "PyTorch Lightning"


def test_hf_trainer_with_eval_on_start(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mfu_lab.monitor.hf import MonitorCallback

    cfg = transformers.GPT2Config(n_layer=L, n_head=H, n_embd=D, n_positions=T, vocab_size=V, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    steps = 8

    def collate(samples):
        time.sleep(SLEEP_S)
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=B, per_device_eval_batch_size=B,
        report_to=[], save_strategy="no", use_cpu=True, logging_strategy="steps", logging_steps=3,
        eval_strategy="steps", eval_steps=4, eval_on_start=True, dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens((steps + 2) * B),
                                   eval_dataset=Tokens(3 * B), data_collator=collate,
                                   callbacks=[MonitorCallback(tmp_path / "mon", every=3, profile_every_s=None,
                                                              peak_flops=PEAK)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    recs = records(tmp_path / "mon")
    (fl,) = of(recs, "flops")
    n = L * 12 * D * D + V * D  # GPT-2's matmul parameters: c_attn, c_proj, c_fc, mlp c_proj; the tied head
    formula = 6 * n + 12 * L * D * T
    assert fl["source"] == "counted" and fl["step"] == 1
    assert abs(fl["per_token"] / formula - 1) < 0.02, (fl["per_token"], formula)  # 3.5x with eval counted before
    ivs = of(recs, "interval")
    assert sum(r["steps"] for r in ivs) == steps - 1
    for r in ivs:
        assert r["data_timed"] and r["data_s"] >= SLEEP_S * r["steps"], r
        assert r["tokens"] == r["steps"] * B * T
    assert sum(r["other_s"] for r in ivs) >= 3 * SLEEP_S  # the evaluation after step 4: 3 slow batches


# ------------------------------------------------------------------ never a harm to the job
def test_bad_arguments_raise_at_construction_with_their_name(tmp_path):
    for kwargs, name in (({"every": 0}, "every"), ({"max_bytes": -1}, "max_bytes"), ({"run": ""}, "run"),
                         ({"peak_flops": float("nan")}, "peak_flops"), ({"flops_per_token": float("inf")},
                                                                        "flops_per_token"),
                         ({"profile_steps": 1.5}, "profile_steps"), ({"dtype": "fp8"}, "dtype")):
        with pytest.raises(ValueError, match=name):
            Monitor(tmp_path, **kwargs)
    with pytest.raises(TypeError, match="model"):
        Monitor(tmp_path, model="gpt")


def _job_with_checkpoint(ckpt: Path, mon: Monitor, model: nn.Module, steps: int) -> bytes:
    """The job: trains, opens its checkpoint mid-run, keeps training (the monitor writing records), then writes
    the checkpoint and closes it. Returns what it wrote."""
    payload = b"CHECKPOINT" * 1000
    f = None
    for i in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        mon.step(tokens=2)
        if i == steps // 2:
            f = open(ckpt, "wb")  # noqa: SIM115 - the job holds its file open across steps, as jobs do
    f.write(payload)
    f.close()
    return payload


@pytest.mark.parametrize("attack", ["rename", "emfile", "fsync"])
def test_a_failed_rotation_never_writes_into_the_jobs_checkpoint(tmp_path, monkeypatch, attack):
    model = nn.Linear(8, 8)
    mon = Monitor(tmp_path / "mon", model=model, every=1, profile_every_s=None, peak_flops=PEAK,
                  max_bytes=300).start()  # rotates at almost every record
    real_rename, real_open, real_fsync = os.rename, os.open, os.fsync

    def failing(real):
        def call(*args, **kwargs):
            if str(args[0]).endswith(".jsonl") or (real is real_fsync):
                raise OSError(errno.EMFILE if attack == "emfile" else errno.ENOENT, "injected")
            return real(*args, **kwargs)
        return call

    target = {"rename": (Path, "rename"), "emfile": (os, "open"), "fsync": (os, "fsync")}[attack]
    if attack == "rename":
        monkeypatch.setattr(Path, "rename", lambda self, to: (_ for _ in ()).throw(OSError(errno.ENOENT, "gone")))
    else:
        monkeypatch.setattr(*target, failing(real_open if attack == "emfile" else real_fsync))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        payload = _job_with_checkpoint(tmp_path / "ckpt.bin", mon, model, 10)
    monkeypatch.undo()
    assert (tmp_path / "ckpt.bin").read_bytes() == payload  # intact: no record landed in it
    mon.step(tokens=2)
    mon.close()
    assert mon.errors.get("write", 0) >= 1
    for f in (tmp_path / "mon").glob("*.jsonl"):  # every line the monitor did write is a whole record
        assert all(json.loads(line)["kind"] for line in f.read_text().splitlines())
    del real_rename


def test_unwritable_folders_non_finite_tokens_and_the_open_file_limit_never_stop_training(tmp_path, monkeypatch):
    model = nn.Linear(8, 8)
    afile = tmp_path / "afile"
    afile.write_text("the job's own file")
    folders = [afile / "mon"]  # NotADirectoryError
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        folders.append(locked / "mon")  # PermissionError
    for folder in folders:
        with pytest.warns(UserWarning, match="training goes on"):
            with Monitor(folder, model=model, every=2, profile_every_s=None, peak_flops=PEAK) as mon:
                for t in (2, float("inf"), float("nan"), 2, 2):
                    model(torch.randn(2, 8)).sum().backward()
                    mon.step(tokens=t)
        assert mon.errors["write"] >= 1 and mon.errors["tokens"] == 2 and mon.steps_done == 5
    assert afile.read_text() == "the job's own file"
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many open "
                        "files")) if str(p).endswith(".jsonl") else real_open(p, *a, **k))
    with pytest.warns(UserWarning, match="Too many open files"):
        mon = Monitor(tmp_path / "emfile", model=model, every=2, profile_every_s=None, peak_flops=PEAK).start()
    for _ in range(3):
        mon.step(tokens=2)
    monkeypatch.undo()  # the limit passes: the next record opens the file, the start record first
    for _ in range(3):
        mon.step(tokens=2)
    mon.close()
    kinds = [r["kind"] for r in records(tmp_path / "emfile")]
    assert kinds[0] == "start" and kinds[-1] == "end" and "interval" in kinds


def test_step_without_start_counts_flops_and_computes_mfu(tmp_path):
    model = nn.Linear(16, 16)
    mon = Monitor(tmp_path, model=model, every=2, profile_every_s=None, peak_flops=PEAK)
    for _ in range(6):
        model(torch.randn(4, 16)).sum().backward()
        mon.step(tokens=4)
    mon.close()
    recs = records(tmp_path)
    (fl,) = of(recs, "flops")
    assert fl["per_step"] == 6 * 4 * 16 * 16 - 2 * 4 * 16 * 16  # forward, weight grad (no input grad needed)
    assert all(r["mfu"] for r in of(recs, "interval"))


# ------------------------------------------------------------------ file names and the folder walk
def test_run_ids_in_file_names_old_names_and_a_bounded_walk(tmp_path):
    def write(path: Path, **extra):
        wr = RecordWriter(path)
        wr.write({"kind": "start", "v": 2, "t": 1.0, "launch": "L", "rank": 0, "node": "n", **extra})
        wr.close()

    write(record_path(tmp_path, "gpu-node-1", 0, "job.7"), run="job.7")
    write(record_path(tmp_path, "gpu-node-1", 0, "other_job"), run="other_job")  # two jobs: two files
    write(record_path(tmp_path, "gpu-node-1", 1))  # an old name whose host holds a dash
    write(record_path(tmp_path / "a" / "b" / "c", "deep", 0, "r"), run="r")  # 3 levels down: read
    write(record_path(tmp_path / "a" / "b" / "c" / "d", "deeper", 0, "r"), run="r")  # 4: not read
    (tmp_path / "notes.jsonl").write_text("{}\n")  # not the monitor's name: not read
    got = {(f.host, f.run, f.rank) for f in rank_files(tmp_path)}
    assert got == {("gpu-node-1", "job.7", 0), ("gpu-node-1", "other_job", 0), ("gpu-node-1", "", 1),
                   ("deep", "r", 0)}
    assert record_path(tmp_path, "h", 0, "my-run/1").name == "h-my_run_1-rank0.jsonl"


def test_the_profiler_windows_analysis_runs_in_a_child_process_and_is_written_by_close(tmp_path):
    model = nn.Linear(32, 32)
    with Monitor(tmp_path, model=model, every=2, profile_every_s=1e-3, profile_steps=2, peak_flops=PEAK) as mon:
        for _ in range(9):
            model(torch.randn(4, 32)).sum().backward()
            mon.step(tokens=4)
    (prof, *_) = of(records(tmp_path), "profile")
    assert prof["analysed"].startswith("in a child process") and prof["analysis_s"] > 0, prof
    # what the loop paid: the profiler's stop, torch's export of the trace, the child's start (not its analysis)
    assert prof["overhead_s"] == prof["stop_s"] + prof["export_s"] + prof["spawn_s"] and not prof.get("error"), prof
    assert prof["steps_in_trace"] == 2 and prof["breakdown"]["computing"] > 0
    traces = tmp_path / "traces"  # the child compressed the exported trace and left no plain JSON behind
    assert (traces / prof["trace"]).suffixes[-2:] == [".json", ".gz"] and not list(traces.glob("*.json"))
