"""`--load-format dummy`: a model of the config's shape without its checkpoint."""
from __future__ import annotations

import pathlib
import shutil

import pytest
import torch

from tandem_serve.gpu_worker.models.loader import load_model


def test_dummy_weights_need_only_the_config_and_are_reproducible(
        tmp_path: pathlib.Path, fast_model_dir: pathlib.Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(fast_model_dir / "config.json", folder)
    a = load_model(str(folder), torch.float32, torch.device("cpu"), load_format="dummy")
    b = load_model(str(folder), torch.float32, torch.device("cpu"), load_format="dummy")
    real = load_model(str(fast_model_dir), torch.float32, torch.device("cpu"))
    for (name, pa), (_, pb), (_, pr) in zip(a.named_parameters(), b.named_parameters(),
                                           real.named_parameters(), strict=True):
        assert pa.shape == pr.shape, name
        assert torch.equal(pa, pb), name  # seeded by name: the same model every time
        if "norm" in name:
            assert torch.all(pa == 1), name
        else:
            assert 0.01 < pa.std().item() < 0.03, name


def test_an_unknown_load_format_is_refused(fast_model_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unsupported load format 'pt'"):
        load_model(str(fast_model_dir), torch.float32, torch.device("cpu"), load_format="pt")
