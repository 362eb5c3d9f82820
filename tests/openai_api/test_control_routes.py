"""The rollout controls' HTTP routes (openai_api/control.py), over a stand-in for the
engine: absent without --enable-control-endpoints, vLLM's paths and a 400 naming the
parameter with it."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.engine_control import ControlResult
from tandem_serve.openai_api.app import build_app
from tandem_serve.tandem.offline.run_batch import call_app

PATHS = ["/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache", "/load_weights"]


class FakeControls:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.is_sleeping = False

    async def _done(self, op: str, arg: Any = None) -> ControlResult:
        self.calls.append((op, arg))
        return ControlResult(op, 0.5, "")

    async def sleep(self, level: int) -> ControlResult:
        self.is_sleeping = True
        return await self._done("sleep", level)

    async def wake_up(self) -> ControlResult:
        self.is_sleeping = False
        return await self._done("wake_up")

    async def pause(self) -> ControlResult:
        return await self._done("pause")

    async def resume(self) -> ControlResult:
        return await self._done("resume")

    async def reset_prefix_cache(self) -> ControlResult:
        return await self._done("reset_prefix_cache")

    async def load_weights(self, path: str) -> ControlResult:
        if path == "/missing":
            raise EngineError("INVALID_ARGUMENT", "load_weights: path: '/missing' is not a "
                                                  "folder")
        return await self._done("load_weights", path)


def serving() -> Any:
    return SimpleNamespace(frontend=SimpleNamespace(limits=None), models=None)


def call(app: Any, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    status, raw = asyncio.run(call_app(app, path, json.dumps(body or {}).encode()))
    return status, json.loads(raw)


def test_without_the_flag_every_control_path_is_404() -> None:
    app = build_app(serving())
    for path in PATHS:
        status, body = call(app, path)
        assert status == 404, path
        assert body["error"]["type"] == "not_found_error"


def test_with_the_flag_the_controls_answer_and_bad_input_is_400() -> None:
    controls = FakeControls()
    app = build_app(serving(), controls=controls)  # type: ignore[arg-type]
    assert call(app, "/sleep?level=2")[1]["status"] == "ok"
    assert controls.calls[-1] == ("sleep", 2)
    status, body = call(app, "/sleep?level=3")
    assert status == 400 and body["error"]["param"] == "level"
    assert call(app, "/load_weights", {"path": "/w"})[1]["op"] == "load_weights"
    status, body = call(app, "/load_weights", {"path": "/missing"})
    assert status == 400 and body["error"]["param"] == "path"
    status, body = call(app, "/load_weights", {})
    assert status == 400 and body["error"]["param"] == "path"
    for path in ("/wake_up", "/pause", "/resume", "/reset_prefix_cache"):
        assert call(app, path)[0] == 200
    assert [op for op, _ in controls.calls][-4:] == ["wake_up", "pause", "resume",
                                                     "reset_prefix_cache"]
