"""What the OpenAI `model` field may name: the base model or one of its LoRA adapters.

The base model answers to `--served-model-name` (else its folder's name) and to the `--model`
path.  With `--adapter-cache`, an adapter answers to its id (a folder of the cache, as
`adapter_id` names it over gRPC): vLLM's convention for LoRA, so a client picks an adapter
the way it picks a model.  Base names win over an adapter of the same id.  A name that is
neither is a 404 naming it; a folder of the cache with an adapter config that cannot be
served (not LoRA, rank over the limit, corrupt) is a 400 on `model` with the reason.

`GET /v1/models` lists the base model, then the adapters loaded at runtime under their names
(`openai_api/lora_admin.py`), then the servable adapters among the first 256 adapter folders
of the cache by id, each with `parent` = the base model's name (as vLLM lists LoRA modules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.validation import ValidationError
from tandem_serve.openai_api.errors import ApiError


@dataclass(frozen=True)
class Target:
    name: str  # what replies carry in `model`: the base model's first name, or the adapter id
    adapter_id: str = ""  # "": the base model


class Models:
    def __init__(self, names: tuple[str, ...], adapters: AdapterStore | None,
                 created: int) -> None:
        self.names = names  # the first is the one listed and echoed
        self.adapters = adapters
        self.created = created

    @property
    def base(self) -> str:
        return self.names[0]

    def resolve(self, model: str | None) -> Target:
        """The base model or an adapter; ApiError 404 for an unknown name, 400 for an adapter
        folder that cannot be served."""
        if model is None or model in self.names:
            return Target(self.base)
        loaded = self.adapters.runtime.get(model) if self.adapters is not None else None
        if loaded is not None:
            return Target(model, loaded.adapter_id)
        if self.adapters is not None and self.adapters.names_an_adapter(model):
            try:
                return Target(model, self.adapters.resolve(model, "model").adapter_id)
            except ValidationError as exc:
                raise ApiError.bad_parameter(exc) from None
        also = (" and the LoRA adapters of its adapter cache (GET /v1/models lists them)"
                if self.adapters is not None else "")
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{self.base}`{also}", "model", "model_not_found")

    def card(self, target: Target, max_model_len: int | None) -> dict[str, Any]:
        card: dict[str, Any] = {"id": target.name, "object": "model", "created": self.created,
                                "owned_by": "tandem",
                                "parent": self.base if target.adapter_id else None}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card

    async def listed(self, max_model_len: int | None) -> list[dict[str, Any]]:
        targets = [Target(self.base)]
        if self.adapters is not None:
            targets += [Target(name, a.adapter_id) for name, a in self.adapters.runtime.items()]
            targets += [Target(a.adapter_id, a.adapter_id)
                        for a in await self.adapters.available()]
        return [self.card(t, max_model_len) for t in targets]
