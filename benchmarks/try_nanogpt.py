"""Try the production monitor inside nanoGPT's own train.py, with the README's lines. Not a test.

    python benchmarks/try_nanogpt.py [--nanogpt DIR] [--out DIR] [--slow-ms 30] [--grad-accum 1]
                                     [--max-iters 12] [--timeout-s 600] [--no-other] [--accum-tokens]

Issue 31's check: the monitor's FLOPs per token within 3% of nanoGPT's ``estimate_mfu`` formula (nanoGPT's
evaluation at iteration 0 left in place), and an injected slow ``get_batch`` seen as data wait.

1. nanoGPT: ``--nanogpt DIR`` (a checkout), else HEAD of the bare mirror at ``NANOGPT_MIRROR`` (default
   ``/work/.mirror/karpathy+nanoGPT/repo``) extracted with ``git archive``. It is always copied into the work
   folder and only the copy is changed; nothing of nanoGPT is kept in this repository.
2. A tiny data set in nanoGPT's format in the copy's ``data/<name>/``: ``train.bin`` and ``val.bin`` (uint16 random
   tokens, as ``np.memmap`` reads them) and ``meta.pkl`` with ``vocab_size`` 65 (as shakespeare_char's
   ``prepare.py`` writes it).
3. The copy's ``train.py`` gets exactly the README's lines, each placed at an anchor found by its text (the run
   stops with an error when an anchor is missing or not unique): the import; ``mon = Monitor(DIR,
   model=model).start()`` before the training loop; ``with mon.other():`` around ``losses = estimate_loss()``
   (the README's optional line; ``--no-other`` leaves it out); ``with mon.fetch():`` around the loop's
   ``X, Y = get_batch('train')``; ``mon.step(tokens=X.numel())`` before ``iter_num += 1``; ``mon.close()`` after
   the loop. ``--slow-ms N`` adds ``time.sleep(N / 1000)`` at the top of ``get_batch`` (every split).
4. It runs on the CPU with nanoGPT's configurator overrides (``--device=cpu --compile=False --dtype=float32
   --eval_iters=2 --eval_interval=5 --log_interval=1 --block_size=64 --batch_size=4 --n_layer=2 --n_head=2
   --n_embd=64 --max_iters=12 --gradient_accumulation_steps=1 ...``), the evaluation at iteration 0 in place,
   under a timeout, in a process group of its own that is killed with everything in it when the time is up.
5. The monitor's records are read with mfu_lab's reader (``mfu_lab.core.store.monitor_files``) and a table printed:
   the monitor's FLOPs per token (its ``flops`` record) against nanoGPT's formula ``6N + 12 L H Q T`` (N =
   ``model.get_num_params()`` of nanoGPT's own ``model.py`` from the copy, built with the same config), their
   ratio, the step that was counted, and the data wait per timed step against the injected sleep.

Exit 1 when the ratio is outside [0.97, 1.03], when no training step was counted, or, with ``--slow-ms``, when
the data wait per step is below the injected sleep per step (``--slow-ms`` x micro-steps); 2 when nanoGPT
could not be set up or its run failed.

With ``--grad-accum N`` (N > 1) the README's ``tokens=X.numel()`` counts one micro-batch, not the step's N:
the monitor's FLOPs per token is then N times nanoGPT's (its MFU, which uses the same token count on both sides,
is not affected); the table shows the per-step figure divided by the step's real tokens beside it.
``--accum-tokens`` passes ``tokens=X.numel() * gradient_accumulation_steps`` instead (the step's tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mfu_lab.core.store.monitor_files import ReadCount, iter_records, rank_files  # noqa: E402

MIRROR = os.environ.get("NANOGPT_MIRROR", "/work/.mirror/karpathy+nanoGPT/repo")
DATASET = "mfu_lab_tiny"
VOCAB = 65
TOLERANCE = 0.03


class SetupError(RuntimeError):
    pass


# ------------------------------------------------------------------ 1. nanoGPT, copied
def nanogpt_copy(source: str | None, dest: Path) -> str:
    """Put a copy of nanoGPT in ``dest``; return where it came from."""
    if source:
        src = Path(source).resolve()
        if not (src / "train.py").is_file() or not (src / "model.py").is_file():
            raise SetupError(f"{src}: no train.py and model.py (not a nanoGPT checkout)")
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".git", "out*", "__pycache__"))
        return str(src)
    if not Path(MIRROR).exists():
        raise SetupError(f"no --nanogpt given and no mirror at {MIRROR} (set NANOGPT_MIRROR)")
    dest.mkdir(parents=True)
    commit = subprocess.run(["git", f"--git-dir={MIRROR}", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", f"--git-dir={MIRROR}", "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return f"{MIRROR} at {commit[:12]}"


# ------------------------------------------------------------------ 2. the data set
def write_dataset(nanogpt: Path, seed: int = 0) -> Path:
    folder = nanogpt / "data" / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train.bin", 50_000), ("val.bin", 5_000)):
        rng.integers(0, VOCAB, size=n, dtype=np.uint16).tofile(folder / name)
    chars = [chr(32 + i) for i in range(VOCAB)]  # shakespeare_char's meta: vocab_size, itos, stoi
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return folder


# ------------------------------------------------------------------ 3. the README's lines, at their anchors
def _once(text: str, anchor: str, what: str) -> int:
    n = text.count(anchor)
    if n != 1:
        raise SetupError(f"train.py: the anchor for {what} ({anchor!r}) occurs {n} times, not once: this nanoGPT's "
                         "train.py differs from the one the script knows")
    return text.index(anchor)


def _replace(text: str, anchor: str, new: str, what: str) -> str:
    _once(text, anchor, what)
    return text.replace(anchor, new)


def patch_train(train_py: Path, mon_dir: Path, slow_ms: float, other: bool, accum_tokens: bool = False) -> list[str]:
    """Insert the README's lines into ``train_py``; return them as inserted (for the printout)."""
    text = train_py.read_text()
    added: list[str] = []

    def edit(anchor: str, new: str, what: str) -> None:
        nonlocal text
        text = _replace(text, anchor, new, what)
        added.extend(line for line in new.splitlines() if line.strip() and line not in anchor.splitlines())

    edit("from model import GPTConfig, GPT\n",
         "from model import GPTConfig, GPT\nfrom mfu_lab.monitor import Monitor\n", "the import")
    edit("X, Y = get_batch('train') # fetch the very first batch\n",
         f"mon = Monitor({str(mon_dir)!r}, model=model).start()\n"
         "X, Y = get_batch('train') # fetch the very first batch\n", "the Monitor")
    if other:
        edit("        losses = estimate_loss()\n",
             "        with mon.other():\n            losses = estimate_loss()\n", "the evaluation (mon.other())")
    edit("        X, Y = get_batch('train')\n",
         "        with mon.fetch():\n            X, Y = get_batch('train')\n", "the loop's fetch (mon.fetch())")
    tokens = "X.numel() * gradient_accumulation_steps" if accum_tokens else "X.numel()"
    edit("    iter_num += 1\n", f"    mon.step(tokens={tokens})\n    iter_num += 1\n", "the step (mon.step())")
    edit("if ddp:\n    destroy_process_group()", "mon.close()\nif ddp:\n    destroy_process_group()",
         "the end of the loop (mon.close())")
    if slow_ms:
        edit("def get_batch(split):\n", f"def get_batch(split):\n    time.sleep({slow_ms / 1000!r}) # injected\n",
             "get_batch (the injected sleep)")
    train_py.write_text(text)
    return added


# ------------------------------------------------------------------ 4. the run
def overrides(a, out_dir: Path) -> list[str]:
    return ["--device=cpu", "--compile=False", "--dtype=float32", f"--eval_iters={a.eval_iters}",
            f"--eval_interval={a.eval_interval}", "--log_interval=1", f"--block_size={a.block_size}",
            f"--batch_size={a.batch_size}", f"--n_layer={a.n_layer}", f"--n_head={a.n_head}",
            f"--n_embd={a.n_embd}", f"--max_iters={a.max_iters}", f"--gradient_accumulation_steps={a.grad_accum}",
            f"--dataset={DATASET}", "--always_save_checkpoint=False", f"--out_dir={out_dir}"]


def run_train(nanogpt: Path, args: list[str], timeout_s: float, log: Path) -> tuple[int, float]:
    """Run the patched train.py in a session of its own; on timeout kill that process group. (rc, seconds)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=nanogpt, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:  # the timeout, or ^C here: the child and everything it started end with it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            rc = 124
        else:
            try:  # anything the run left behind in its group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, time.perf_counter() - t0


# ------------------------------------------------------------------ 5. the figures
def nanogpt_flops_per_token(nanogpt: Path, a) -> tuple[float, int]:
    """nanoGPT's estimate_mfu formula per token, with N from its own model.py (the copy), same config."""
    spec = importlib.util.spec_from_file_location("nanogpt_model_copy", nanogpt / "model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size,
                        bias=False, vocab_size=VOCAB, dropout=0.0)
    model = mod.GPT(cfg)
    n = model.get_num_params()
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
    return float(6 * n + 12 * L * H * Q * T), n


def read_monitor(mon_dir: Path) -> dict[str, list[dict]]:
    files = rank_files(mon_dir)
    if not files:
        return {}
    count = ReadCount()
    out: dict[str, list[dict]] = {}
    for rf in files:
        for rec in iter_records(rf.paths, count):
            out.setdefault(rec["kind"], []).append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", help="a nanoGPT checkout (copied; default: HEAD of the mirror, extracted)")
    p.add_argument("--out", help="work folder, kept (default: a temporary folder, deleted at the end)")
    p.add_argument("--slow-ms", type=float, default=0.0, help="sleep injected at the top of get_batch, ms")
    p.add_argument("--grad-accum", type=int, default=1, help="nanoGPT's gradient_accumulation_steps")
    p.add_argument("--max-iters", dest="max_iters", type=int, default=12)
    p.add_argument("--eval-interval", dest="eval_interval", type=int, default=5)
    p.add_argument("--eval-iters", dest="eval_iters", type=int, default=2)
    p.add_argument("--block-size", dest="block_size", type=int, default=64)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=4)
    p.add_argument("--n-layer", dest="n_layer", type=int, default=2)
    p.add_argument("--n-head", dest="n_head", type=int, default=2)
    p.add_argument("--n-embd", dest="n_embd", type=int, default=64)
    p.add_argument("--no-other", action="store_true", help="leave the README's optional mon.other() out")
    p.add_argument("--accum-tokens", action="store_true",
                   help="mon.step(tokens=X.numel() * gradient_accumulation_steps): the step's tokens")
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args(argv)

    tmp = None
    if a.out:
        work = Path(a.out).resolve()
        if work.exists() and any(work.iterdir()):
            print(f"--out {work}: not empty; give a new or empty folder", file=sys.stderr)
            return 2
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="try_nanogpt-")
        work = Path(tmp.name)
    try:
        return _run(a, work)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(a, work: Path) -> int:
    nanogpt, out_dir, mon_dir, log = work / "nanoGPT", work / "out", work / "mon", work / "train.log"
    try:
        source = nanogpt_copy(a.nanogpt, nanogpt)
        write_dataset(nanogpt)
        added = patch_train(nanogpt / "train.py", mon_dir, a.slow_ms, not a.no_other, a.accum_tokens)
    except (SetupError, subprocess.CalledProcessError, OSError) as e:
        print(f"setup failed: {e}", file=sys.stderr)
        return 2
    print(f"nanoGPT: {source} (copied to {nanogpt}; train.py patched there)")
    print("lines added to train.py (the README's):")
    for line in added:
        print(f"    {line}")
    args = overrides(a, out_dir)
    print(f"running: python train.py {' '.join(args)}")
    rc, secs = run_train(nanogpt, args, a.timeout_s, log)
    text = log.read_text(errors="replace")
    if rc != 0:
        print(text[-4000:])
        why = f"timed out after {a.timeout_s:.0f} s" if rc == 124 else f"failed (exit {rc})"
        print(f"train.py {why}", file=sys.stderr)
        return 2
    evals = [ln for ln in text.splitlines() if ln.startswith("step ") and "val loss" in ln]
    print(f"train.py ran in {secs:.1f} s; nanoGPT's evaluations: {'; '.join(evals) or 'none'}")

    formula, n_params = nanogpt_flops_per_token(nanogpt, a)
    recs = read_monitor(mon_dir)
    flops = (recs.get("flops") or [{}])[-1]
    intervals = recs.get("interval", [])
    end = (recs.get("end") or [{}])[-1]
    tokens_per_step = a.batch_size * a.block_size * a.grad_accum
    per_token = flops.get("per_token")
    per_step = flops.get("per_step")

    steps = sum(r["steps"] for r in intervals)
    data_steps = sum(r.get("data_timed_steps") or 0 for r in intervals)
    data_s = sum(r["data_s"] or 0.0 for r in intervals if r.get("data_timed"))
    other_s = sum(r.get("other_s") or 0.0 for r in intervals)
    data_per_step = data_s / data_steps if data_steps else None
    injected = a.slow_ms / 1000 * a.grad_accum
    ratio = per_token / formula if per_token else None

    def f(x, fmt="{:,.0f}"):
        return "-" if x is None else fmt.format(x)

    rows = [
        ("nanoGPT estimate_mfu, FLOPs/token", f(formula), f"6N + 12*L*H*Q*T, N = get_num_params() = {n_params:,}"),
        ("monitor, FLOPs/token (recorded)", f(per_token), f"per_step / tokens given to step() ({flops.get('tokens')})"),
        ("ratio monitor / nanoGPT", f(ratio, "{:.4f}"), f"must lie in [{1 - TOLERANCE:.2f}, {1 + TOLERANCE:.2f}]"),
        ("monitor, FLOPs/step", f(per_step), f"/ {tokens_per_step} tokens per step = "
         f"{f(per_step / tokens_per_step if per_step else None)} per token"),
        ("step counted", f(flops.get("step"), "{}"), f"{flops.get('window')}; windows rejected: "
         f"{len(flops.get('rejected_windows') or [])}; source {flops.get('source')}"),
        ("data wait per step", f(data_per_step * 1e3 if data_per_step is not None else None, "{:.2f} ms"),
         f"over {data_steps} timed steps of {steps}" + (f"; injected {injected * 1e3:.1f} ms per step "
                                                         f"({a.slow_ms:g} ms x {a.grad_accum} fetch)"
                                                         if a.slow_ms else "; nothing injected")),
        ("median step", f(intervals[-1]["step_s"]["median"] * 1e3 if intervals else None, "{:.2f} ms"),
         f"evaluation marked by mon.other(): {other_s:.3f} s over the run"),
        ("MFU (monitor)", f(intervals[-1]["mfu"] * 100 if intervals and intervals[-1].get("mfu") is not None
                            else None, "{:.3f} %"), "against this CPU's measured matmul peak"),
        ("monitor's own errors", json.dumps(end.get("errors", {})), f"end record: {end.get('reason', 'missing')}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"  {name:<{w0}}  {value:>{w1}}  {note}")
    print()

    failures = []
    if ratio is None:
        failures.append(f"no training step's FLOPs were counted: {flops.get('note', 'no flops record')}")
    elif abs(ratio - 1) > TOLERANCE:
        failures.append(f"FLOPs per token: the monitor's is {ratio:.4f} x nanoGPT's (outside +-{TOLERANCE:.0%})")
    if a.slow_ms:
        if data_per_step is None:
            failures.append("the data wait was not timed")
        elif data_per_step < injected:
            failures.append(f"data wait {data_per_step * 1e3:.2f} ms per step, below the injected "
                            f"{injected * 1e3:.1f} ms")
    for msg in failures:
        print(f"FAIL: {msg}")
    if not failures:
        print("PASS: FLOPs per token within 3% of nanoGPT's formula"
              + (", the injected sleep seen as data wait" if a.slow_ms else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
