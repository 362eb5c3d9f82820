"""The frontend's view of the adapter cache: is this `adapter_id` a LoRA adapter we can serve?

Requests name adapters by id (`adapter_id`, or the older `prefix_id`); the id must name a
PEFT LoRA folder under `--adapter-cache` that fits the model (`adapters.peft`).  Every
failure is a `ValidationError` on `adapter_id` (INVALID_ARGUMENT), naming the adapter and
the reason.  Answers are cached per adapter and file stamp (mtimes and sizes of its config
and weights), so a request costs a few stat calls, and an edited adapter is read again.
The gpu worker reads the weights itself, from the same folder.
"""
from __future__ import annotations

import asyncio
import os
from collections import OrderedDict

from adapters.peft import (
    CONFIG_FILE,
    AdapterError,
    LoraAdapter,
    ModelShapes,
    adapter_folder,
    find_adapters,
    folder_stamp,
    read_adapter,
)
from rpc.validation import ValidationError

CACHE_ENTRIES = 1024  # validated ids kept (bad ones too): bounded whatever clients send
LISTED = 256  # adapter folders a listing (the OpenAI /v1/models) looks at, at most

_Entry = tuple[tuple[int, ...], LoraAdapter | AdapterError]


class AdapterStore:
    def __init__(self, cache_dir: str, shapes: ModelShapes, max_rank: int) -> None:
        self.cache_dir = cache_dir
        self.shapes = shapes
        self.max_rank = max_rank
        self._checked: OrderedDict[str, _Entry] = OrderedDict()

    def resolve(self, adapter_id: str, field: str = "adapter_id") -> LoraAdapter:
        """The adapter, or ValidationError(field) naming the adapter and the reason."""
        try:
            stamp = folder_stamp(adapter_folder(self.cache_dir, adapter_id))
            entry = self._checked.get(adapter_id)
            if entry is None or entry[0] != stamp:
                result: LoraAdapter | AdapterError
                try:
                    result = read_adapter(self.cache_dir, adapter_id, self.shapes, self.max_rank)
                except AdapterError as exc:
                    result = exc
                if stamp is not None:  # a missing file is checked again next time
                    self._remember(adapter_id, (stamp, result))
            else:
                result = entry[1]
                self._checked.move_to_end(adapter_id)
            if isinstance(result, AdapterError):  # a fresh one: the cached one keeps no trace
                raise AdapterError(result.adapter_id, result.reason)
            return result
        except AdapterError as exc:
            raise ValidationError(field, str(exc)) from None

    def names_an_adapter(self, name: str) -> bool:
        """Whether `name` is the id of a folder in the cache that holds an adapter config (a
        request naming it is then about that adapter, servable or not)."""
        try:
            folder = adapter_folder(self.cache_dir, name)
        except AdapterError:
            return False
        return os.path.isfile(os.path.join(folder, CONFIG_FILE))

    async def available(self, limit: int = LISTED) -> list[LoraAdapter]:
        """The servable adapters among the first `limit` adapter folders of the cache, by id
        (the walk runs on a thread; each answer is cached like a request's)."""
        ids = await asyncio.to_thread(find_adapters, self.cache_dir, limit)
        out = []
        for adapter_id in ids:
            try:
                out.append(self.resolve(adapter_id))
            except ValidationError:
                continue
        return out

    def _remember(self, adapter_id: str, entry: _Entry) -> None:
        self._checked[adapter_id] = entry
        self._checked.move_to_end(adapter_id)
        while len(self._checked) > CACHE_ENTRIES:
            self._checked.popitem(last=False)
