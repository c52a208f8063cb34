"""Reading a production monitor folder: the record check, the runs and clock offsets, the streaming read and the
summary with its verdicts. Pure functions over files; never the writer (mfu_lab.monitor)."""
