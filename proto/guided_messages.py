"""Guided decoding's constraints on the wire: a compiled table or a grammar, sent once per id
on each hop (frontend -> scheduler -> gpu worker), and the scheduler's asking for one again.

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GuidedTable:
    """A regular constraint (regex, choice, JSON schema, any JSON object) compiled to a token
    automaton, which the gpu worker steps on the device (`guided/`,
    `gpu_worker/constrain/tables.py`).

    States 0..S-1 are the automaton's; row S of `next_state` is DONE. Tokens that behave the
    same in every state share a class. The EOS ids' class is allowed only in final states and
    leads to DONE; DONE allows only EOS, so a row always has a legal token, and a final state
    with no other continuation forces EOS.
    """

    table_id: str  # content hash of (constraint, tokenizer, vocab size, format version)
    next_state: np.ndarray  # int32 [S + 1, C]: next state, -1 = class not allowed
    token_class: np.ndarray  # int32 [V], V = the model's vocab size
    initial_state: int = 0


@dataclass
class GuidedGrammar:
    """A context-free grammar, matched with llguidance on the gpu worker's host."""

    grammar_id: str  # content hash of (grammar, tokenizer, format version)
    lark: str  # the grammar in llguidance's Lark dialect (GBNF converted by the frontend)


@dataclass
class GuidedWanted:
    """Scheduler -> frontend: send these constraints' tables (again): requests name them,
    and neither the scheduler nor the gpu worker holds them (never sent to this scheduler,
    or dropped at the worker while a request waited)."""

    guided_ids: list[str]


@dataclass
class GuidedLost:
    """Frontend -> scheduler: a wanted constraint cannot be had; the requests that name it
    fail with `message`."""

    guided_id: str
    message: str
