"""Results on disk: atomic files, result records, the step results store, run history and state, locks, staging,
nodes' files and the monitor's record files. Imports no torch, and nothing that trains or measures."""
