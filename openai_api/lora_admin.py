"""Runtime LoRA adapters (`--allow-runtime-lora-updating`), in vLLM's shapes and statuses:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}
    POST /v1/unload_lora_adapter  {"lora_name"}

200 with vLLM's plain-text success line; 400 for a missing field, a name already served (the
base model's, an adapter cache id's, or one loaded before, unless `load_inplace`) or a folder
that is not a servable adapter (the reason named, as for the cache's adapters); 404 for a
path that is no folder and for unloading a name that is not loaded. A loaded name is a
`model` over HTTP (and an `adapter_id` over gRPC) and is listed by `GET /v1/models`.

Loading only checks the folder (off the event loop) and registers the name: the weights go
to the gpu worker when a request first needs them, into an adapter slot like any adapter's
(`scheduler/lora_slots.py`). Unloading never disturbs requests in flight: the name is gone
for new requests at once, the requests already submitted finish with the adapter, and its
slot is reused only once no request holds it.
"""
from __future__ import annotations

import asyncio
import os
import re

from fastapi import FastAPI
from starlette.responses import PlainTextResponse

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.models import Models
from tandem_serve.openai_api.protocol import Strict

# What a name may hold: it is a `model` in requests, replies, logs and /v1/models/{name}.
LORA_NAME = re.compile(r"[\w.\-/:]{1,256}")


class LoadLoraAdapterRequest(Strict):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter loaded under the same name


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = ""


def add_lora_routes(app: FastAPI, models: Models) -> None:
    store = models.adapters
    assert store is not None, "runtime LoRA needs the adapter cache's store"

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if not name or not body.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_name" if not name else "lora_path", "invalid_parameter")
        _check_name(models, name, body.load_inplace)
        if not os.path.isdir(body.lora_path):
            raise ApiError(404, f"Loading lora {name} failed: No adapter found for "
                                f"{body.lora_path}", "lora_path", "not_found")
        try:
            adapter = await asyncio.to_thread(store.read_folder, body.lora_path)
        except ValidationError as exc:
            raise ApiError.bad_parameter(exc) from None
        _check_name(models, name, body.load_inplace)  # a concurrent load may have won
        store.runtime[name] = adapter
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if not name:
            raise ApiError(400, "'lora_name' must be provided.", "lora_name",
                           "invalid_parameter")
        if store.runtime.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                           "not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _check_name(models: Models, name: str, replace: bool) -> None:
    if not LORA_NAME.fullmatch(name):
        raise ApiError(400, f"lora_name: at most 256 letters, digits and '_-./:', got "
                            f"{name[:60]!r}", "lora_name", "invalid_parameter")
    store = models.adapters
    assert store is not None
    if name in models.names or store.names_an_adapter(name):
        raise ApiError(400, f"lora_name: {name!r} is already served (the base model or an "
                            f"adapter of the adapter cache)", "lora_name", "invalid_parameter")
    if name in store.runtime and not replace:
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.",
                       "lora_name", "invalid_parameter")
