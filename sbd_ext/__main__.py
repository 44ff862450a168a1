"""``python -m sbd_ext`` = the ``sbd-ext`` command (see :mod:`sbd_ext.cli`)."""

import sys

from .cli import main

sys.exit(main())
