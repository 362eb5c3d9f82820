"""The rollout controls over HTTP (`--enable-control-endpoints`; 404 without), vLLM's paths:

    POST /sleep?level=N         free the KV cache (1) and the weights too (2); answers once
                                the requests running finished and the memory is freed
    POST /wake_up               weights and KV cache back (the weights re-read after level 2)
    GET  /is_sleeping           {"is_sleeping": bool}
    POST /pause                 no new work starts; answers at once, running requests wait
    POST /resume                they continue where they stopped
    POST /reset_prefix_cache    no cached prompt block is found again
    POST /load_weights          {"path": DIR}: the weights replaced in place (same
                                architecture), the prefix cache reset; works while asleep

A request that arrives while the engine sleeps waits in the queue for /wake_up (no 503).
Each answer is `{"status": "ok", "op", "seconds", "detail"}`; bad input is a 400 in the API's
error shape naming the parameter.  `frontend/engine_control.py` does the work.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.engine_control import ControlResult, EngineControls
from tandem_serve.openai_api.errors import ApiError


class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


def _ok(result: ControlResult) -> dict[str, Any]:
    return {"status": "ok", "op": result.op, "seconds": round(result.seconds, 4),
            "detail": result.detail}


def add_control_routes(app: FastAPI, controls: EngineControls) -> None:
    async def run(work: Any, param: str | None = None) -> dict[str, Any]:
        try:
            return _ok(await work)
        except EngineError as exc:
            raise ApiError.from_engine(exc, param) from None

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        if level not in (1, 2):
            raise ApiError(400, f"level: must be 1 or 2, got {level}", "level",
                           "invalid_parameter")
        return await run(controls.sleep(level), "level")

    @app.post("/wake_up")
    async def wake_up() -> dict[str, Any]:
        return await run(controls.wake_up())

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": controls.is_sleeping}

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        return await run(controls.pause())

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        return await run(controls.resume())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return await run(controls.reset_prefix_cache())

    @app.post("/load_weights")
    async def load_weights(body: LoadWeightsRequest) -> dict[str, Any]:
        return await run(controls.load_weights(body.path), "path")
