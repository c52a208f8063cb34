"""The job's own data (issue 30): token files, saved datasets and the user's factory, as batches every step trains on.

Each figure is held against an independent count: useful tokens against the labels counted here, the loss against
a hand computation, data wait against an injected sleep.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mfu_lab.core.engine.batches import Batch, as_batch
from mfu_lab.core.engine.data import Feed, build_loader
from mfu_lab.core.engine.work import same_batches
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.errors import JobError, StepError
from mfu_lab.core.job.schema import load_job, validate
from mfu_lab.core.measure.timed import run_steps

TINY = dict(n_layers=1, n_heads=2, d_model=16, seq_len=16, micro_batch=4, vocab_size=64)

FACTORY = textwrap.dedent('''
    import time
    import torch
    from torch import nn
    from torch.utils.data import Dataset, DataLoader

    T, V = 16, 64

    class Rows(Dataset):
        """Dict samples: ids, labels of -100 past each row's length, an attention mask."""
        def __init__(self, n=40, sleep_s=0.0):
            self.n, self.sleep_s = n, sleep_s
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            if self.sleep_s:
                time.sleep(self.sleep_s)
            ids = torch.randint(V, (T,), generator=torch.Generator().manual_seed(i))
            length = 3 + i % (T - 3)
            mask = (torch.arange(T) < length).long()
            return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}

    def data(rank=0, world_size=1):
        return Rows()

    def slow():
        return Rows(sleep_s=0.0125)  # 4 samples a batch: 50 ms a batch

    def loader():
        return DataLoader(Rows(), batch_size=2)

    def shuffled():
        return DataLoader(Rows(), batch_size=2, shuffle=True)  # a different order on every call

    class Lm(nn.Module):
        """Logits from ids; a Hugging Face style .loss when labels come in (the model shifts them)."""
        def __init__(self, vocab=V):
            super().__init__()
            self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)
        def forward(self, input_ids, attention_mask=None, labels=None):
            logits = self.head(self.emb(input_ids))
            out = type("Out", (), {})()
            out.logits, out.loss = logits, None
            if labels is not None:
                out.loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                       labels[:, 1:].reshape(-1), ignore_index=-100)
            return out

    def lm(vocab=V):
        return Lm(vocab)

    def mean_logit(output, batch):
        return output.logits.float().mean()
''')


MODULES: dict[str, str] = {}


@pytest.fixture()
def user(tmp_path, request):
    """A folder holding a factory module of a name of its own: a module imported once stays imported."""
    name = "userdata_" + "".join(c if c.isalnum() else "_" for c in request.node.name)
    (tmp_path / f"{name}.py").write_text(FACTORY)
    MODULES[str(tmp_path)] = name
    return tmp_path


def job_file(folder, **keys):
    import yaml

    mod = MODULES.get(str(folder))
    keys = {k: v.replace("userdata:", f"{mod}:") if isinstance(v, str) and mod else v for k, v in keys.items()}
    path = folder / "job.yaml"
    base = {k: v for k, v in TINY.items() if k != "vocab_size" or "model" not in keys}  # a factory: its own
    path.write_text(yaml.safe_dump({**base, "out_dir": str(folder / "out"), **keys}))
    return load_job(path)


def token_file(folder, n=5000, dtype=np.uint16, vocab=64):
    path = folder / "train.bin"
    (np.arange(n) % vocab).astype(dtype).tofile(path)
    return path


# ------------------------------------------------------------------ batches as users have them
def test_a_tensor_batch_targets_are_the_ids_shifted():
    x = torch.tensor([[5, 6, 7, 8]])
    b = as_batch(x)
    assert b[1].tolist() == [[6, 7, 8, -100]]


def test_a_dict_batch_shifts_its_labels_and_carries_labels_and_mask():
    ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[1, 2, -100, -100]])
    b = as_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.tensor([[1, 1, 0, 0]])})
    x, y = b
    assert y.tolist() == [[2, -100, -100, -100]]  # labels[:, 1:]: one useful target
    assert set(b.kwargs) == {"labels", "attention_mask"}
    no_labels = as_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    assert no_labels[1].tolist() == [[2, 3, -100, -100]]  # the mask's zeros have no target


def test_a_batch_of_another_form_is_refused_naming_the_forms():
    with pytest.raises(StepError, match="input_ids"):
        as_batch({"ids": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(StepError, match="pair"):
        as_batch("text")
    with pytest.raises(StepError, match="integers"):
        as_batch(torch.zeros(2, 3))


def test_a_batch_survives_a_worker_process_pickle():
    import pickle

    b = Batch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), {"labels": torch.zeros(1, 2)})
    assert set(pickle.loads(pickle.dumps(b)).kwargs) == {"labels"}


# ------------------------------------------------------------------ the kinds
def test_token_file_windows_are_seeded_contiguous_and_all_useful(tmp_path):
    token_file(tmp_path)
    job = job_file(tmp_path, data="tokens:train.bin")
    assert job.data == f"tokens:{tmp_path / 'train.bin'}"  # relative to the job file, made absolute
    first = [b[0].clone() for b in build_loader(job, 3, "cpu")]
    again = [b[0].clone() for b in build_loader(job, 3, "cpu")]
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # a rerun sees the same batches
    for x, y in build_loader(job, 3, "cpu"):
        assert torch.equal(y[:, :-1], x[:, 1:])  # one window of the file: targets are the next tokens
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 64, torch.ones_like(x[:, 1:]))  # contiguous in the file
        assert x.shape == (4, 16)


def test_uint32_token_files_and_wrong_dtype_sizes(tmp_path):
    token_file(tmp_path, dtype=np.uint32, vocab=60000)
    job = job_file(tmp_path, data="tokens:train.bin", data_dtype="uint32", vocab_size=60000)
    x, _ = next(iter(build_loader(job, 1, "cpu")))
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones_like(x[:, 1:]))  # 4-byte tokens, not pairs of 2-byte ones
    (tmp_path / "odd.bin").write_bytes(b"\0" * 4097)
    with pytest.raises(JobError, match=r"4,097 bytes.*data_dtype"):
        job_file(tmp_path, data="tokens:odd.bin")
    with pytest.raises(JobError, match=r"no such token file .*nope\.bin"):
        job_file(tmp_path, data="tokens:nope.bin")


def test_a_saved_dataset_is_read_and_its_padding_counted(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    rows = [list(range(1, 1 + n)) for n in (5, 9, 17, 30, 3, 12, 20, 8)]
    datasets.Dataset.from_dict({"ids": rows}).save_to_disk(str(tmp_path / "ds"))
    job = job_file(tmp_path, data="hf:ds", data_column="ids", vocab_size=64, steps=2, warmup_steps=0)
    feed = build_loader(job, 2, "cpu")
    t = run_steps(lambda x, y: torch.tensor(0.0), feed, torch.device("cpu"), 0, 2)
    expected = sum(min(len(r), 17) - 1 for r in rows)  # up to seq_len + 1 tokens a row, one target fewer
    assert sum(t.tokens) == expected
    with pytest.raises(JobError, match="data_column"):
        job_file(tmp_path, data="hf:ds", data_column="")
    bad = job_file(tmp_path, data="hf:ds", data_column="text")
    with pytest.raises(StepError, match="no column 'text'.*ids"):
        next(iter(build_loader(bad, 1, "cpu")))


def test_a_saved_dataset_is_split_over_ranks(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    datasets.Dataset.from_dict({"input_ids": [[i] * 4 for i in range(16)]}).save_to_disk(str(tmp_path / "ds"))
    job = job_file(tmp_path, data="hf:ds", micro_batch=2)
    seen = [{int(r[0]) for x, _ in build_loader(job, 4, "cpu", rank=k, world=2) for r in x} for k in (0, 1)]
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) == 16


def test_factory_dict_batches_count_useful_tokens_as_the_labels_say(user):
    job = job_file(user, data="userdata:data", model="userdata:lm")
    feed = build_loader(job, 5, "cpu")
    independent = 0
    for b in build_loader(job, 5, "cpu"):
        independent += int((b.kwargs["labels"][:, 1:] != -100).sum())
    model = build_model(job)
    t = run_steps(build_train_step(job, model, "cpu"), feed, torch.device("cpu"), 0, 5)
    assert sum(t.tokens) == independent
    assert independent < 5 * 4 * 15  # the -100 labels are not useful tokens


def test_the_loss_is_the_models_own_from_labels_and_equals_a_hand_computation(user):
    job = job_file(user, data="userdata:data", model="userdata:lm")
    assert job.vocab_size == 0  # a factory's default: its input embedding's
    model = build_model(job)
    ts = build_train_step(job, model, "cpu")
    assert ts.vocab_size == 64
    x, y = b = next(iter(build_loader(job, 1, "cpu")))
    labels = b.kwargs["labels"]
    logits = model(x).logits
    hand = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(ts.loss(x, y, **b.kwargs), hand)
    assert torch.allclose(ts.loss(x, y), hand)  # from the logits and the shifted targets: the same figure


def test_the_jobs_own_loss_function_gets_output_and_batch(user):
    job = job_file(user, data="userdata:data", model="userdata:lm", loss="userdata:mean_logit")
    model = build_model(job)
    x, y = b = next(iter(build_loader(job, 1, "cpu")))
    assert torch.allclose(build_train_step(job, model, "cpu").loss(x, y, **b.kwargs), model(x).logits.mean())


def test_a_user_dataloader_is_used_as_it_is_and_the_result_says_so(user):
    job = job_file(user, data="userdata:loader", model="userdata:lm")
    feed = build_loader(job, 3, "cpu")
    assert isinstance(feed, Feed) and "same batches" in " ".join(feed.notes)
    assert "num_workers" in feed.fixed
    assert [b[0].shape[0] for b in feed] == [2, 2, 2]  # its own batch size


def test_a_data_factory_is_refused_under_the_model_factorys_rule(user):
    with pytest.raises(JobError, match="standard library"):
        job_file(user, data="json:loads")
    with pytest.raises(JobError, match="no module nothere"):
        job_file(user, data="nothere:data")


# ------------------------------------------------------------------ the vocabulary
def test_a_vocabulary_mismatch_names_both_sizes_and_the_key(user):
    job = job_file(user, model="userdata:lm", model_kwargs={"vocab": 32}, vocab_size=64)
    model = build_model(job)
    x, y = next(iter(build_loader(job, 1, "cpu")))
    with pytest.raises(StepError) as e:
        build_train_step(job, model, "cpu").loss(x, y)
    assert "32 rows" in str(e.value) and f"token id {int(x.max())}" in str(e.value) and "vocab_size" in str(e.value)
    fine = job_file(user, model="userdata:lm", model_kwargs={"vocab": 32})  # vocab_size 0: the model's 32
    x, y = next(iter(build_loader(fine, 1, "cpu")))
    assert int(x.max()) < 32
    build_train_step(fine, build_model(fine), "cpu").loss(x, y)


def test_vocab_size_zero_is_for_a_factory_only():
    with pytest.raises(JobError, match="reference gpt"):
        validate({"vocab_size": 0}, "t")


# ------------------------------------------------------------------ data wait
@pytest.mark.parametrize("kind", ["synthetic", "tokens", "hf", "factory"])
def test_a_slow_loader_shows_as_data_wait_of_at_least_its_sleep(user, kind):
    keys = {"num_workers": 0, "synthetic_load_ms": 50.0}
    if kind == "tokens":
        token_file(user)
        keys["data"] = "tokens:train.bin"
    elif kind == "hf":
        datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
        datasets.Dataset.from_dict({"input_ids": [[1] * 20] * 8}).save_to_disk(str(user / "ds"))
        keys["data"] = "hf:ds"
    elif kind == "factory":
        keys = {"num_workers": 0, "data": "userdata:slow"}  # the factory's own sleep, 50 ms a batch
    job = job_file(user, **keys)
    t = run_steps(lambda x, y, **kw: torch.tensor(0.0), build_loader(job, 3, "cpu"), torch.device("cpu"), 0, 3)
    assert min(t.data_s) >= 0.050


def test_side_by_side_candidates_get_the_same_batches_from_a_shuffling_loader(user):
    job = job_file(user, data="userdata:shuffled", model="userdata:lm")
    first = [b[0] for b in same_batches(job, 4, "cpu")]
    again = [b for b in same_batches(job, 4, "cpu")]
    assert all(torch.equal(a, b[0]) for a, b in zip(first, again)) and len(again) == 4
    assert all(set(b.kwargs) == {"labels", "attention_mask"} for b in again)  # saved with their keyword tensors
    assert list((job.output_root() / ".batches").glob("*.pt"))
    plain = job_file(user, data="userdata:data", model="userdata:lm")
    assert isinstance(same_batches(plain, 2, "cpu"), Feed)  # mfu-lab's own loader: the same batches already


def test_a_saved_dataset_packs_into_full_rows(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    datasets.Dataset.from_dict({"input_ids": [list(range(1, n)) for n in (5, 9, 17, 30, 3, 12)]}).save_to_disk(
        str(tmp_path / "ds"))
    job = job_file(tmp_path, data="hf:ds", seq_policy="pack")
    shapes = [tuple(x.shape) for x, _ in build_loader(job, 3, "cpu")]
    assert shapes == [(4, 16)] * 3  # rows laid end to end (epochs of the 6 rows), no padding
