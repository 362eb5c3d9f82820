"""The frontend's view of the adapter cache: is this `adapter_id` a LoRA adapter we can serve?

Requests name adapters by id (`adapter_id`, or the older `prefix_id`); the id must name a
PEFT LoRA folder under `--adapter-cache` that fits the model (`adapters.peft`).  Every
failure is a `ValidationError` on `adapter_id` (INVALID_ARGUMENT), naming the adapter and
the reason.  Answers are cached per adapter and file stamp (mtimes and sizes of its config
and weights), so a request costs a few stat calls, and an edited adapter is read again.
The gpu worker reads the weights itself, from the same folder.

With `--allow-runtime-lora-updating` adapters are also registered at runtime under a name,
from a folder anywhere the server can read (`load`, `unload`; vLLM's `/v1/load_lora_adapter`).
Such an adapter's id, the one requests carry to the engine, is its folder's real path
(`adapters.peft.read_adapter_folder`), which no client can send itself: `adapter_folder`
refuses absolute ids. A name is resolved before the cache's ids, over both APIs.
"""
from __future__ import annotations

import asyncio
import os
from collections import OrderedDict

from tandem_serve.adapters.peft import (
    CONFIG_FILE,
    AdapterError,
    LoraAdapter,
    ModelShapes,
    adapter_folder,
    find_adapters,
    folder_stamp,
    read_adapter,
    read_adapter_folder,
)
from tandem_serve.frontend.validation import ValidationError

CACHE_ENTRIES = 1024  # validated ids kept (bad ones too): bounded whatever clients send
LISTED = 256  # adapter folders a listing (the OpenAI /v1/models) looks at, at most

_Entry = tuple[tuple[int, ...] | None, LoraAdapter | AdapterError]  # (file stamp, answer)


class AdapterStore:
    def __init__(self, cache_dir: str, shapes: ModelShapes, max_rank: int) -> None:
        self.cache_dir = cache_dir
        self.shapes = shapes
        self.max_rank = max_rank
        self._checked: OrderedDict[str, _Entry] = OrderedDict()
        self.runtime: dict[str, LoraAdapter] = {}  # loaded at runtime: name -> adapter

    def resolve(self, adapter_id: str, field: str = "adapter_id") -> LoraAdapter:
        """The adapter, or ValidationError(field) naming the adapter and the reason."""
        loaded = self.runtime.get(adapter_id)
        if loaded is not None:
            return loaded
        try:
            entry = self._check(adapter_id, self._checked.get(adapter_id))
        except AdapterError as exc:
            raise ValidationError(field, str(exc)) from None
        self._remember(adapter_id, entry)
        if isinstance(entry[1], AdapterError):  # its message; the cached error keeps no trace
            raise ValidationError(field, str(entry[1])) from None
        return entry[1]

    def _check(self, adapter_id: str, known: _Entry | None) -> _Entry:
        """The answer for the adapter's files as they are now: `known` while its stamp holds.
        Reads files, touches no state of the store (the listing runs it on a thread); raises
        AdapterError for an id that names no folder of the cache."""
        stamp = folder_stamp(adapter_folder(self.cache_dir, adapter_id))
        if known is not None and known[0] == stamp:
            return known
        try:
            return stamp, read_adapter(self.cache_dir, adapter_id, self.shapes, self.max_rank)
        except AdapterError as exc:
            return stamp, exc

    def read_folder(self, path: str) -> LoraAdapter:
        """A runtime adapter's folder checked against the model (files read: call it off the
        event loop); ValidationError on `lora_path` naming the reason."""
        try:
            return read_adapter_folder(path, self.shapes, self.max_rank)
        except AdapterError as exc:
            raise ValidationError("lora_path", str(exc)) from None

    def names_an_adapter(self, name: str) -> bool:
        """Whether `name` is the id of a folder in the cache that holds an adapter config (a
        request naming it is then about that adapter, servable or not)."""
        try:
            folder = adapter_folder(self.cache_dir, name)
        except AdapterError:
            return False
        return os.path.isfile(os.path.join(folder, CONFIG_FILE))

    async def available(self, limit: int = LISTED) -> list[LoraAdapter]:
        """The servable adapters among the first `limit` adapter folders of the cache, by id.
        The walk and any file reads run on a thread (a first listing of a large cache would
        stall every stream on the event loop); the answers are cached like a request's."""
        known = dict(self._checked)  # the thread reads this copy; the loop owns the cache

        def check_all() -> list[tuple[str, _Entry]]:
            out = []
            for adapter_id in find_adapters(self.cache_dir, limit):
                try:
                    out.append((adapter_id, self._check(adapter_id, known.get(adapter_id))))
                except AdapterError:  # gone since the walk
                    continue
            return out

        adapters = []
        for adapter_id, entry in await asyncio.to_thread(check_all):
            self._remember(adapter_id, entry)
            if isinstance(entry[1], LoraAdapter):
                adapters.append(entry[1])
        return adapters

    def _remember(self, adapter_id: str, entry: _Entry) -> None:
        if entry[0] is None:  # a missing file: checked again next time
            return
        self._checked[adapter_id] = entry
        self._checked.move_to_end(adapter_id)
        while len(self._checked) > CACHE_ENTRIES:
            self._checked.popitem(last=False)
