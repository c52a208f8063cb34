"""Every threshold the workbook's advice and checks use, named once.

Some are practitioners' rules of thumb (throttling above 80 °C, communication under 15% of the step), said so
on their line; the rest are the workbook's own choices for when a figure is worth a line of advice.
"""

# --- the device
HOT_C = 80.0  # practitioners' rule: sustained GPU temperatures above 80 °C mean throttling; the gate's default
CLOCK_LOW = 0.90  # busy SM clock below 90% of the rated clock (core.measure.health), with a power or thermal reason

# --- where the step time goes (steps 1 and 3)
DATA_WAIT_LIMIT = 0.03  # above 3% of the step, the loader is worth fixing first
HOST_LIMIT = 0.05  # host time above 5% of the step: per-step host work is visible
CV_LIMIT = 0.10  # step times spread more than 10% (coefficient of variation): results are noisy
IDLE_LIMIT = 0.20  # device idle (host-bound) above this share of the profiled step
COMM_LIMIT = 0.15  # practitioners' rule: aim for communication under 15% of step time
FUSION_LIMIT = 0.02  # a fusion candidate whose runs take 2% of the step is worth acting on
MEMORY_BOUND_LIMIT = 0.30  # memory-bound kernels above 30% of the step: fusing or compiling pays
OPTIMIZER_LIMIT = 0.10  # the optimizer above 10% of the step: a fused or foreach optimizer pays
PROFILER_OVERHEAD_LIMIT = 0.10  # profiling slowed the step by more than this: shares are of a slower step

# --- a shared machine (core.measure.contention)
CONTENTION_CORES = 0.25  # other processes kept at least a quarter of a core busy while we measured...
CONTENTION_SHARE = 0.10  # ...and at least 10% of the cores we may use: the timings are of a shared machine
PEAK_RECHECK_FLOOR = 0.05  # a peak re-check is contention when its probes' p90 lies more than 5% under the cache:
# a 2-core VM's host drifts by a few % between runs (98% and 96% re-checks, step times +-3-8%), a neighbour by more

# --- agreement between two figures
FLOP_TOLERANCE = 0.02  # counted vs analytic FLOPs above 2% is shown as a disagreement

# --- racing sweeps (analysis.racing)
RACE_NOISE_FLOOR = 0.03  # a candidate whose median is within 3% of the leader's is inside its noise band
RACE_KEEP_SHARE = 1 / 3  # successive halving's cut: at most a third of the field goes on (references aside)...
DDP_SYNC_TOLERANCE = 1e-6  # parameter checksum difference across ranks above which they are out of sync
RACE_CONFIRM_TURNS = 3  # a sweep's pick and its reference alternated this many times each before it stands
RACE_MAX_FINALISTS = 4  # ...and at most 4 candidates (at least 2), so a flat field of 40 does not keep 13
