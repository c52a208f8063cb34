"""``python -m mfu_lab ...`` is the same as the ``mfu-lab`` command."""

import sys

from .cli import main

sys.exit(main())
