"""Fixtures shared by the decoding tests."""

from __future__ import annotations

import pytest
from sbd_models import tiny_llama


@pytest.fixture(scope="module")
def models():
    # lm_scale 8: peaky next-token distributions (argmax far from ties), and a random model's block guesses are
    # mostly wrong, so corrections and rollbacks are frequent (verify, lookup, the branch).
    return [tiny_llama(seed=s, lm_scale=8.0) for s in range(2)]
