"""A small MLP regression (denoising) model, for the job file parameters/regression.yaml: batches of
``(input, target)`` float tensors and a ``loss:`` factory instead of token ids."""
