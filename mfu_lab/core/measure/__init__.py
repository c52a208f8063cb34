"""Measurement: timed steps, the peak and its cache, contention, device health, the host's memory and cores (its
cgroup's limits included), FLOPs, collectives counted, the ledger and side-by-side rounds. Builds no model and
applies no layout (core.engine does); writes no result file."""
