"""A small vision transformer (ViT) in plain PyTorch, for the job file parameters/vision.yaml: batches of
``(images, labels)`` and a ``loss:`` factory instead of token ids."""
