"""What to tell the scheduler for step 6's chosen placement: a Slurm batch script and Kueue annotations that
keep the job under the fewest leaf switches, with the health gate (``mfu-lab gate``) run before the launch.
"""

from __future__ import annotations

from mfu_lab.analysis.placement.cluster_files import Cluster
from mfu_lab.analysis.placement.model import Prediction
from mfu_lab.core.job.schema import Job
from mfu_lab.core.thresholds import HOT_C


def hints(job: Job, cluster: Cluster, pred: Prediction, health: dict | None) -> dict[str, str]:
    """For the chosen placement: a Slurm batch script (``--switches`` for the fewest leaf switches, ``--exclusive``)
    with a health gate before the launch, Kueue topology-aware scheduling annotations, and the gate explained
    (with step 1's health readings when it sampled them). Keys: slurm, kueue, gate."""
    lay = pred.layout
    g = cluster.gpus_per_node
    nodes = sorted({x // g for x in pred.gpus})
    per_node = min(lay.gpus, g)
    switches = len({cluster.node_switch[n] for n in nodes})
    name = job.job_name
    gate = (f"srun --ntasks-per-node=1 python -m mfu_lab gate --max-temp-c {HOT_C:g} "
            "|| { echo 'health gate failed: drain the node named above'; exit 1; }")
    trainer = (f"train.py --tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp}"
               + (f" --num-layers-per-virtual-pipeline-stage {job.n_layers // lay.pp // lay.v}" if lay.v > 1 else "")
               + f" --micro-batch-size {job.micro_batch} --global-batch-size {job.global_batch}")
    slurm = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={len(nodes)}",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --switches={switches}@00:30:00   # at most {switches} leaf switch(es); wait up to 30 min for them",
        "#SBATCH --exclusive                  # no neighbour on these nodes' NICs",
        "",
        "# health gate: every node's GPUs cool and unthrottled before the gang starts",
        gate,
        "",
        "head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        f"srun torchrun --nnodes=\"$SLURM_NNODES\" --nproc-per-node={per_node} --rdzv-backend=c10d \\",
        "    --rdzv-endpoint=\"$head:29500\" --rdzv-id=\"$SLURM_JOB_ID\" \\",
        f"    {trainer}",
        "# (Megatron-LM's argument names for the layout; map them to your trainer's)",
    ])
    pods = len(nodes)
    level = "cloud.provider.com/topology-rack" if switches == 1 else "cloud.provider.com/topology-block"
    kueue = "\n".join([
        "# Kueue topology-aware scheduling (a JobSet / Job pod template); the label names are your",
        "# cluster's Topology levels (these are Kueue's examples)",
        "metadata:",
        "  labels:",
        "    kueue.x-k8s.io/queue-name: training",
        "spec:",
        f"  parallelism: {pods}",
        f"  completions: {pods}",
        "  template:",
        "    metadata:",
        "      annotations:",
        f"        kueue.x-k8s.io/podset-required-topology: \"{level}\""
        + ("   # the whole gang in one rack" if switches == 1 else "   # within one block of racks"),
        "        kueue.x-k8s.io/podset-slice-required-topology: \"kubernetes.io/hostname\"",
        "        kueue.x-k8s.io/podset-slice-size: \"1\"   # one pod per node, holding its TP group",
        "    spec:",
        "      containers:",
        "      - name: trainer",
        "        resources:",
        f"          limits: {{nvidia.com/gpu: {per_node}}}",
    ])
    ref = ""
    if health and health.get("sampled"):
        ref = (f"Step 1 ran at {health.get('temperature_c_max')} °C peak, SM clock "
               f"{(health.get('sm_clock_mhz_mean') or 0):.0f} of {health.get('sm_clock_mhz_max_supported')} MHz.")
    gate_text = (f"mfu-lab gate reads every GPU through NVML and fails (exit 1) when one is above "
                 f"{HOT_C:g} °C or shows a thermal, power-brake or hardware slowdown reason, naming the "
                 "GPU so the node can be drained before it slows the whole gang. " + ref)
    return {"slurm": slurm, "kueue": kueue, "gate": gate_text}
