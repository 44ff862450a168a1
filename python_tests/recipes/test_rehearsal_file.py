"""The SmolLM2 recipe's rehearsal.pt (base-model samples kept for a resumed run) is read without executing code
(issue 35, item 12): a pickle that would run code is refused even with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, a file
that is not the recipe's is a clear error naming it, and the recipe's own file is read back unchanged. No model."""

from __future__ import annotations

import pytest
import torch

from sbd_ext.recipes.smollm2 import finetune


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).write_text('ran')",))


def _no_sampling(*a, **kw):
    raise AssertionError("the rehearsal file should have been read, not sampled anew")


@pytest.fixture
def cfg():
    return finetune.FinetuneConfig(rehearsal=2, rehearsal_len=4)


def test_rehearsal_file_is_read_back(tmp_path, cfg, monkeypatch):
    monkeypatch.setattr(finetune.data, "rehearsal_samples", _no_sampling)
    want = (cfg.rehearsal_pool, cfg.rehearsal_len)
    samples = torch.arange(want[0] * want[1], dtype=torch.int64).reshape(want)
    torch.save(samples, tmp_path / finetune.REHEARSAL_FILE)
    got = finetune._rehearsal(cfg, tmp_path, None, None, 0, print)
    assert torch.equal(got, samples)


@pytest.mark.parametrize("force", ["0", "1"])
def test_rehearsal_file_runs_no_code(tmp_path, cfg, monkeypatch, force):
    monkeypatch.setattr(finetune.data, "rehearsal_samples", _no_sampling)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", force)
    marker = tmp_path / "ran"
    torch.save(_Evil(marker), tmp_path / finetune.REHEARSAL_FILE)
    with pytest.raises(ValueError, match=r"rehearsal.pt is not this recipe's rehearsal file"):
        finetune._rehearsal(cfg, tmp_path, None, None, 0, print)
    assert not marker.exists()


@pytest.mark.parametrize("content", [{"a": 1}, torch.zeros(2, 4)])
def test_foreign_rehearsal_file(tmp_path, cfg, monkeypatch, content):
    monkeypatch.setattr(finetune.data, "rehearsal_samples", _no_sampling)
    torch.save(content, tmp_path / finetune.REHEARSAL_FILE)
    with pytest.raises(ValueError, match=r"rehearsal.pt is not this recipe's rehearsal file"):
        finetune._rehearsal(cfg, tmp_path, None, None, 0, print)
