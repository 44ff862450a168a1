"""What sbd_ext changes in transformers itself, each idempotent and limited to SBD models / requests:

* :func:`refuse_continuous_batching` -- continuous batching refuses a model whose ``generate`` is SBD's (it would
  bypass it, decoding next-token silently);
* :func:`sample_served_temperature` -- a ``transformers serve`` request's ``temperature`` > 0 samples on an SBD
  checkpoint (serve keeps the checkpoint's ``do_sample=False``);
* :func:`end_stream_with_error` -- a streamed request that SBD's generate refuses ends with serve's error event, and
  the reason is logged;
* :func:`warn_next_token_generate` -- transformers' own ``generate`` on an SBD model warns once (``import sbd_ext``).

The first two are installed by ``custom_generate/generate.py`` when transformers loads a checkpoint's SBD generate.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import warnings
from pathlib import Path

__all__ = [
    "REQUEST_SAMPLES",
    "end_stream_with_error",
    "refuse_continuous_batching",
    "sample_served_temperature",
    "warn_next_token_generate",
]

logger = logging.getLogger(__name__)

# Set on a served request's generation config when the request asks for temperature > 0 (sample_served_temperature).
REQUEST_SAMPLES = "_sbd_ext_request_samples"


def end_stream_with_error(streamer, error: BaseException) -> None:
    """End a stream that an error cut short. A consumer thread must not wait forever, so the streamer is always
    ended; but transformers serve's streamer stops at its end sentinel and drops an error queued behind it (the
    client saw an empty answer with finish_reason "stop", and nothing was logged). For that streamer the error is
    queued first, as serve's own error event (the client gets ``data: {"error": ...}``), and the reason is logged."""
    if type(error).__name__ == "_GenerationCancelled" or not isinstance(error, Exception):
        streamer.end()  # serve's client went away / an interrupt: nothing to report
        return
    logger.error("SBD generate failed (streamed request): %s: %s", type(error).__name__, error)
    serve = _serve_stream_types()
    if serve is not None and isinstance(streamer, serve[0]) and callable(getattr(streamer, "_enqueue", None)):
        # serve writes the message into JSON by string formatting: keep it one line, without quotes to escape
        msg = " ".join(f"{type(error).__name__}: {error}".split()).replace("\\", "/").replace('"', "'")
        streamer._enqueue(serve[1](msg))
    streamer.end()  # after the error event: serve stops at the first of the two; any other consumer is released


def _serve_stream_types():
    """transformers serve's streamer class and the error item of its stream queue (None when serve is not there)."""
    utils = sys.modules.get("transformers.cli.serving.utils")  # loaded in a serving process, never imported here
    if utils is None or not hasattr(utils, "DirectStreamer") or not hasattr(utils, "_StreamError"):
        return None
    return utils.DirectStreamer, utils._StreamError


def _is_sbd_generate(model) -> bool:
    """Whether ``model.generate`` is ours: loaded from a checkpoint's ``custom_generate/`` (transformers sets a
    ``functools.partial`` of the folder's function on the instance)."""
    gen = vars(model).get("generate")
    func = gen.func if isinstance(gen, functools.partial) else gen
    return bool(getattr(func, "sbd_ext_generate", False))


def refuse_continuous_batching() -> None:
    """Make transformers' continuous batching refuse a model whose ``generate`` decodes with SBD. Continuous
    batching (``transformers serve --continuous-batching``, ``model.generate_batch``, ``init_continuous_batching``)
    runs transformers' own paged next-token decoder and never calls ``model.generate``, so on an SBD checkpoint it
    would decode without SBD, silently. ``custom_generate/generate.py`` calls this when transformers loads it;
    idempotent; models whose generate is not SBD's are untouched."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    original = ContinuousMixin.init_continuous_batching
    if getattr(original, "sbd_ext_guard", False):
        return

    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        if _is_sbd_generate(self):
            raise ValueError(
                "this model decodes with Set Block Decoding (sbd_ext's custom_generate), which transformers' "
                "continuous batching cannot run: it bypasses model.generate. Serve it without "
                "--continuous-batching (requests then run one at a time through model.generate)"
            )
        return original(self, *args, **kwargs)

    init_continuous_batching.sbd_ext_guard = True
    ContinuousMixin.init_continuous_batching = init_continuous_batching


def sample_served_temperature() -> None:
    """Make a ``transformers serve`` request's ``temperature`` > 0 sample on an SBD checkpoint, seeded by its
    ``seed``. serve sets the request's temperature on the generation config but keeps the checkpoint's
    ``do_sample`` (False for an exported checkpoint: greedy is its default), so every temperature decoded greedily.
    The request's config is tagged here and SBD's ``generate`` then samples at that temperature (serve has already
    seeded torch with the request's seed, from which the Philox seed is drawn). A request whose JSON
    ``generation_config`` names ``do_sample`` itself keeps it; ``temperature`` 0 stays greedy; other models' generate
    ignores the tag. ``custom_generate/generate.py`` calls this when transformers loads it; it patches only a serve
    that is already imported (never imports it); idempotent."""
    utils = sys.modules.get("transformers.cli.serving.utils")
    handler = getattr(utils, "BaseHandler", None)
    original = getattr(handler, "_build_generation_config", None)
    if original is None or getattr(original, "sbd_ext_guard", False):
        return

    @functools.wraps(original)
    def _build_generation_config(self, body, *args, **kwargs):
        gc = original(self, body, *args, **kwargs)
        try:
            temperature = float(body.get("temperature")) if body.get("temperature") is not None else 0.0
            own = json.loads(body["generation_config"]) if body.get("generation_config") is not None else {}
        except (TypeError, ValueError, AttributeError):
            return gc  # serve itself reports a malformed request
        if temperature > 0 and not (isinstance(own, dict) and "do_sample" in own):
            setattr(gc, REQUEST_SAMPLES, True)
        return gc

    _build_generation_config.sbd_ext_guard = True
    handler._build_generation_config = _build_generation_config


_WARNED_NEXT_TOKEN = False


@functools.lru_cache(maxsize=64)
def _folder_has_sbd_generate(folder: str) -> bool:
    f = Path(folder) / "custom_generate" / "generate.py"
    try:
        return f.is_file() and "sbd_ext" in f.read_text(errors="replace")
    except OSError:
        return False


def _sbd_generate_not_loaded(model) -> bool:
    """Whether ``model`` was loaded from a local checkpoint whose ``custom_generate/`` is SBD's, without it (loaded
    with it, the instance's own ``generate`` is SBD's and transformers' is never called)."""
    folder = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return bool(folder) and isinstance(folder, str) and _folder_has_sbd_generate(folder)


def warn_next_token_generate() -> None:
    """Make transformers' own ``generate`` warn, once per process, when it decodes next-token a checkpoint whose
    ``custom_generate/`` is SBD's: one loaded without ``trust_remote_code=True`` (transformers then does not run
    it). Next-token decoding is a right answer, but not the SBD the checkpoint promises, and nothing else tells the
    user. Deliberate next-token calls on SBD models in memory (baselines, the recipe's rehearsal) do not warn.
    ``import sbd_ext`` calls this; idempotent; the warning's category is ``UserWarning``."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate
    if getattr(original, "sbd_ext_guard", False):
        return

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        global _WARNED_NEXT_TOKEN
        if not _WARNED_NEXT_TOKEN and kwargs.get("custom_generate") is None and _sbd_generate_not_loaded(self):
            _WARNED_NEXT_TOKEN = True
            warnings.warn(
                f"{self.name_or_path} is a Set Block Decoding checkpoint, but transformers' own generate is decoding "
                "it next-token, one token per forward: its custom_generate/ was not loaded. Load it with "
                "from_pretrained(..., trust_remote_code=True) (then model.generate decodes with SBD), or call "
                "sbd_ext.generate(model, ids). (Shown once.)",
                UserWarning,
                stacklevel=2,
            )
        return original(self, *args, **kwargs)

    generate.sbd_ext_guard = True
    GenerationMixin.generate = generate
