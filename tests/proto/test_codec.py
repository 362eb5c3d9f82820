"""The msgpack codec: round trips, zero-copy frames, and clear errors on bad input."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from tandem_serve.proto import codec
from tandem_serve.proto.adapter_messages import AdapterFailed, AdapterLoad
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.plan_messages import NewRequest, StepDone, StepPlan
from tandem_serve.proto.request_params import FinishReason, GuidedKind, SamplingParams
from tandem_serve.proto.token_messages import OutputBatch, OutputDelta, TokenBatch


def test_step_plan_round_trip_with_nested_dataclasses() -> None:
    plan = StepPlan(3, 8, new=[NewRequest(7, np.arange(5, dtype=np.int32),
                                          SamplingParams(temperature=0.5, stop_token_ids=[2]),
                                          [1, 2], 0, 4)], drop=[9])
    out = codec.decode(codec.encode(plan))
    assert isinstance(out, StepPlan) and out.plan_id == 3 and out.drop == [9]
    assert out.new[0].sampling == plan.new[0].sampling
    np.testing.assert_array_equal(out.new[0].prompt_ids, plan.new[0].prompt_ids)


def test_step_plan_carries_guided_constraints() -> None:
    table = GuidedTable("t", np.arange(600, dtype=np.int32).reshape(20, 30) - 1,
                        np.arange(512, dtype=np.int32) % 30, initial_state=2)
    sampling = SamplingParams(guided_kind=GuidedKind.TABLE, guided_id="t")
    plan = StepPlan(1, 8, new=[NewRequest(7, np.arange(3, dtype=np.int32), sampling, [1], 0, 2)],
                    tables=[table, GuidedGrammar("g", 'start: "x"')], drop_tables=["old"])
    out = codec.decode([bytes(f) for f in codec.encode(plan)])
    got, grammar = out.tables
    assert isinstance(got, GuidedTable) and got.table_id == "t" and got.initial_state == 2
    np.testing.assert_array_equal(got.next_state, table.next_state)
    np.testing.assert_array_equal(got.token_class, table.token_class)
    assert grammar == GuidedGrammar("g", 'start: "x"') and out.drop_tables == ["old"]
    assert out.new[0].sampling.guided_kind is GuidedKind.TABLE


def test_lora_deltas_round_trip() -> None:
    plan = StepPlan(4, 8, new=[NewRequest(7, np.arange(3, dtype=np.int32), SamplingParams(),
                                          [1], 0, 2, lora_slot=2)],
                    adapters=[AdapterLoad(2, "team/sql")])
    out = codec.decode(codec.encode(plan))
    assert out.adapters == [AdapterLoad(2, "team/sql")] and out.new[0].lora_slot == 2
    failed = AdapterFailed(4, "team/sql", 2, "adapter 'team/sql': truncated", [7, 8])
    assert codec.decode(codec.encode(failed)) == failed


def test_large_arrays_travel_as_their_own_frame() -> None:
    big = np.arange(4096, dtype=np.int32)
    batch = TokenBatch(1, 0, np.arange(4096, dtype=np.int64), big, np.zeros(4096, np.uint8))
    frames = codec.encode(batch)
    assert len(frames) == 4  # body + three arrays of at least INLINE_LIMIT bytes
    out = codec.decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(out.token_ids, big)
    assert out.logprobs is None


def test_enums_come_back_as_enums() -> None:
    msg = OutputBatch([OutputDelta(1, "hé", 3, finish_reason=FinishReason.STOP_SEQUENCE)])
    out = codec.decode(codec.encode(msg))
    assert out.deltas[0].finish_reason is FinishReason.STOP_SEQUENCE
    assert out.deltas[0].text == "hé"


def test_torch_tensors_are_encoded_as_arrays() -> None:
    torch = pytest.importorskip("torch")
    done = StepDone(1, torch.arange(3), np.ones(3, np.int32), np.zeros(0, np.int64),
                    np.zeros(0, np.uint8), 0.1, 0.2)
    out = codec.decode(codec.encode(done))
    np.testing.assert_array_equal(out.request_ids, [0, 1, 2])


@pytest.mark.parametrize("frames, match", [
    ([], "empty"),
    ([b"\xc1garbage"], "malformed"),
    ([msgpack.packb([99, 1])], "schema version 99"),
    ([msgpack.packb([codec.SCHEMA_VERSION, {"a": 1}])], "not a message"),
    ([msgpack.packb([codec.SCHEMA_VERSION, msgpack.ExtType(3, msgpack.packb([999, 1]))])],
     "unknown message type"),
])
def test_bad_frames_raise_codec_error(frames: list[bytes], match: str) -> None:
    with pytest.raises(codec.CodecError, match=match):
        codec.decode(frames)


def test_unregistered_types_are_refused() -> None:
    with pytest.raises(codec.CodecError):
        codec.encode({"not": "a message"})
