"""``python -m mfu_lab ...`` is the same as the ``mfu-lab`` command."""

import sys

from mfu_lab.cli import main

sys.exit(main())
