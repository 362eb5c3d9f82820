"""LoRA x guided decoding in the runner: guided rows under adapters equal PEFT's model with the
same outlines-core guide as a LogitsProcessor (greedy, float32).

The runner puts guided rows first, grouped by constraint, then the rest; within each group
rows of one adapter are adjacent.  The mix below gives the "attn" adapter three separate
ranges (two constraints and an unguided row), so its forwards take the masked form, and
"all" two ranges (segments): both LoRA forms meet the guided masks.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem_serve.harness.guided_tables import choice_regex
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tests.gpu_worker.guided_utils import guided, guided_checkpoint, hf_guided, table, text
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, make_runner
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.lora_utils import make_adapters, peft_greedy

NUM = "[0-9]{1,4}-[a-z]{2,5}"
CHOICE = choice_regex(["yes", "no", "maybe", "the quick fox"])
WORDS = "[a-z ]{3,30}"
REGEXES = [NUM, CHOICE, WORDS]
SLOTS = {"attn": 1, "all": 2}
# request -> (adapter or None, regex index or None: unguided)
ROWS: dict[int, tuple[str | None, int | None]] = {
    0: ("attn", 0), 1: ("all", 0), 2: (None, 0), 3: ("attn", 1), 4: ("all", 2),
    5: ("attn", None), 6: (None, None), 7: ("all", None)}
NEW = 40
PROMPTS = random_prompts([12, 30, 7, 41, 19, 25, 33, 16], 512, seed=31)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return guided_checkpoint(tmp_path_factory.mktemp("lora-guided-ckpt"))


@pytest.fixture(scope="module")
def cache(path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-guided-adapters")
    return make_adapters(path, root, SLOTS)


def expected(path: str, cache: Path, rid: int) -> list[int]:
    adapter, i = ROWS[rid]
    folder = str(cache / adapter) if adapter else None
    if i is None:
        return peft_greedy(path, folder, [PROMPTS[rid]], NEW)[0]
    return hf_guided(path, REGEXES[i], PROMPTS[rid], NEW, adapter=folder)


@pytest.mark.parametrize("k, per_step", [(8, True), (1, False)])
def test_guided_rows_under_adapters_equal_peft_with_the_guide(path: str, cache: Path, k: int,
                                                              per_step: bool) -> None:
    runner = make_runner(path, adapter_cache=str(cache), max_loras=2)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=k)
    tables = [table(path, rx) for rx in REGEXES]
    for t in tables:
        d.send_table(t)
    for name, slot in SLOTS.items():
        d.load(slot, name)

    def add(rid: int) -> None:
        adapter, i = ROWS[rid]
        sampling = (SamplingParams(max_new_tokens=NEW, stop_token_ids=[EOS_ID]) if i is None
                    else guided(tables[i], NEW))
        d.add(rid, PROMPTS[rid], sampling, lora_slot=SLOTS[adapter] if adapter else 0)

    for rid in (0, 2, 3, 5, 6):
        add(rid)
    d.run(k, per_step)
    for rid in (1, 4, 7):  # join a running batch: "all" joins the groups "attn" is in
        add(rid)
    while any(not t.finish for t in d.reqs.values()):
        d.run(k, per_step)
    assert d.runner.lora is not None and d.runner.lora.adapter_of == {1: "attn", 2: "all"}
    for rid, (adapter, i) in ROWS.items():
        out = d.reqs[rid].out
        assert out == expected(path, cache, rid), f"request {rid} ({adapter or 'base'})"
        if i is not None:
            assert d.reqs[rid].finish == FinishReason.EOS_TOKEN
            assert re.fullmatch(REGEXES[i], text(path, out)), text(path, out)
    # The adapters change what the guide lets through (else parity would prove nothing).
    base_num = hf_guided(path, NUM, PROMPTS[0], NEW), hf_guided(path, NUM, PROMPTS[1], NEW)
    assert (d.reqs[0].out, d.reqs[1].out) != base_num
    assert d.reqs[4].out != hf_guided(path, WORDS, PROMPTS[4], NEW)
