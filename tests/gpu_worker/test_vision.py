"""VL checkpoints (Qwen2.5-VL; Qwen3-VL with q/k norms, interleaved M-RoPE and DeepStack;
Qwen3-VL-MoE, the same over experts stacked in 3-D tensors; Qwen3.5, Qwen3-VL's tower
without DeepStack over the hybrid linear-attention model, as published (an MTP head beside
it, left out), with partial interleaved M-RoPE; Gemma 3 with bidirectional
attention among an image's tokens) in the gpu worker: greedy equal to transformers'
generate in float32, token for token, with images encoded during prefill (and M-RoPE
positions), Qwen3-VL and Gemma 3 also at tensor parallel size 2 (Qwen3-VL's language model
nested as published, `model.language_model.*`); the embedding cache; chunks and
prefix-cache hits that cut a Qwen image, or end next to a Gemma image (never inside);
preemption; a LoRA adapter on the language model (PEFT's names nest it too) beside base
rows; speculative decoding (n-gram and a draft model) on image requests; Qwen3-VL-MoE as
published (experts in the matmul layout); Gemma 3's published layout, its pan-and-scan
refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem_serve.gpu_worker.models.loader import load_model_args
from tandem_serve.gpu_worker.models.weights import SafetensorsCheckpoint
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tests.gpu_worker import tp_job
from tests.gpu_worker.runner_driver import Driver, make_runner
from tests.vl_utils import (
    VLReference,
    gemma3_checkpoint,
    image_message,
    png_bytes,
    published_vl_moe,
    vl_adapter,
    vl_checkpoint,
    worker_case,
)

N = 12
EOS = 2


@pytest.fixture(scope="module",
                params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma3"])
def vl(ckpt_root: Path, request: pytest.FixtureRequest) -> str:
    if request.param == "gemma3":
        return gemma3_checkpoint(ckpt_root)
    return vl_checkpoint(ckpt_root, request.param)


@pytest.fixture(scope="module")
def cases(vl: str) -> list[tuple[list[int], list[Any], list[int]]]:
    ref = VLReference(vl)
    return [worker_case(ref, image_message("what is this"), [png_bytes(0)], N),
            worker_case(ref, image_message("compare these two", 2),
                        [png_bytes(0), png_bytes(1, (60, 40))], N),
            worker_case(ref, [{"role": "user", "content": "hello there"}], [], N),
            worker_case(ref, image_message("what is this"), [png_bytes(2, (200, 150), "JPEG")],
                        N)]


@pytest.fixture(scope="module")
def runner(vl: str) -> ModelRunner:
    return make_runner(vl)


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=N, stop_token_ids=[EOS])


def serves_hf_tokens(path: str, cases: list[Any]) -> None:
    """A fresh runner of `path` serves the cases at once (K=8 async): HF's tokens each."""
    d = Driver(make_runner(path))
    for i, (ids, images, _) in enumerate(cases):
        d.add(i, ids, _params(), images=images)
    d.run_until_done([8])
    for i, (_, _, want) in enumerate(cases):
        assert d.outputs()[i] == want, f"request {i}"


@pytest.mark.parametrize("k,per_step", [(1, False), (8, True)], ids=["k1-sync", "k8-async"])
def test_image_and_text_requests_in_one_batch_match_hf(
        runner: ModelRunner, cases: list[Any], k: int, per_step: bool) -> None:
    assert runner.vision is not None
    encoded = runner.vision.tower.encoded
    d = Driver(runner)
    for i, (ids, images, _) in enumerate(cases):
        d.add(i, ids, _params(), images=images)
    while any(not (t.finish or t.gone) for t in d.reqs.values()):
        d.run(k, per_step)
    for i, (_, _, want) in enumerate(cases):
        assert d.outputs()[i] == want, f"request {i}"
    # The second request's first image is the first's: three distinct images, once each
    # (and none again in the second run: the embeddings are cached by content).
    assert runner.vision.tower.encoded - encoded in (0, 3)


def test_chunks_that_cut_an_image_and_a_preemption_match_hf(
        runner: ModelRunner, cases: list[Any]) -> None:
    ids, images, want = cases[1]  # two images
    d = Driver(runner)
    whole = images[0].bidirectional  # Gemma 3: chunks end next to an image, never inside
    first = images[0].offset + (0 if whole else 3)  # else inside the first image
    d.add(0, ids, _params(), images=images, chunk=first)
    d.run(4)
    rest = len(ids) - 1 - first
    half = images[1].offset - first if whole else rest // 2  # else the second image split
    d.prefill(0, rest, [half, rest - half])  # two steps
    d.run(4)
    assert d.reqs[0].out, "decoding after its last piece"
    d.preempt(0)
    d.run(2)
    assert runner.vision is not None
    encoded = runner.vision.tower.encoded
    d.resume(0)
    d.run_until_done([4])
    assert d.outputs()[0] == want
    assert runner.vision.tower.encoded == encoded, "a resume takes its images from the cache"


def test_prefix_hit_that_ends_inside_an_image_matches_hf(
        runner: ModelRunner, cases: list[Any]) -> None:
    if runner.model.config.is_hybrid:
        pytest.skip("Qwen3.5: a hit ends where a state was checkpointed, every 64 tokens "
                    "(tests/e2e/test_vision.py serves one past an image)")
    ids, images, want = cases[3]  # an image of 35 tokens: it crosses a block boundary
    bs = runner.block_size
    shared = images[0].offset // bs + 1  # the last shared block ends inside the image
    if images[0].bidirectional:  # Gemma 3: a hit never ends inside an image (the
        # scheduler's rule): this one covers both images of the second case, text follows
        ids, images, want = cases[1]
        shared = -(-(images[1].offset + images[1].length) // bs)
        assert shared * bs < len(ids) - 1
    else:
        assert shared * bs < images[0].offset + images[0].length, images[0]
    d = Driver(runner)
    d.add(0, ids, _params(), images=images)
    d.run(2)
    d.add(1, ids, _params(), images=images, shared=d.reqs[0].blocks[:shared],
          cached=shared * bs)
    d.run_until_done([4])
    assert d.outputs()[0] == want
    assert d.outputs()[1] == want


def test_gemma3_published_names_serve_the_same(vl: str, cases: list[Any],
                                               ckpt_root: Path) -> None:
    """The published layout (SigLIP under `vision_tower.vision_model.*`, a text_config
    relying on Gemma3TextConfig's defaults) holds the same weights: the same tokens."""
    if "gemma3" not in vl:
        pytest.skip("Gemma 3's published layout")
    serves_hf_tokens(gemma3_checkpoint(ckpt_root, published=True), cases[:2])


def test_gemma3_pan_and_scan_is_refused_at_start_up(vl: str, tmp_path: Path) -> None:
    import json
    import shutil

    from tandem_serve.frontend.media.images import ImagePreprocessor
    from tandem_serve.proto.vision import read_spec

    if "gemma3" not in vl:
        pytest.skip("Gemma 3's processor")
    path = shutil.copytree(vl, tmp_path / "pan")
    with open(path / "processor_config.json") as f:
        cfg = json.load(f)
    cfg["image_processor"]["do_pan_and_scan"] = True
    with open(path / "processor_config.json", "w") as f:
        json.dump(cfg, f)
    spec = read_spec(str(path))
    assert spec is not None
    with pytest.raises(ValueError, match="pan-and-scan .* not supported"):
        ImagePreprocessor(str(path), spec)


def test_a_piece_that_cuts_a_bidirectional_image_is_refused() -> None:
    import numpy as np

    from tandem_serve.gpu_worker.steps import Piece
    from tandem_serve.gpu_worker.vision.inputs import whole_images
    from tandem_serve.proto.request_params import ImageInput

    class Req:
        request_id = 7
        images = [ImageInput(4, 16, b"d" * 16, np.zeros((1, 1), np.float32), [1, 4, 4], True)]

    assert whole_images(Piece(Req(), 0, 4)) == []  # type: ignore[arg-type]
    assert whole_images(Piece(Req(), 2, 30)) == [(4, 20)]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cuts the image at \\[4, 20\\)"):
        whole_images(Piece(Req(), 0, 10))  # type: ignore[arg-type]


def test_tensor_parallel_2_matches_hf(vl: str, cases: list[Any],
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    if not Path(vl).name.startswith(("tiny-qwen3_vl-", "tiny-gemma3-")):
        pytest.skip("the families with something more at TP=2 (the test costs two "
                    "processes): Qwen3-VL's DeepStack and nested language model, Gemma 3's "
                    "bidirectional images")
    out = tmp_path_factory.mktemp("tp-vision")
    torch.save([(ids, images) for ids, images, _ in cases], out / "cases.pt")
    ranks = tp_job.launch({"vision": {"path": vl, "cases": str(out / "cases.pt")}}, out)
    for mode in ("k1", "k8"):
        got = ranks[0]["vision"][mode]
        for i, (_, _, want) in enumerate(cases):
            assert got[i] == want, (mode, i)
        assert ranks[1]["vision"][mode] == got


def test_lora_on_the_language_model_with_images_matches_peft(
        vl: str, cases: list[Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("vl-adapters")
    ref = VLReference(vl)  # its own: PEFT adds the adapter to the model in place
    ref.model = vl_adapter(ref, str(cache / "attn"))
    ids, images, want = worker_case(ref, image_message("what is this"), [png_bytes(0)], N)
    base = cases[0]
    assert base[0] == ids and want != base[2], "the adapter changes the output"
    d = Driver(make_runner(vl, adapter_cache=str(cache), max_loras=2))
    d.load(1, "attn")
    d.add(0, ids, _params(), images=images, lora_slot=1)
    d.add(1, ids, _params(), images=images)  # the base model, same batch
    d.run_until_done([8])
    assert d.outputs()[0] == want
    assert d.outputs()[1] == base[2]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_images_matches_hf(vl: str, cases: list[Any], method: str) -> None:
    """Every row speculates (adaptive off), K=8 async, with a preemption: the verify rows
    rotate at their index plus the request's M-RoPE delta. The draft model is the
    checkpoint's own language model read as text (placeholder ids, no image embeddings):
    drafts it gets wrong near an image are rejected, never emitted."""
    if method == "draft_model" and Path(vl).name.startswith("tiny-qwen3_5-"):
        pytest.skip("a hybrid model speculates with n-gram only (refused at start-up)")
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    spec.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": vl})
    d = Driver(make_runner(vl, speculative=parse_speculative(json.dumps(spec))))
    for i, (ids, images, _) in enumerate(cases[:3]):
        d.add(i, ids, _params(), images=images)
    d.run(2, True)  # a short plan: nobody has finished
    assert not any(t.finish for t in d.reqs.values())
    # The last image request prefills in two pieces inside the steps, beside the others'
    # verify rows (mixed forwards); the first is preempted and resumes after it (its
    # images from the tower's cache, the draft model's cache from 0).
    ids, images, _ = cases[3]
    d.add(3, ids, _params(), images=images)
    n = len(ids) - 1
    cut = n // 2
    for im in images:  # Gemma 3: a piece may not end inside an image (it attends both ways)
        if im.bidirectional and im.offset < cut < im.offset + im.length:
            cut = im.offset
    d.prefill(3, n, [cut, n - cut])
    d.preempt(0)
    d.run(8, True)
    d.resume(0)
    while any(not (t.finish or t.gone) for t in d.reqs.values()):
        d.run(8, True)
    for i, (_, _, want) in enumerate(cases):
        assert d.outputs()[i] == want, f"request {i}"
    drafted = sum(done.num_draft_tokens for done in d.done)
    accepted = sum(done.num_accepted_tokens for done in d.done)
    assert 0 <= accepted <= drafted and drafted > 0, (accepted, drafted)
    # The draft model reads the text request as the target does; n-gram lookup pays where
    # an output repeats itself (the tiny MoE's image rows end in one token over and over).
    repeats = any(len(set(want[-4:])) == 1 for _, _, want in cases)
    if method == "draft_model" or repeats:
        assert accepted > 0


def test_published_qwen3_vl_moe_folder_matches_hf(vl: str, cases: list[Any],
                                                  tmp_path: Path) -> None:
    """The published spelling of the same model (stacked experts [E, H, 2I] and [E, I, H],
    `num_experts`, `rope_scaling`) reads to the same ModelArgs and per-expert weights, a
    tensor-parallel part included, and serves HF's tokens."""
    if not Path(vl).name.startswith("tiny-qwen3_vl_moe-"):
        pytest.skip("Qwen3-VL-MoE only")
    published = published_vl_moe(vl, tmp_path)
    assert load_model_args(published) == load_model_args(vl)
    with SafetensorsCheckpoint(vl, torch.device("cpu")) as a, \
            SafetensorsCheckpoint(published, torch.device("cpu")) as b:
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            key = f"model.layers.2.mlp.experts.5.{name}.weight"
            whole = a.get(key, None)
            assert a.shape(key) == b.shape(key) == tuple(whole.shape)
            assert torch.equal(b.get(key, None), whole)
            part = whole.narrow(dim, 16, 16)
            assert torch.equal(a.get_part(key, None, dim, 16, 32), part)
            assert torch.equal(b.get_part(key, None, dim, 16, 32), part)
    serves_hf_tokens(published, cases)


def test_qwen3_5_moe_folder_matches_hf(ckpt_root: Path) -> None:
    """Qwen3.5-MoE's folder (its own tower class, experts under the hybrid model): image and
    text requests, HF's tokens."""
    path = vl_checkpoint(ckpt_root, "qwen3_5_moe")
    ref = VLReference(path)
    cases = [worker_case(ref, image_message("compare these two", 2),
                         [png_bytes(0), png_bytes(1, (60, 40))], N),
             worker_case(ref, [{"role": "user", "content": "hello there"}], [], N)]
    serves_hf_tokens(path, cases)
