"""Reading torch.profiler traces: events, the indexed trace, the breakdown and top-N, fusion candidates, and the
monitor window's reader (``python -m mfu_lab.analysis.trace.window``). Imports nothing here: no torch on that path."""
