"""transformers' ``custom_generate`` entry point for Set Block Decoding (loaded as remote code with
``trust_remote_code=True``): everything is in the installed ``sbd_ext`` package."""

from sbd_ext.integration import hf_generate

# Continuous batching would bypass this generate (and SBD) silently: make it refuse SBD models instead.
hf_generate.refuse_continuous_batching()
# transformers serve keeps the checkpoint's do_sample=False under a request's temperature: make temperature > 0 sample.
hf_generate.sample_served_temperature()


def generate(*args, model=None, **kwargs):
    """``model.generate(...)`` with SBD: see :func:`sbd_ext.integration.hf_generate.generate`."""
    if model is None:  # called directly as generate(model, ...)
        model, *args = args
    return hf_generate.generate(model, *args, **kwargs)


generate.sbd_ext_generate = True  # how refuse_continuous_batching recognises a model whose generate is this one
