"""The monitor's framework adapters (:mod:`mfu_lab.monitor.lightning`, :mod:`mfu_lab.monitor.hf`): a real tiny
training run on the CPU under each framework, its record file checked against a plain loop's."""

from __future__ import annotations

import importlib
import json
import sys
import time
import warnings

import pytest
import torch

from mfu_lab.monitor import Monitor

STEPS, EVERY, SLEEP_S = 30, 5, 0.02
BATCH, SEQ, VOCAB, WIDTH = 4, 16, 64, 32
SETTINGS = {"every": EVERY, "profile_every_s": None, "peak_flops": 1e12}


class TinyLM(torch.nn.Module):
    """An embedding and a linear head: forward(input_ids, labels) -> {"loss": ...}, as transformers' Trainer wants."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None \
            else None
        return {"loss": loss, "logits": logits}


class Tokens(torch.utils.data.Dataset):
    """More samples than the runs need, so every timed step's batch is a real fetch (never the loader's end)."""

    def __init__(self, n: int = (STEPS + 10) * BATCH):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def slow_collate(samples):
    """The injected data wait: SLEEP_S per batch, in the loader's own thread (num_workers=0)."""
    time.sleep(SLEEP_S)
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def tuple_collate(samples):
    b = slow_collate(samples)
    return b["input_ids"], b["labels"]


def read(folder) -> list[dict]:
    files = sorted(folder.glob("*-rank*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_fields(tmp_path_factory) -> set[str]:
    """The interval fields a plain loop with Monitor.loader writes."""
    out = tmp_path_factory.mktemp("plain")
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Tokens(12 * BATCH), batch_size=BATCH, collate_fn=slow_collate)
    with Monitor(out, model=model, **SETTINGS) as mon:
        for batch in mon.loader(loader):
            model(**batch)["loss"].backward()
            opt.step()
            opt.zero_grad()
            mon.step(tokens=batch["input_ids"].numel())
    intervals = [r for r in read(out) if r["kind"] == "interval"]
    assert intervals and intervals[0]["data_s"] >= SLEEP_S * intervals[0]["steps"]
    return set(intervals[0])


def check(records: list[dict], reference: set[str], steps: int = STEPS) -> list[dict]:
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds
    assert records[-1]["reason"] == "closed" and records[-1]["steps"] == steps
    intervals = [r for r in records if r["kind"] == "interval"]
    assert sum(r["steps"] for r in intervals) == steps - 1  # the first step is the warm-up, never timed
    assert [r["partial"] for r in intervals] == [False] * ((steps - 1) // EVERY) + [True] * bool((steps - 1) % EVERY)
    for r in intervals:
        assert set(r) == reference
        assert r["data_s"] >= SLEEP_S * r["steps"], r  # at least the injected sleep, whatever else the host did
        assert r["host_s"] == 0.0  # not separable under a framework: it is in data_s
        assert r["tokens"] == r["steps"] * BATCH * SEQ
        assert r["mfu"] is not None and r["mfu"] > 0  # FLOPs counted on the first step, peak given
        assert r["wall_s"] >= r["data_s"]
    assert any(r["kind"] == "flops" and r["source"] == "counted" for r in records)
    return intervals


def test_batch_tokens():
    pytest.importorskip("pytorch_lightning")
    from mfu_lab.monitor.lightning import batch_tokens

    x = torch.zeros(3, 5, dtype=torch.long)
    assert batch_tokens(x) == 15
    assert batch_tokens((x, torch.zeros(3))) == 15
    assert batch_tokens(["text", x]) == 15
    assert batch_tokens({"input_ids": x, "labels": x}) == 15
    assert batch_tokens({"pixels": x}) is None
    assert batch_tokens("text") is None


@pytest.mark.parametrize("module, blocked, package", [
    ("mfu_lab.monitor.lightning", ("lightning", "pytorch_lightning"), "pip install lightning"),
    ("mfu_lab.monitor.hf", ("transformers",), "pip install transformers"),
])
def test_missing_framework_names_the_package(monkeypatch, module, blocked, package):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: that import raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=package):
        importlib.import_module(module)


def _lightning_fit(tmp_path, loader, fail_at: int | None = None, **trainer_kw) -> list[dict]:
    """Fit TinyLM under Lightning with the monitor's callback; the records it wrote. ``fail_at``: the batch whose
    training step raises."""
    import pytorch_lightning as pl

    from mfu_lab.monitor.lightning import MonitorCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyLM()

        def training_step(self, batch, batch_idx):
            if batch_idx == fail_at:
                raise RuntimeError(f"boom at batch {batch_idx}")
            return self.net(*batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out = tmp_path / "mon"
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[MonitorCallback(out, **SETTINGS)], **trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers
        trainer.fit(Module(), loader)
    return read(out)


def test_lightning(tmp_path, reference_fields):
    pytest.importorskip("pytorch_lightning")
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, collate_fn=tuple_collate, num_workers=0)
    check(_lightning_fit(tmp_path, loader, max_steps=STEPS), reference_fields)


def test_lightning_exception_closes(tmp_path):
    pytest.importorskip("pytorch_lightning")
    loader = torch.utils.data.DataLoader(Tokens(8 * BATCH), batch_size=BATCH, collate_fn=tuple_collate)
    with pytest.raises(RuntimeError, match="boom"):
        _lightning_fit(tmp_path, loader, fail_at=3, max_steps=STEPS)
    end = read(tmp_path / "mon")[-1]
    assert end["kind"] == "end" and end["steps"] == 3 and "RuntimeError: boom at batch 3" in end["reason"]


def test_lightning_gradient_accumulation(tmp_path, reference_fields):
    """One monitor step per optimizer step: the micro-batches' data waits and tokens are summed into it."""
    pytest.importorskip("pytorch_lightning")
    steps, accumulate = 11, 2
    loader = torch.utils.data.DataLoader(Tokens((steps * accumulate + 4) * BATCH), batch_size=BATCH,
                                         collate_fn=tuple_collate)
    records = _lightning_fit(tmp_path, loader, max_steps=steps, accumulate_grad_batches=accumulate)
    assert records[-1]["steps"] == steps
    intervals = [r for r in records if r["kind"] == "interval"]
    assert sum(r["steps"] for r in intervals) == steps - 1
    for r in intervals:
        assert r["tokens"] == r["steps"] * accumulate * BATCH * SEQ
        assert r["data_s"] >= SLEEP_S * accumulate * r["steps"]


def test_hf_trainer(tmp_path, reference_fields):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mfu_lab.monitor.hf import MonitorCallback

    out = tmp_path / "mon"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH, report_to=[],
        save_strategy="no", use_cpu=True, logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen=True, learning_rate=0.1)
    callback = MonitorCallback(out, **SETTINGS)
    trainer = transformers.Trainer(model=TinyLM(), args=args, train_dataset=Tokens(), data_collator=slow_collate,
                                   callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert callback.monitor is None  # closed on on_train_end
    check(read(out), reference_fields)


def test_lightning_counts_the_flops_lightnings_own_measure_flops_gives_on_its_demo_transformer(tmp_path):
    """A model nobody here wrote (Lightning's demo ``nn.Transformer``, encoder-decoder, its attention through
    nn.MultiheadAttention) under a Lightning Trainer: the FLOPs the callback counts over one optimizer step equal
    Lightning's ``measure_flops`` (forward and the loss's backward) of the same model and batch, to the FLOP.
    benchmarks/try_lightning.py compares the achieved FLOP/s too (docs/monitor.md: 1.000 to 1.001)."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.throughput import measure_flops
    from pytorch_lightning.demos.transformer import LightningTransformer, Transformer

    from mfu_lab.monitor.lightning import MonitorCallback

    vocab, batch, seq = 128, 2, 8
    ids = torch.randint(0, vocab, (6 * batch, seq + 1), generator=torch.Generator().manual_seed(0))
    pairs = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])

    copy = Transformer(vocab_size=vocab)
    x = ids[:batch, :-1]
    theirs = measure_flops(copy, lambda: copy(x, x), loss_fn=torch.Tensor.sum)

    class Demo(LightningTransformer):
        flops_per_batch = theirs  # as ThroughputMonitor's documentation has the module carry it

        def prepare_data(self):  # the demo's own downloads WikiText2
            pass

        def train_dataloader(self):
            return torch.utils.data.DataLoader(pairs, batch_size=batch)

    model = Demo(vocab_size=vocab)
    out = tmp_path / "mon"
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[MonitorCallback(out, every=2, peak_flops=1e12, profile_every_s=None)])
    trainer.fit(model)
    counted = next(r for r in read(out) if r["kind"] == "flops")
    assert counted["per_step"] == theirs > 0
    # the module's own figure is recorded, and the report says the two agree
    from mfu_lab.analysis.monitor.summary import summarise

    assert read(out)[-1]["framework"]["per_step"] == theirs and read(out)[-1]["framework"]["steps"] == 4
    assert summarise(out).flops_per_token["note"].endswith("an MFU from it would read the same")


def test_hf_trainer_counted_flops_are_hfs_total_flos_plus_the_terms_it_leaves_out(tmp_path):
    """Hugging Face's own FLOP figure (``state.total_flos``: 6 x tokens x non-embedding parameters) on a real
    GPT2LMHeadModel under its Trainer, beside the FLOPs the callback counts over one optimizer step: the gap is
    exactly the named terms benchmarks/try_hf.py prints (GPT-2's tied head, attention's matmuls, less the biases
    and norms HF counts as matmul weights), from the model's shapes alone."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from .conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import try_hf
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    got = try_hf.reconcile(steps=3, layers=2, width=32, heads=2, vocab=96, seq=16, batch=2, out=tmp_path)
    tokens = 2 * 16
    assert got["hf"] == got["terms"]["HF's estimate, 6 x T x N_ne"] > 0
    assert got["terms"]["+ the head (tied to the embedding HF leaves out)"] == 6 * tokens * 96 * 32
    assert got["counted"] == got["predicted"] != got["hf"]
    # the monitor's report says both: its count per token, and the Trainer's own figure with how far apart they are
    from mfu_lab.analysis.monitor.summary import summarise

    fpt = summarise(tmp_path / "mon").flops_per_token
    ratio = got["hf"] / got["counted"]
    assert fpt["value"] == pytest.approx(got["counted"] / tokens, rel=1e-12) and fpt["label"] == "counted"
    assert (f"the Trainer's total_flos adds up {got['hf']:,.0f} FLOPs per optimizer step over 3 step(s) of this rank, "
            f"{ratio:.2f}x the {got['counted']:,.0f} counted (floating_point_ops: 6 x the main input's elements "
            "(input_ids: every token, padding included") in fpt["note"]
    assert f"an MFU from it would read {1 - ratio:.0%} lower" in fpt["note"]
    import dataclasses

    from mfu_lab.report.monitor_views import monitor_section
    page = monitor_section(json.loads(json.dumps(dataclasses.asdict(summarise(tmp_path / "mon")))), None)
    assert f"FLOPs per token behind MFU: {got['counted'] / tokens:,.0f}" in page and "total_flos adds up" in page


def test_a_trainer_that_dies_keeps_its_total_flos_up_to_its_last_log(tmp_path):
    """The Trainer has no exception event: a run that raises at step 3 is closed at the process's exit, and its end
    record still holds the Trainer's own FLOP figure as stored before its last log (step 2), by HF's formula."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mfu_lab.monitor.hf import MonitorCallback

    class Dies(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("the job died at step 3")

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 96, (12, 16), generator=torch.Generator().manual_seed(0))
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=5, per_device_train_batch_size=2, report_to=[], save_strategy="no",
        use_cpu=True, logging_steps=1, dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen=True)
    monitor = MonitorCallback(tmp_path / "mon", every=2, peak_flops=1e12, profile_every_s=None)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                   callbacks=[monitor, Dies()])
    with pytest.raises(RuntimeError, match="died at step 3"):
        trainer.train()
    monitor._at_exit()  # what atexit runs when the process ends
    recs = [json.loads(line) for f in sorted((tmp_path / "mon").glob("*.jsonl")) for line in f.read_text().splitlines()]
    (end,) = [r for r in recs if r["kind"] == "end"]
    assert end["reason"].startswith("the process exited during training")
    six_t_n = 6 * 2 * 16 * model.num_parameters(exclude_embeddings=True)  # HF's floating_point_ops per step
    assert end["framework"]["steps"] == 2 and end["framework"]["per_step"] == pytest.approx(six_t_n, rel=1e-9)
    from mfu_lab.analysis.monitor.summary import summarise

    note = summarise(tmp_path / "mon").flops_per_token["note"]  # the report says it, over the steps it covers
    assert f"the Trainer's total_flos adds up {six_t_n:,.0f} FLOPs per optimizer step over 2 step(s)" in note, note


@pytest.mark.parametrize("fw_step, far", [(1.002e9, "the same"), (0.5e9, "50% lower"), (1.5e9, "50% higher"),
                                          (3e9, "3.0x as high")])
def test_the_frameworks_figure_is_said_beside_the_lowest_ranks_count(fw_step, far):
    """Per optimizer step against the count (never per token: a ViT's Trainer multiplies by pixel values, and
    non-padding tokens are not what it multiplies by); the lowest rank's count whatever its node's name."""
    from types import SimpleNamespace

    from mfu_lab.analysis.monitor.read import Sums
    from mfu_lab.analysis.monitor.summary import _flops_per_token

    count = {"source": "counted", "per_step": 1e9, "per_token": 1e6, "step": 1, "tokens": 1000, "launch": "L"}
    fw = {"name": "the Trainer's total_flos", "per_step": fw_step, "steps": 4, "how": "its formula", "launch": "L"}
    even = Sums(tokens=9000.0, steps=9)  # the intervals: 1000 tokens a step, as the counted step
    st = SimpleNamespace(ranks={}, flops={("b", 0): count, ("a", 1): dict(count, per_token=7.0)},
                         framework={("b", 0): fw}, per_rank={("b", 0): even})
    got = _flops_per_token(st)
    assert got["value"] == 1e6 and got["label"] == "counted"
    assert f"adds up {fw_step:,.0f} FLOPs per optimizer step over 4 step(s)" in got["note"]
    assert got["note"].endswith(f"an MFU from it would read {far}")
    # the framework's figure is the run's average and the count one step's: compared only when the steps' work was
    # the same, and within one launch
    st.per_rank = {("b", 0): Sums(tokens=8000.0, steps=9)}  # a short step at each epoch's end, or varying lengths
    assert "not compared: the steps' tokens varied (889 a step on average against the counted step's 1,000)" in \
        _flops_per_token(st)["note"]
    st.per_rank, st.framework = {("b", 0): even}, {("b", 0): dict(fw, launch="M")}
    assert _flops_per_token(st)["note"].endswith("from another launch than the count: not compared")
    st.flops = {("b", 0): dict(count, per_token=None)}  # no tokens counted: the comparison per step still stands
    got = _flops_per_token(st)
    assert got["value"] is None and "adds up" not in got["note"] and "another launch" in got["framework"]


def test_a_modules_flops_per_batch_that_fails_or_is_no_number_is_left_out():
    """A property that raises, or True, is no FLOP figure: nothing recorded, and the fit's end goes on."""
    from types import SimpleNamespace

    from mfu_lab.monitor.lightning import _module_flops

    class Raises:
        @property
        def flops_per_batch(self):
            raise RuntimeError("not measured yet")

    trainer = SimpleNamespace(accumulate_grad_batches=3)
    assert _module_flops(trainer, Raises(), 5) is None
    assert _module_flops(trainer, SimpleNamespace(flops_per_batch=True), 5) is None
    got = _module_flops(trainer, SimpleNamespace(flops_per_batch=2e9), 5)
    assert got["per_step"] == 6e9 and got["steps"] == 5  # x the micro-batches of an optimizer step
