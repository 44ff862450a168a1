"""Issue 61, item 7: a model's recommended settings (its ``sbd_*`` generation-config fields, as a shipped drafter
carries them) give way to the caller's keywords: ``mode="ntp"`` decodes NTP on a model that recommends verified
SBD, the recommended verify / lookup / branch dropped, and the other way round."""

from __future__ import annotations

import pytest
import torch
from sbd_models import random_drafter, random_prompts, single_thread  # noqa: F401

import sbd_ext
from sbd_ext.decoding.gen_config import layered_settings

pytestmark = pytest.mark.usefixtures("single_thread")

RECOMMENDED = {"sbd_mode": "sbd", "sbd_block_size": 4, "sbd_verify": True, "sbd_lookup": 4, "sbd_branch": True}


@pytest.fixture(scope="module")
def models():
    """(base, the base with a gated drafter and the recommended settings of a shipped drafter)."""
    base, model = random_drafter(seed=4, rank=2)
    for key, value in RECOMMENDED.items():
        setattr(model.generation_config, key, value)
    return base, model


def test_an_explicit_ntp_mode_decodes_ntp_on_a_model_that_recommends_verify(models):
    base, model = models
    ids, att = random_prompts([6, 9], seed=7)
    ref = sbd_ext.generate(base, ids, att, mode="ntp", max_new_tokens=12)  # the base's own NTP, independently
    out = sbd_ext.generate(model, ids, att, mode="ntp", max_new_tokens=12)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.nfe.tolist() == [12, 12]  # one token per forward: NTP, not verify (which drafts)
    assert out.num_accepted.tolist() == [0, 0]
    recommended = sbd_ext.generate(model, ids, att, max_new_tokens=12)  # no keyword: the recommended verify
    assert torch.equal(recommended.sequences, ref.sequences) and recommended.num_accepted.sum() > 0


def test_layers_drop_what_a_higher_layers_mode_excludes():
    rec = {"mode": "sbd", "block_size": 4, "verify": True, "lookup": 4, "branch": True, "first_from_ntp": True}
    s = layered_settings({"mode": "ntp"}, rec)
    assert (s.mode, s.verify, s.lookup, s.branch, s.first_from_ntp) == ("ntp", False, 0, False, False)
    s = layered_settings({}, {"mode": "ntp"}, rec)  # a per-call generation config over the model's
    assert (s.mode, s.verify) == ("ntp", False)
    s = layered_settings({"verify": True}, {"mode": "ntp"})  # the caller's verify over a recommended NTP mode
    assert (s.mode, s.verify) == ("sbd", True)
    with pytest.raises(ValueError, match="needs mode='sbd'"):  # both from the caller: a contradiction, refused
        layered_settings({"mode": "ntp", "verify": True}, rec)
