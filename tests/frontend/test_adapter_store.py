"""The frontend's adapter validation: answers cached per file stamp, errors on the field."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tandem_serve.adapters import peft
from tandem_serve.adapters.peft import ModelShapes
from tandem_serve.frontend import adapter_store
from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.validation import ValidationError
from tests.gpu_worker.model_utils import make_tiny_checkpoint
from tests.lora_utils import ADAPTERS, make_adapter


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelShapes]:
    from tandem_serve.gpu_worker.models.loader import load_model_args

    model = make_tiny_checkpoint(tmp_path_factory.mktemp("store-ckpt"), "llama",
                                 tokenizer=False)
    root = tmp_path_factory.mktemp("store-made")
    make_adapter(model, root / "team" / "attn", **ADAPTERS["attn"])
    return root, ModelShapes.of(load_model_args(model))


@pytest.fixture
def store(made: tuple[Path, ModelShapes], tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> tuple[AdapterStore, list[str]]:
    root, shapes = made
    shutil.copytree(root, tmp_path / "cache")
    reads: list[str] = []
    real = peft.read_adapter

    def counting(cache: str, adapter_id: str, *args: object) -> peft.LoraAdapter:
        reads.append(adapter_id)
        return real(cache, adapter_id, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter_store, "read_adapter", counting)
    return AdapterStore(str(tmp_path / "cache"), shapes, 16), reads


def test_resolved_once_until_its_files_change(store: tuple[AdapterStore, list[str]]) -> None:
    s, reads = store
    assert s.resolve("team/attn").targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    s.resolve("team/attn")
    assert reads == ["team/attn"]
    config = Path(s.cache_dir) / "team" / "attn" / "adapter_config.json"
    config.write_text(config.read_text().replace('"peft_type": "LORA"', '"peft_type": "IA3"'))
    os.utime(config, ns=(1, 1))  # a stamp that differs whatever the clock's resolution
    with pytest.raises(ValidationError, match="adapter_id: adapter 'team/attn': peft_type is "
                                              "'IA3'"):
        s.resolve("team/attn")
    with pytest.raises(ValidationError):  # the refusal is cached too
        s.resolve("team/attn")
    assert reads == ["team/attn"] * 2


def test_errors_name_the_field_asked(store: tuple[AdapterStore, list[str]]) -> None:
    s, reads = store
    with pytest.raises(ValidationError, match="prefix_id: adapter 'missing': not found"):
        s.resolve("missing", "prefix_id")
    with pytest.raises(ValidationError, match="adapter_id: adapter '../x': ids may only hold"):
        s.resolve("../x")
    assert reads == []


def test_the_cache_is_bounded(store: tuple[AdapterStore, list[str]],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    s, _ = store
    monkeypatch.setattr(adapter_store, "CACHE_ENTRIES", 3)
    for i in range(6):
        (Path(s.cache_dir) / f"empty{i}").mkdir()
        (Path(s.cache_dir) / f"empty{i}" / "adapter_config.json").write_text("{}")
        (Path(s.cache_dir) / f"empty{i}" / "adapter_model.safetensors").write_text("")
        with pytest.raises(ValidationError, match="peft_type is None"):
            s.resolve(f"empty{i}")
    assert list(s._checked) == ["empty3", "empty4", "empty5"]


def test_the_listing_shares_the_cache_and_skips_what_cannot_be_served(
        store: tuple[AdapterStore, list[str]]) -> None:
    import asyncio

    s, reads = store
    (Path(s.cache_dir) / "bad").mkdir()
    (Path(s.cache_dir) / "bad" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    (Path(s.cache_dir) / "bad" / "adapter_model.safetensors").write_text("")
    s.resolve("team/attn")
    listed = asyncio.run(s.available())
    assert [a.adapter_id for a in listed] == ["team/attn"]
    assert reads == ["team/attn", "bad"]  # team/attn's answer came from the cache
    asyncio.run(s.available())
    with pytest.raises(ValidationError, match="peft_type is 'IA3'"):
        s.resolve("bad")
    assert reads == ["team/attn", "bad"]  # the listing's answers are the requests' too
    assert s.names_an_adapter("bad") and not s.names_an_adapter("team")
