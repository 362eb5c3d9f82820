"""Which part of each tensor a tensor-parallel rank holds: the shapes that split and those that
do not, and N loaded shards put back together giving the whole model (no process group)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer
from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.gpu_worker.models.sharding import (
    WHOLE,
    Part,
    Shard,
    checkpoint_part,
    kv_heads,
    local_args,
    lora_part,
    split_problems,
)
from tests.gpu_worker.model_utils import make_tiny_checkpoint

CPU = torch.device("cpu")


def args(**kw: Any) -> ModelArgs:
    base: dict[str, Any] = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_layers=2, num_heads=8,
                                num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                max_position_embeddings=1024)
    base.update(kw)
    return ModelArgs(**base)


def test_shapes_that_split() -> None:
    for n in (1, 2, 4, 8):
        assert split_problems(args(), n) == []
    assert split_problems(args(num_kv_heads=1), 8) == []  # one kv head, replicated


@pytest.mark.parametrize("kw, n, message", [
    (dict(num_heads=6, num_kv_heads=6), 4, "num_attention_heads 6 is not divisible by "
                                           "--tensor-parallel-size 4"),
    (dict(num_kv_heads=4), 8, None),
    (dict(num_heads=12, num_kv_heads=6), 4, "num_key_value_heads 6 is not divisible by "
                                            "--tensor-parallel-size 4"),
    (dict(num_heads=12, num_kv_heads=3), 4, "--tensor-parallel-size 4 is not a multiple of "
                                            "num_key_value_heads 3"),
    (dict(intermediate_size=100), 8, "intermediate_size 100 is not divisible by "
                                     "--tensor-parallel-size 8"),
    (dict(vocab_size=32001), 2, "vocab_size 32001 is not divisible by --tensor-parallel-size 2"),
])
def test_shapes_that_do_not_split_are_named(kw: dict[str, Any], n: int,
                                            message: str | None) -> None:
    problems = split_problems(args(**kw), n)
    if message is None:
        assert problems == []
    else:
        assert message in "; ".join(problems)
        with pytest.raises(ValueError, match="--tensor-parallel-size"):
            local_args(args(**kw), Shard(0, n))


def test_replicated_kv_head_is_the_one_its_query_heads_use() -> None:
    a = args(num_heads=8, num_kv_heads=2)
    n = 8
    group = a.num_heads // a.num_kv_heads  # query heads per kv head
    for r in range(n):
        first, last = kv_heads(a, Shard(r, n))
        assert last - first == 1
        q_heads = range(r * a.num_heads // n, (r + 1) * a.num_heads // n)
        assert {h // group for h in q_heads} == {first}
    assert local_args(a, Shard(3, n)).num_kv_heads == 1


def test_local_args_keep_the_whole_vocabulary() -> None:
    local = local_args(args(), Shard(1, 4))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (
        2, 1, 32, 512)


def test_lora_matrices_split_like_their_modules() -> None:
    a, s = args(), Shard(1, 2)
    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.0.mlp.down_proj.weight"
    assert lora_part(q, "A", a, s) == WHOLE
    assert lora_part(q, "B", a, s) == checkpoint_part(q, a, s) == Part(0, 32, 64)
    assert lora_part(down, "A", a, s) == checkpoint_part(down, a, s) == Part(1, 64, 128)
    assert lora_part(down, "B", a, s) == WHOLE


@pytest.fixture(scope="module")
def bias_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("shard"), "llama", tokenizer=False,
                                num_attention_heads=8, num_key_value_heads=2,
                                attention_bias=True, mlp_bias=True)


def _layer(model: CausalLM) -> DecoderLayer:
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer


@pytest.mark.parametrize("n", [2, 4])
def test_shards_put_back_together_are_the_model(bias_ckpt: str, n: int) -> None:
    whole = load_model(bias_ckpt, torch.float32, CPU, onednn=False)
    shards = [load_model(bias_ckpt, torch.float32, CPU, onednn=False, shard=Shard(r, n))
              for r in range(n)]
    a, w = whole.config, _layer(whole)
    d, hq, hkv, i = a.head_dim, a.num_heads, a.num_kv_heads, a.intermediate_size
    ls = [_layer(m) for m in shards]
    assert torch.equal(torch.cat([m.embed_tokens for m in shards]), whole.embed_tokens)
    assert torch.equal(torch.cat([m.lm_head for m in shards]), whole.lm_head)
    q = torch.cat([x.qkv_weight[: hq // n * d] for x in ls])
    assert torch.equal(q, w.qkv_weight[: hq * d])
    kv_rows = {r: ls[r].qkv_weight[hq // n * d:] for r in range(n)}
    for r in range(n):  # each rank's k and v rows are those of the kv heads it holds
        first, last = kv_heads(a, Shard(r, n))
        k = w.qkv_weight[(hq + first) * d:(hq + last) * d]
        v = w.qkv_weight[(hq + hkv + first) * d:(hq + hkv + last) * d]
        assert torch.equal(kv_rows[r], torch.cat([k, v]))
        assert ls[r].qkv_bias is not None
    assert torch.equal(torch.cat([x.o_weight for x in ls], dim=1), w.o_weight)
    assert torch.equal(torch.cat([x.down_weight for x in ls], dim=1), w.down_weight)
    gate = torch.cat([x.gate_up_weight[: i // n] for x in ls])
    up = torch.cat([x.gate_up_weight[i // n:] for x in ls])
    assert torch.equal(torch.cat([gate, up]), w.gate_up_weight)
    # Row-parallel biases count once in the all-reduced sum: rank 0 has them, the rest zeros.
    assert ls[0].o_bias is not None and w.o_bias is not None
    assert torch.equal(ls[0].o_bias, w.o_bias)
    assert all(x.o_bias is not None and not x.o_bias.any() for x in ls[1:])
    assert all(x.down_bias is not None and not x.down_bias.any() for x in ls[1:])
    assert shards[1].config.num_heads == hq // n and shards[1].config.vocab_size == a.vocab_size
