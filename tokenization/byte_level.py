"""GPT-2's byte-level alphabet: every byte has a printable stand-in character.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) spell tokens in these stand-ins; the
postproc workers turn them back into bytes to detokenize, guided decoding to know what
text each token writes.
"""
from __future__ import annotations

from functools import cache


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode` table, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
