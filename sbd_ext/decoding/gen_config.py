"""SBD settings carried by a HuggingFace ``GenerationConfig``: the ``sbd_*`` fields (``sbd_block_size``,
``sbd_sampler``, ``sbd_threshold``, ``sbd_verify``, ``sbd_mode``, ``sbd_compile``, ``sbd_strict_block_size``,
``sbd_lookup``, ``sbd_branch``, ``sbd_alternates``), saved in
``generation_config.json`` so that a checkpoint carries its recommended SBD settings to :func:`sbd_ext.generate` and
to ``model.generate``.

Precedence, highest first: explicit settings (keywords / a :class:`GenerationSettings`), then each generation
config given (a per-call one, then the model's), then the :class:`GenerationSettings` defaults. A threshold only
means something for its sampler: a layer's ``sbd_threshold`` is dropped when that layer names its ``sbd_sampler``
and a higher layer picks another one (the sampler's registry default, or a threshold from above, applies). Likewise
the settings that only apply to SBD (``verify``, ``first_from_ntp``, ``lookup``, ``branch``) are dropped from a layer
when a higher one picks ``mode="ntp"`` (``sbd_ext.generate(model, ids, mode="ntp")`` decodes NTP on a model that
recommends ``sbd_verify``), and a layer's ``mode="ntp"`` is dropped when a higher one asks for ``verify`` or
``first_from_ntp`` (SBD then). Any other ``sbd_*`` attribute (a misspelt field) is refused, naming it.
"""

from __future__ import annotations

from .settings import GenerationSettings

__all__ = [
    "KNOWN_SBD_FIELDS",
    "SBD_FIELDS",
    "SBD_ONLY",
    "check_sbd_field_names",
    "sbd_fields",
    "layered_settings",
    "resolve_settings",
]

# generation-config attribute -> GenerationSettings field
SBD_FIELDS = {
    "sbd_block_size": "block_size",
    "sbd_sampler": "sampler",
    "sbd_threshold": "threshold",
    "sbd_verify": "verify",
    "sbd_mode": "mode",
    "sbd_compile": "compile",
    "sbd_strict_block_size": "strict_block_size",
    "sbd_lookup": "lookup",
    "sbd_branch": "branch",
    "sbd_alternates": "alternates",
}
# The settings that only apply to SBD decoding: a lower layer's are dropped under a higher layer's mode="ntp".
SBD_ONLY = ("verify", "first_from_ntp", "lookup", "branch", "alternates")
# Every sbd_* generation-config field: the settings above, and sbd_seed (the Philox seed of ``model.generate``).
KNOWN_SBD_FIELDS = (*SBD_FIELDS, "sbd_seed")


def check_sbd_field_names(generation_config, where: str = "generation_config") -> None:
    """Refuse an ``sbd_*`` attribute of ``generation_config`` that is not an SBD field (a misspelt one would
    otherwise be ignored and decode with another setting)."""
    unknown = sorted(
        k for k in getattr(generation_config, "__dict__", {}) if k.startswith("sbd_") and k not in KNOWN_SBD_FIELDS
    )
    if unknown:
        raise ValueError(f"{where} has unknown SBD field(s) {unknown}; the SBD fields are {sorted(KNOWN_SBD_FIELDS)}")


def sbd_fields(generation_config, where: str = "generation_config") -> dict:
    """The ``sbd_*`` fields set (not None) on ``generation_config`` (None: {}), as GenerationSettings field names,
    validated alone so that a bad value is reported with the attribute that holds it."""
    if generation_config is None:
        return {}
    check_sbd_field_names(generation_config, where)
    found = {}
    for attr, name in SBD_FIELDS.items():
        value = getattr(generation_config, attr, None)
        if value is not None:
            found[name] = value
    if found:
        try:
            GenerationSettings(**found)
        except (TypeError, ValueError) as e:
            attrs = ", ".join(f"{a}={getattr(generation_config, a)!r}" for a, n in SBD_FIELDS.items() if n in found)
            raise type(e)(f"{where} ({attrs}): {e}") from e
    return found


def layered_settings(explicit: dict, *layers: dict) -> GenerationSettings:
    """GenerationSettings from ``explicit`` fields over ``layers`` (highest first; each a dict of fields)."""
    merged = dict(explicit)
    for layer in layers:
        for name, value in layer.items():
            if name in merged:
                continue
            own = layer.get("sampler")
            if name == "threshold" and own is not None and merged.get("sampler", own) != own:
                continue  # this layer's threshold is for its own sampler, not the one chosen above it
            if name in SBD_ONLY and merged.get("mode") == "ntp":
                continue  # an SBD setting under NTP chosen above: it does not apply
            if name == "mode" and value == "ntp" and (merged.get("verify") or merged.get("first_from_ntp")):
                continue  # SBD's verify / first_from_ntp asked for above: they need SBD
            merged[name] = value
    return GenerationSettings(**merged)


def resolve_settings(model, settings: GenerationSettings | None, overrides: dict) -> GenerationSettings:
    """What :func:`sbd_ext.generate` / :func:`sbd_ext.generate_reference` decode with: ``settings`` (taken whole)
    + ``overrides``; without ``settings``, ``overrides`` over the ``sbd_*`` fields of ``model.generation_config``
    over the defaults."""
    if settings is not None:
        return GenerationSettings.of(settings, **overrides)
    GenerationSettings.of(None, **{k: v for k, v in overrides.items() if k != "threshold"})  # names, values alone
    gen_cfg = getattr(model, "generation_config", None)
    return layered_settings(overrides, sbd_fields(gen_cfg, "model.generation_config"))
