"""Guided and LoRA rows in mixed steps: requests that join while others decode prefill in
pieces under their adapter and start their automaton when they start decoding; the outputs
equal PEFT's model with the same outlines-core guide (greedy, float32), as in
test_lora_guided.py, with the real scheduler placing the pieces.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem_serve.proto.request_params import SamplingParams
from tests.gpu_worker.guided_utils import guided, guided_checkpoint, table, text
from tests.gpu_worker.model_utils import EOS_ID
from tests.gpu_worker.runner_driver import make_runner
from tests.gpu_worker.served import Served
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.test_lora_guided import NEW, PROMPTS, REGEXES, ROWS, SLOTS, expected
from tests.lora_utils import make_adapters


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return guided_checkpoint(tmp_path_factory.mktemp("mixed-lora-guided-ckpt"))


@pytest.fixture(scope="module")
def cache(path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapters(path, tmp_path_factory.mktemp("mixed-lora-guided-adapters"), SLOTS)


@pytest.mark.parametrize("k, async_mode", [(8, True), (1, False)])
def test_guided_and_adapter_rows_joining_in_pieces(path: str, cache: Path, k: int,
                                                   async_mode: bool) -> None:
    runner = make_runner(path, adapter_cache=str(cache), max_loras=2)
    runner.step_guard = forbid_host_sync
    served = Served(runner, k, async_mode, budget=12, params=dict(max_loras=2))
    tables = [table(path, rx) for rx in REGEXES]
    for rid, (adapter, i) in ROWS.items():
        sampling = (SamplingParams(max_new_tokens=NEW, stop_token_ids=[EOS_ID]) if i is None
                    else guided(tables[i], NEW))
        served.add(rid, PROMPTS[rid], sampling, after_plans=0 if rid in (0, 2, 5) else 1,
                   guided=tables[i] if i is not None else None, adapter_id=adapter or "")
    out = served.run()
    if k > 1:
        assert served.spread(), "prompts were cut into pieces over the steps"
    for rid, (adapter, i) in ROWS.items():
        assert out[rid] == expected(path, cache, rid), f"request {rid} ({adapter or 'base'})"
        if i is not None:
            assert re.fullmatch(REGEXES[i], text(path, out[rid]))
    served.close()
