"""The ``mfu-lab`` commands' bodies, one module per group of commands; argument parsing, dispatch and error
printing stay in :mod:`mfu_lab.cli`, which nothing here may import."""
