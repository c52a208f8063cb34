"""The analysis layer: pure functions over data (attention checks, traces, recompiles, FP8 numerics, the placement
model and cluster files), like HTA's analyzers. Imports only the core."""
