"""The production monitor against Hugging Face's own FLOP figure on the same run: a ``transformers.Trainer`` training
a GPT-2 (``GPT2LMHeadModel``, a small random-init config: nothing downloaded) on the CPU with mfu_lab's
``MonitorCallback``, then both figures for the same optimizer steps:

- Hugging Face's ``trainer.state.total_flos``: ``model.floating_point_ops`` per batch, the estimate
  ``6 x tokens x parameters``, embeddings left out (``num_parameters(exclude_embeddings=True)``), over the steps;
- mfu_lab's FLOPs per optimizer step, counted over one real step by the workbook's counter (matmuls and attention).

They do not agree, and the script says by how much each named term accounts for the gap, from the model's shapes:

    counted = 6 x T x N_ne                 (HF's estimate)
              - 6 x T x (biases + norms)   (in HF's N, but an addmm's bias and a LayerNorm are not matmul FLOPs)
              + 6 x T x V x d              (the head: GPT-2 ties it to the token embedding, which HF leaves out)
              + 12 x T x s x d x L         (attention's two matmuls, forward and backward, the full s x s square)

with T tokens per step, V the vocabulary, d the width, s the sequence, L the layers.

    python benchmarks/try_hf.py [--steps 20] [--layers 2] [--width 128] [--vocab 1000] [--seq 64] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(reconcile(**{k: v for k, v in vars(args).items() if k != "out"},
                    out=args.out or Path(tempfile.mkdtemp(prefix="try_hf_")))["text"])


def reconcile(steps: int, layers: int, width: int, heads: int, vocab: int, seq: int, batch: int, out: Path) -> dict:
    """Train, and return both figures per optimizer step, the named terms and a text (see the module docstring)."""
    import transformers

    from mfu_lab.monitor.hf import MonitorCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                                     attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, ((steps + 2) * batch, seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    targs = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=steps, per_device_train_batch_size=batch, report_to=[],
        save_strategy="no", use_cpu=True, logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen=True, learning_rate=1e-4)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data,
                                   callbacks=[MonitorCallback(out / "mon", every=max(2, steps // 4),
                                                              peak_flops=1e12, profile_every_s=None)])
    trainer.train()
    recs = [json.loads(line) for f in sorted((out / "mon").glob("*.jsonl")) for line in f.read_text().splitlines()]
    counted = next(r for r in recs if r["kind"] == "flops")["per_step"]
    hf = trainer.state.total_flos / steps
    tokens = batch * seq
    n_ne = model.num_parameters(exclude_embeddings=True)
    not_matmul = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias") or ".ln_" in n
                     or n.startswith("transformer.ln_f"))
    terms = {"HF's estimate, 6 x T x N_ne": 6 * tokens * n_ne,
             "- biases and norms (in N_ne, no matmul)": -6 * tokens * not_matmul,
             "+ the head (tied to the embedding HF leaves out)": 6 * tokens * vocab * width,
             "+ attention's matmuls (the full s x s square)": 12 * tokens * seq * width * layers}
    predicted = sum(terms.values())
    lines = [f"GPT2LMHeadModel, {layers} layers, width {width}, vocab {vocab}, {batch} x {seq} tokens a step, "
             f"{steps} steps on the CPU (transformers {transformers.__version__}, torch {torch.__version__})",
             f"FLOPs per optimizer step: Hugging Face's total_flos / steps {hf:,.0f}; mfu_lab counted {counted:,.0f} "
             f"({counted / hf:.3f}x HF's)", "the gap, term by term, from the model's shapes:"]
    lines += [f"  {name:52s} {value:>16,.0f}" for name, value in terms.items()]
    lines.append(f"  {'= predicted':52s} {predicted:>16,.0f} (counted / predicted {counted / predicted:.6f})")
    return {"counted": counted, "hf": hf, "terms": terms, "predicted": predicted, "text": "\n".join(lines)}


if __name__ == "__main__":
    main()
