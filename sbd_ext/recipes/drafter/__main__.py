"""``python -m sbd_ext.recipes.drafter``: the gated-drafter recipe for a model of your own."""

from . import main

raise SystemExit(main())
