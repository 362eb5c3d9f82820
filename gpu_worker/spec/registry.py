"""Speculative decoding's methods: the speculative config's `method` -> the factory of its
`Proposer` (`gpu_worker.spec.proposer`).  A new method is one module implementing the
interface plus one line here (and its keys in `proto.speculative`, which validates the
config at start without importing the worker: tests check both name the same methods).
"""
from __future__ import annotations

from collections.abc import Callable

from tandem_serve.gpu_worker.spec.draft_model import load_draft
from tandem_serve.gpu_worker.spec.ngram import build_ngram
from tandem_serve.gpu_worker.spec.proposer import Proposer, ProposerContext
from tandem_serve.proto.speculative import SpeculativeConfig

ProposerFactory = Callable[[SpeculativeConfig, ProposerContext], Proposer]

PROPOSERS: dict[str, ProposerFactory] = {
    "ngram": build_ngram,
    "draft_model": load_draft,
}


def make_proposer(config: SpeculativeConfig | None, ctx: ProposerContext) -> Proposer | None:
    """The proposer of `config`'s method (None: speculation off); a method no module
    implements is a ValueError naming the field."""
    if config is None:
        return None
    factory = PROPOSERS.get(config.method)
    if factory is None:
        raise ValueError(f"--speculative-config: method {config.method!r} is not one of "
                         f"{', '.join(PROPOSERS)}")
    return factory(config, ctx)
