"""`frontend.constraints`: a compiled constraint goes to the scheduler once per id, on its own,
and again when asked; a guided request's `AddRequest` carries only the id (< 4 KB on the wire,
measured with the codec for a JSON-schema request through `EngineClient.generate`).
"""
from __future__ import annotations

import asyncio
import pathlib
import time

import numpy as np

from tandem_serve.frontend.constraints import ConstraintSender
from tandem_serve.frontend.engine_client import EngineClient
from tandem_serve.frontend.guided import attach
from tandem_serve.guided.compile import Compiler
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto import codec
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost, GuidedTable, GuidedWanted
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, OutputOptions, SamplingParams
from tandem_serve.proto.token_messages import OutputDelta
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir

TABLE = GuidedTable("t" * 64, np.zeros((2, 1), np.int32), np.zeros(4, np.int32))
GRAMMAR = GuidedGrammar("g" * 64, 'start: "x"')
PERSON = ('{"type": "object", "properties": {"name": {"type": "string"}, '
          '"age": {"type": "integer"}}, "required": ["name", "age"]}')
MAX_ADD_REQUEST = 4096


class Wire:
    """A channel that keeps what was put and its size once encoded."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []

    def put(self, msg: object) -> None:
        self.sent.append((msg, sum(len(f) for f in codec.encode(msg))))

    @property
    def messages(self) -> list[object]:
        return [m for m, _ in self.sent]


def test_each_constraint_is_sent_once_and_again_only_when_asked() -> None:
    wire = Wire()
    sender = ConstraintSender(wire.put)
    sender.open(TABLE)
    sender.open(TABLE)
    sender.open(GRAMMAR)
    assert wire.messages == [TABLE, GRAMMAR]
    sender.close(GRAMMAR)
    sender.on_wanted(GuidedWanted([TABLE.table_id, GRAMMAR.grammar_id]))
    lost = wire.messages[3]
    assert wire.messages[2] is TABLE, "an open stream's table is sent again"
    assert isinstance(lost, GuidedLost) and lost.guided_id == GRAMMAR.grammar_id
    assert "no open request" in lost.message
    sender.open(GRAMMAR)  # the loss made it unsent: the next stream sends it
    assert wire.messages[4] is GRAMMAR
    sender.close(TABLE)
    sender.close(TABLE)
    sender.close(GRAMMAR)
    assert sender.num_pinned == 0


def test_a_replaced_set_of_roles_gets_every_table_again() -> None:
    wire = Wire()
    sender = ConstraintSender(wire.put)
    sender.open(TABLE)
    sender.reset()
    sender.open(TABLE)
    assert wire.messages == [TABLE, TABLE]


def test_what_is_remembered_as_sent_is_bounded() -> None:
    wire = Wire()
    sender = ConstraintSender(wire.put, sent_kept=2)
    items = [GuidedGrammar(str(i), 'start: "x"') for i in range(3)]
    for item in items:
        sender.open(item)
        sender.close(item)
    sender.open(items[0])  # forgotten: sent again, which the scheduler takes as a no-op
    assert wire.messages == [*items, items[0]]


def _json_schema_table() -> GuidedTable:
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    item, _ = Compiler(tok, tok.vocab_size).compile(GuidedSpec(SpecKind.JSON_SCHEMA, PERSON),
                                                    "f" * 64)
    assert isinstance(item, GuidedTable)
    return item


def test_a_json_schema_request_is_small_on_the_wire(tmp_path: pathlib.Path) -> None:
    table = _json_schema_table()
    prompt = list(range(1, 201))

    async def main() -> Wire:
        cfg = ServerConfig(model="", addresses=Addresses.local(str(tmp_path), "t", 1, False))
        engine = EngineClient(cfg)
        wire = Wire()
        real = engine._to_scheduler, engine._to_postproc[0]
        engine._to_scheduler = engine._to_postproc[0] = wire  # type: ignore[assignment]
        engine._constraints = ConstraintSender(wire.put)
        try:
            for rid in (1, 2):
                sampling = SamplingParams(max_new_tokens=40)
                attach(sampling, table)
                stream = engine.generate(prompt, sampling, OutputOptions(), request_id=rid,
                                         guided=table)
                first = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0)
                engine._route(rid, OutputDelta(rid, "{}", 1,
                                               finish_reason=FinishReason.EOS_TOKEN))
                await first
                await stream.aclose()
            assert engine._constraints.num_pinned == 0
            return wire
        finally:
            engine._to_scheduler, engine._to_postproc[0] = real
            engine.close()

    start = time.monotonic()
    wire = asyncio.run(main())
    assert time.monotonic() - start < 30
    to_scheduler = [(m, n) for m, n in wire.sent if type(m).__name__ != "RegisterRequest"]
    kinds = [type(m).__name__ for m, _ in to_scheduler]
    assert kinds == ["GuidedTable", "AddRequest", "AddRequest"], kinds
    table_bytes = to_scheduler[0][1]
    assert table_bytes > 10 * MAX_ADD_REQUEST, "the schema's table is the big part"
    for msg, size in to_scheduler[1:]:
        assert isinstance(msg, AddRequest) and msg.guided is None
        assert msg.sampling.guided_id == table.table_id
        assert size < MAX_ADD_REQUEST, f"an AddRequest of {size} bytes"
