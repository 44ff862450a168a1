"""The demo on top of the sbd_ext core: generated tasks, the project's tokenizer, the embedded models, their
training recipe, the evaluation and the ``sbd-ext`` command line (``python -m sbd_ext.demo``).

Layering: the demo imports the core (:mod:`sbd_ext`, :mod:`sbd_ext.training`, ...); the core never imports the demo.

* :mod:`sbd_ext.demo.tasks` -- arithmetic word problems and list sort/reverse, with a held-out split;
* :mod:`sbd_ext.demo.tokenizer` -- the BPE (and character) tokenizer the embedded models use;
* :mod:`sbd_ext.demo.models` -- the embedded models (package data) and their loader;
* :mod:`sbd_ext.demo.train` -- ``python -m sbd_ext.demo.train``, the recipe that produced them;
* :mod:`sbd_ext.demo.evaluate` -- held-out accuracy / NFE tables and plots;
* :mod:`sbd_ext.demo.cli` -- the ``sbd-ext`` console script.
"""
