"""The workers: the ``python -m`` entry points that torchrun and fresh processes run, and the parent side that
launches them. Imports the core and the analysis layers, never a step or the presentation."""
