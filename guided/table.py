"""A token automaton (outlines-core's `Index` transitions) -> the table the gpu worker steps.

`GuidedTable` semantics (proto/guided_messages.py): states renumbered so the start is 0, row S is
DONE, entry -1 = not allowed; tokens whose column is the same in every state share a class;
the EOS ids' class is allowed only in final states and leads to DONE, which allows only EOS.

Classes come from hashing columns, never from an [S, V] matrix: any-JSON-object on a 32k
vocabulary has 1623 states, and `np.unique(axis=1)` over that matrix took 24 s where hashing
takes about a second. Each state adds a random 64-bit value of (state, next state) to the hash
of every token it allows, so two tokens share a hash when they agree in every state (or, with
odds of about 2^-64 per pair, by chance); the fill below compares every token with its class's
representative row by row, and a collision falls back to exact grouping.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from tandem_serve.guided.vocab import TokenVocabulary
from tandem_serve.proto.guided_messages import GuidedTable

Rows = list[tuple[np.ndarray, np.ndarray]]  # per new state: (token ids, next new states)

_HASH_SEEDS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0x8CB92BA72F3D8DD7)


class NoOutput(ValueError):
    """No sequence of the model's tokens satisfies the constraint."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves every output bit (uint64 wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _live_states(transitions: Mapping[int, Mapping[int, int]], finals: Iterable[int],
                 eos: set[int]) -> set[int]:
    """States from which some final state is reachable (the others are dead ends)."""
    back: dict[int, set[int]] = {}
    for s, row in transitions.items():
        for t in {n for tok, n in row.items() if tok not in eos}:
            back.setdefault(t, set()).add(s)
    live = set(finals)
    todo = list(live)
    while todo:
        for p in back.get(todo.pop(), ()):
            if p not in live:
                live.add(p)
                todo.append(p)
    return live


def _rows(transitions: Mapping[int, Mapping[int, int]], order: list[int],
          vocab: TokenVocabulary) -> Rows:
    """Each state's allowed tokens and their next states, renumbered; EOS and dead ends out."""
    lookup = np.full(max(max(transitions, default=0), *order) + 1, -1, np.int64)
    lookup[order] = np.arange(len(order))
    usable = np.array([b is not None for b in vocab.tokens] + [False], bool)
    usable[list(vocab.eos_ids)] = False
    rows: Rows = []
    for s in order:
        row = transitions.get(s, {})
        tok = np.fromiter(row.keys(), np.int64, len(row))
        nxt = np.fromiter(row.values(), np.int64, len(row))
        tok = np.minimum(tok, vocab.vocab_size)  # an id we do not know maps to "unusable"
        nxt = np.where(nxt < len(lookup), lookup[np.minimum(nxt, len(lookup) - 1)], -1)
        keep = usable[tok] & (nxt >= 0)
        rows.append((tok[keep], nxt[keep]))
    return rows


def _hash_classes(rows: Rows, vocab_size: int, seed: int) -> np.ndarray:
    h = np.zeros(vocab_size, np.uint64)
    salt = np.uint64(seed)
    for i, (tok, nxt) in enumerate(rows):
        h[tok] += _mix((np.uint64(i) << np.uint64(32)) ^ nxt.astype(np.uint64) ^ salt)
    _, token_class = np.unique(h, return_inverse=True)
    return token_class.astype(np.int64)


def _exact_classes(rows: Rows, vocab_size: int) -> np.ndarray:
    """The slow, certain grouping: unique columns of the dense [S, V] matrix."""
    dense = np.full((len(rows), vocab_size), -1, np.int32)
    for i, (tok, nxt) in enumerate(rows):
        dense[i, tok] = nxt
    _, token_class = np.unique(dense, axis=1, return_inverse=True)
    return token_class.reshape(-1).astype(np.int64)


def _fill(rows: Rows, token_class: np.ndarray) -> np.ndarray | None:
    """next[S, C] from each class's first token; None when a class holds two columns."""
    _, rep = np.unique(token_class, return_index=True)  # each class's first token
    num_classes = len(rep)
    out = np.full((len(rows), num_classes), -1, np.int32)
    dense = np.empty(len(token_class), np.int64)
    for i, (tok, nxt) in enumerate(rows):
        dense.fill(-1)
        dense[tok] = nxt
        out[i] = dense[rep]
        if not np.array_equal(dense, out[i][token_class]):
            return None
    return out


def compress(rows: Rows, vocab_size: int,
             hasher: Callable[[Rows, int, int], np.ndarray] = _hash_classes
             ) -> tuple[np.ndarray, np.ndarray]:
    """(next[S, C], token_class[V]): tokens with the same column in every state share a class."""
    for seed in _HASH_SEEDS:
        token_class = hasher(rows, vocab_size, seed)
        table = _fill(rows, token_class)
        if table is not None:
            return table, token_class
    token_class = _exact_classes(rows, vocab_size)
    table = _fill(rows, token_class)
    assert table is not None
    return table, token_class


def build_table(table_id: str, transitions: Mapping[int, Mapping[int, int]], initial: int,
                finals: Iterable[int], vocab: TokenVocabulary) -> GuidedTable:
    """The GuidedTable of an automaton over token ids (outlines-core `Index` transitions)."""
    eos = set(vocab.eos_ids)
    finals = set(finals)
    live = _live_states(transitions, finals, eos)
    if initial not in live:
        raise NoOutput("no sequence of this model's tokens satisfies it")
    order = [initial, *sorted(live - {initial})]
    rows = _rows(transitions, order, vocab)
    body, token_class = compress(rows, vocab.vocab_size)
    num_states, num_classes = body.shape
    eos_class = num_classes
    token_class[list(eos)] = eos_class
    # Classes nobody uses any more (EOS ids were in the never-allowed class) are dropped.
    used, token_class = np.unique(token_class, return_inverse=True)
    next_state = np.full((num_states + 1, num_classes + 1), -1, np.int32)
    next_state[:num_states, :num_classes] = body
    final_rows = [i for i, s in enumerate(order) if s in finals]
    next_state[final_rows, eos_class] = num_states
    next_state[num_states, eos_class] = num_states  # DONE: only EOS, forever
    return GuidedTable(table_id=table_id, next_state=np.ascontiguousarray(next_state[:, used]),
                       token_class=token_class.astype(np.int32).reshape(-1), initial_state=0)


# ------------------------------------------------------------------ reference semantics


def allowed(table: GuidedTable, state: int) -> np.ndarray:
    """bool [V]: the tokens allowed in `state` (what the gpu worker's mask keeps)."""
    return table.next_state[state][table.token_class] >= 0


def advance(table: GuidedTable, state: int, token: int) -> int:
    """The state after `token` (-1: not allowed there)."""
    return int(table.next_state[state, table.token_class[token]])


def done_state(table: GuidedTable) -> int:
    return table.next_state.shape[0] - 1
