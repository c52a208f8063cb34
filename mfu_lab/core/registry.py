"""The step registry: each step's key, number, output folder (= notebook stem), title and module.

Every other module names a step by its key and asks the registry for the rest."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    key: str  # used on the command line: --steps baseline
    number: int
    folder: str  # output folder and notebook stem, e.g. 01_baseline
    title: str
    module: str

    @property
    def notebook(self) -> str:
        return f"{self.folder}.ipynb"

    def load(self):
        return importlib.import_module(self.module)



STEPS: tuple[StepInfo, ...] = (
    StepInfo("baseline", 1, "01_baseline", "Baseline: where does the step time go today?",
             "mfu_lab.steps.baseline.step"),
    StepInfo("attention_comm", 2, "02_attention_and_comm",
             "Attention kernels and gradient communication: what do they give back?",
             "mfu_lab.steps.attention_comm.step"),
    StepInfo("kernels", 3, "03_kernels", "Kernels: which eat the time, and which adjacent operations could be fused?",
             "mfu_lab.steps.kernels.step"),
    StepInfo("compile", 4, "04_compile", "Compile: does torch.compile pay for itself at fixed shapes?",
             "mfu_lab.steps.compile.step"),
    StepInfo("fp8", 5, "05_fp8", "Precision: which of TF32, bf16/fp16 and FP8 is faster here and keeps the loss "
             "curve?", "mfu_lab.steps.fp8.step"),
    StepInfo("placement", 6, "06_placement", "Placement: where should this job run on a shared cluster, and at what "
             "size is it most efficient?", "mfu_lab.steps.placement.step"),
    StepInfo("verify", 7, "07_verify", "Verify: how much did the workflow give back on this job, measured side by "
             "side?", "mfu_lab.steps.verify.step"),
)
BY_KEY = {s.key: s for s in STEPS}
