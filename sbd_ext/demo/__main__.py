"""``python -m sbd_ext.demo`` = the ``sbd-ext`` command (see :mod:`sbd_ext.demo.cli`)."""

import sys

from .cli import main

sys.exit(main())
