"""Reading PEFT LoRA folders without torch: what is served, and every reason to refuse one."""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem_serve.adapters.peft import (
    AdapterError,
    ModelShapes,
    adapter_folder,
    pattern_key,
    read_adapter,
    read_adapter_folder,
)
from tandem_serve.gpu_worker.models.loader import load_model_args
from tests.gpu_worker.model_utils import make_tiny_checkpoint
from tests.lora_utils import make_adapters

MAX_RANK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("peft-ckpt"), "llama", tokenizer=False)


@pytest.fixture(scope="module")
def shapes(model: str) -> ModelShapes:
    return ModelShapes.of(load_model_args(model))


@pytest.fixture(scope="module")
def made(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("made")
    return make_adapters(model, root)


@pytest.fixture
def cache(made: Path, tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(made, root)
    return root


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = str(folder / "adapter_model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_what_each_adapter_adapts(cache: Path, shapes: ModelShapes) -> None:
    attn = read_adapter(str(cache), "attn", shapes, MAX_RANK)
    assert attn.targets == ("q_proj", "k_proj", "v_proj", "o_proj") and attn.rank == 4
    assert len(attn.modules) == 4 * shapes.num_layers
    assert {m.scaling for m in attn.modules} == {2.0}
    mlp = read_adapter(str(cache), "mlp", shapes, MAX_RANK)
    assert mlp.targets == ("gate_proj", "up_proj", "down_proj")
    assert {(m.rank, m.scaling) for m in mlp.modules} == {(16, 0.25)}
    every = {(m.module, m.rank, m.scaling) for m in read_adapter(str(cache), "all", shapes,
                                                                   MAX_RANK).modules}
    # rank_pattern {"down_proj": 4}, alpha_pattern {"o_proj": 4}, r 8, alpha 16
    assert every == {("q_proj", 8, 2.0), ("k_proj", 8, 2.0), ("v_proj", 8, 2.0),
                     ("o_proj", 8, 0.5), ("gate_proj", 8, 2.0), ("up_proj", 8, 2.0),
                     ("down_proj", 4, 4.0)}
    edit_config(cache / "attn", use_rslora=True)
    rs = read_adapter(str(cache), "attn", shapes, MAX_RANK)
    assert {m.scaling for m in rs.modules} == {8 / 4 ** 0.5}


def test_pattern_keys_match_like_peft() -> None:
    from peft.utils.other import get_pattern_key

    patterns = {"down_proj": 1, "layers.1.self_attn.q_proj": 2, r"layers\.[02]\.mlp\..*": 3}
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                 "model.layers.0.self_attn.q_proj", "model.layers.2.mlp.up_proj",
                 "model.layers.11.self_attn.q_proj"):
        theirs = get_pattern_key(list(patterns), name)
        assert pattern_key(patterns, name) == (theirs if theirs in patterns else None), name


@pytest.mark.parametrize("adapter_id, reason", [
    ("../escape", "may only hold"), ("a b", "may only hold"), ("x.y", "may only hold"),
    ("/etc", "relative to the adapter cache"), ("nope", "not found"), ("", "may only hold")])
def test_bad_ids(cache: Path, adapter_id: str, reason: str) -> None:
    with pytest.raises(AdapterError, match=reason):
        adapter_folder(str(cache), adapter_id)


def test_a_symlink_out_of_the_cache_is_refused(cache: Path, made: Path) -> None:
    os.symlink(made / "attn", cache / "outside")
    os.symlink(cache / "attn", cache / "inside")
    with pytest.raises(AdapterError, match="outside the adapter cache"):
        adapter_folder(str(cache), "outside")
    assert adapter_folder(str(cache), "inside") == str((cache / "attn").resolve())


@pytest.mark.parametrize("changes, reason", [
    (dict(peft_type="PROMPT_TUNING"), "peft_type is 'PROMPT_TUNING'; only LORA"),
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "trains biases"),
    (dict(target_modules=["q_proj", "lm_head"]), "targets lm_head"),
    (dict(target_modules=["model.embed_tokens"]), "new embeddings"),
    (dict(target_modules=["c_attn"]), "does not have"),
    (dict(target_modules=".*(lm_head|q_proj)"), "matches lm_head"),
    (dict(target_modules="("), "not a valid regex"),
    (dict(r=32), "rank 32, above this server's --max-lora-rank 16"),
    (dict(rank_pattern={"q_proj": 17}), "rank 17"),
    (dict(r=2), "lora_A has shape [4, 64]; the model and the adapter's rank 2 need [2, 64]"),
    (dict(lora_alpha="big"), "lora_alpha must be a positive number"),
])
def test_configs_that_are_refused(cache: Path, shapes: ModelShapes, changes: dict[str, Any],
                                  reason: str) -> None:
    edit_config(cache / "attn", **changes)
    with pytest.raises(AdapterError, match=re.escape(reason)):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)


def _extra(name: str, shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({name: torch.zeros(shape)})


@pytest.mark.parametrize("change, reason", [
    (_extra("base_model.model.lm_head.lora_A.weight", (4, 64)), "lm_head.lora_A.weight, which "
     "is not a LoRA weight"),
    (_extra("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", (64,)),
     "lora_magnitude_vector"),
    (_extra("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", (4, 64)),
     "the model has 2 layers"),
    (lambda t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
     "layer 1 v_proj has no lora_B"),
    (lambda t: t.clear(), "holds no LoRA weights"),
])
def test_weights_that_are_refused(cache: Path, shapes: ModelShapes,
                                  change: Callable[[dict[str, torch.Tensor]], None],
                                  reason: str) -> None:
    edit_weights(cache / "attn", change)
    with pytest.raises(AdapterError, match=reason):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)


def test_missing_truncated_and_foreign_files(cache: Path, shapes: ModelShapes) -> None:
    weights = cache / "attn" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-10])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)
    weights.unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)
    (cache / "mlp" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="cannot read adapter_config.json"):
        read_adapter(str(cache), "mlp", shapes, MAX_RANK)
    (cache / "all" / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(str(cache), "all", shapes, MAX_RANK)


def test_new_tokens_are_refused(cache: Path, shapes: ModelShapes) -> None:
    (cache / "attn" / "added_tokens.json").write_text(json.dumps({"<tool>": 3}))
    read_adapter(str(cache), "attn", shapes, MAX_RANK)  # an id the vocabulary has: fine
    (cache / "attn" / "added_tokens.json").write_text(json.dumps({"<tool>": 512, "<x>": 513}))
    with pytest.raises(AdapterError, match="adds 2 tokens beyond the model's vocabulary of 512"):
        read_adapter(str(cache), "attn", shapes, MAX_RANK)


def test_an_adapter_for_another_model_is_refused(cache: Path, model: str,
                                                 tmp_path: Path) -> None:
    wider = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False, hidden_size=96)
    with pytest.raises(AdapterError, match=r"lora_A has shape \[4, 64\]; .* need \[4, 96\]"):
        read_adapter(str(cache), "attn", ModelShapes.of(load_model_args(wider)), MAX_RANK)


def test_find_adapters_walks_the_cache_in_id_order_and_within_bounds(tmp_path: Path) -> None:
    from tandem_serve.adapters.peft import find_adapters

    def adapter(rel: str) -> None:
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "adapter_config.json").write_text("{}")

    for rel in ("zeta", "team/b", "team/a", "team/a/checkpoint-1", "deep/x/y/z", "v1.0",
                ".hidden/q", "team-c"):
        adapter(rel)
    (tmp_path / "empty" / "folder").mkdir(parents=True)
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "link").symlink_to(tmp_path / "team", target_is_directory=True)
    # An adapter folder is not entered; names an id cannot hold and symlinks are skipped.
    assert find_adapters(str(tmp_path)) == ["deep/x/y/z", "team-c", "team/a", "team/b", "zeta"]
    assert find_adapters(str(tmp_path), limit=2) == ["deep/x/y/z", "team-c"]
    # The walk looks into at most max_folders folders, by id: the root, deep, deep/x, ...
    assert find_adapters(str(tmp_path), max_folders=4) == []
    assert find_adapters(str(tmp_path), max_folders=5) == ["deep/x/y/z"]
    assert find_adapters(str(tmp_path / "missing")) == []


def test_a_runtime_adapter_is_read_from_its_own_folder(made: Path, shapes: ModelShapes,
                                                       tmp_path: Path) -> None:
    """Loaded at runtime (`/v1/load_lora_adapter`): any folder, even one whose name no cache
    id may hold; its id is the real path, which the worker reads through `read_adapter`."""
    folder = tmp_path / "v1.2 final"
    shutil.copytree(made / "attn", folder)
    os.symlink(folder, tmp_path / "link")
    adapter = read_adapter_folder(str(tmp_path / "link"), shapes, MAX_RANK)
    assert adapter.adapter_id == adapter.folder == str(folder.resolve())
    again = read_adapter(str(tmp_path / "unrelated-cache"), adapter.adapter_id, shapes, MAX_RANK)
    assert again == adapter
    with pytest.raises(AdapterError, match="no such folder"):
        read_adapter_folder(str(tmp_path / "missing"), shapes, MAX_RANK)
