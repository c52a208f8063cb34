"""Batches the Hugging Face way from a nanoGPT-style token file: dicts of ``input_ids``, ``labels`` (−100 where a
row is padding) and ``attention_mask``, rows of varying length as documents are. The data factory named by
``parameters/own_data_dicts.yaml`` (``data: examples.hf_batches:documents``).

A factory that takes ``rank`` and ``world_size`` gets them; returning a map-style ``Dataset`` lets mfu-lab split
it over data-parallel ranks (``DistributedSampler``) and set the DataLoader's knobs (num_workers...).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent


class Documents(Dataset):
    """Row i: a seeded window of the token file, of a seeded length in [seq_len // 4, seq_len], right-padded."""

    def __init__(self, path: Path, seq_len: int = 256, rows: int = 4096, pad_id: int = 0):
        self.path, self.seq_len, self.rows, self.pad_id = Path(path), seq_len, rows, pad_id
        self.tokens = self.path.stat().st_size // 2
        self._data = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._data is None:  # opened in the process that reads it (DataLoader workers included)
            self._data = np.memmap(self.path, dtype=np.uint16, mode="r")
        rng = np.random.default_rng(i)
        n = int(rng.integers(self.seq_len // 4, self.seq_len + 1))
        start = int(rng.integers(0, self.tokens - n))
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        ids[:n] = torch.from_numpy(self._data[start:start + n].astype(np.int64))
        mask = (torch.arange(self.seq_len) < n).long()
        return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def documents(rank: int = 0, world_size: int = 1, path: str = str(HERE / "data" / "train.bin"), seq_len: int = 256):
    """The example's data; its token file is written on first use (examples/make_train_bin.py, offline)."""
    if not Path(path).is_file():
        import sys

        sys.path.insert(0, str(HERE))
        from make_train_bin import ensure

        ensure(path)  # ranks that write it at once each write it whole
    return Documents(Path(path), seq_len)
