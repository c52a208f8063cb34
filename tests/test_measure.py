import time

import numpy as np
import pytest
import torch

from mfu_lab.core.measure.timed import percentile, run_steps, stats


def test_stats_match_numpy():
    xs = [0.3, 0.1, 0.2, 0.5, 0.4, 0.9, 0.35]
    s = stats(xs)
    assert s.median == pytest.approx(np.median(xs))
    assert s.p10 == pytest.approx(np.percentile(xs, 10))
    assert s.p90 == pytest.approx(np.percentile(xs, 90))
    assert s.cv == pytest.approx(np.std(xs, ddof=1) / np.mean(xs))
    assert percentile([1.0], 50) == 1.0
    with pytest.raises(ValueError):
        stats([])


class SlowBatches:
    """Yields batches after ``delay`` seconds each: a loader whose wait time is known."""

    def __init__(self, delay):
        self.delay = delay

    def __iter__(self):
        while True:
            time.sleep(self.delay)
            yield torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)


def test_data_and_compute_time_are_split_correctly():
    def step(x, y):
        time.sleep(0.03)  # known compute time
        return torch.tensor(1.0)

    seen = []
    t = run_steps(step, SlowBatches(0.02), torch.device("cpu"), warmup=1, steps=4,
                  progress=lambda d, n, e: seen.append(d))
    assert len(t.wall_s) == 5 and t.warmup_steps == 1 and len(t.measured("wall_s")) == 4
    for w, d, c in zip(t.measured("wall_s"), t.measured("data_s"), t.measured("compute_s")):
        assert d == pytest.approx(0.02, abs=0.015)
        assert c == pytest.approx(0.03, abs=0.015)
        assert w >= d + c
    assert seen == [1, 2, 3, 4, 5]
    assert t.loss == [1.0] * 5


def test_no_profiled_step_pays_for_the_trace_export(tmp_path, monkeypatch):
    """The export runs after the loop: an export made 2 s slower on purpose shows in no step's time."""
    from torch.profiler import profile

    from mfu_lab.core.measure.timed import profile_steps

    real = profile.export_chrome_trace

    def slow_export(self, path):
        time.sleep(2.0)
        return real(self, path)

    monkeypatch.setattr(profile, "export_chrome_trace", slow_export)
    batches = ((torch.randn(8, 8), torch.randn(8, 8)) for _ in range(6))
    t = profile_steps(lambda x, y: (x @ y).sum(), batches, torch.device("cpu"), 2, 3, tmp_path / "t.json")
    assert (tmp_path / "t.json").is_file() and len(t.wall_s) == 5
    assert max(t.wall_s) < 2.0  # the injected export time is in none of them


def test_the_profiled_window_closes_before_the_contention_probe_ends(tmp_path, monkeypatch):
    """The last ProfilerStep span ends right after the loop, before the contention probe's end (NVML and a walk of
    the process tree: about 31 ms of the first H200 run's 5-step window, +16%). An injected 0.6 s in the probe's
    end lies outside the window: the spans sum to about the steps' walls, not to them plus 0.6 s."""
    import gzip
    import json
    import time

    from mfu_lab.core.measure import contention
    from mfu_lab.core.measure.timed import profile_steps

    real_exit = contention.ContentionProbe.__exit__

    def slow_exit(self, *exc):
        time.sleep(0.6)
        return real_exit(self, *exc)

    monkeypatch.setattr(contention.ContentionProbe, "__exit__", slow_exit)
    batches = ((torch.randn(8, 8), torch.randn(8, 8)) for _ in range(5))
    t = profile_steps(lambda x, y: (x @ y).sum(), batches, torch.device("cpu"), 2, 3, tmp_path / "t.json.gz")
    events = json.loads(gzip.open(tmp_path / "t.json.gz").read())["traceEvents"]
    spans = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"]
    window_s = sum(e["dur"] for e in spans) / 1e6
    assert len(spans) == 3
    assert window_s < sum(t.measured("wall_s")) + 0.3  # not the injected 0.6 s
