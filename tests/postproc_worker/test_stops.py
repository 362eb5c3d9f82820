"""StopChecker: matching across deltas, hold-back that never has to be taken back."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tandem_serve.postproc_worker.detokenizer import IncrementalDetokenizer
from tandem_serve.postproc_worker.stops import StopChecker
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import byte_level_bpe_dir, sentencepiece_dir


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming truth: earliest occurrence wins, ties go to the longest stop."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (best is None or (i, -len(s)) < best[:2]):
            best = (i, -len(s), s)
    if best is None:
        return text, None
    i, _, s = best
    return text[: i + len(s) if include else i], s


def run(checker: StopChecker, deltas: Sequence[str]) -> tuple[list[str], str | None, str]:
    out, matched = [], None
    for d in deltas:
        emitted, m = checker.feed(d)
        out.append(emitted)
        if m is not None:
            matched = m
    return out, matched, checker.flush()


def split(text: str, rng: random.Random) -> list[str]:
    parts, i = [], 0
    while i < len(text):
        k = rng.randint(0, 4)
        parts.append(text[i:i + k])
        i += k
    return parts


@pytest.mark.parametrize("include", [True, False])
def test_stop_split_over_three_deltas(include: bool) -> None:
    c = StopChecker(["<END>"], include)
    assert c.feed("Hello <E") == ("Hello ", None)
    assert c.feed("N") == ("", None)
    emitted, matched = c.feed("D> trailing")
    assert matched == "<END>"
    assert emitted == ("<END>" if include else "")
    assert c.feed("more") == ("", None)
    assert c.flush() == ""
    assert c.matched == "<END>"


def test_false_start_is_released() -> None:
    c = StopChecker(["<END>"], False)
    assert c.feed("a <EN") == ("a ", None)
    assert c.feed("X b") == ("<ENX b", None)
    assert c.feed("<") == ("", None)
    assert c.flush() == "<"
    assert c.matched is None


def test_no_stops_is_a_pass_through() -> None:
    c = StopChecker([], True)
    assert c.feed("abc") == ("abc", None)
    assert c.flush() == ""


def test_match_inside_one_delta_cuts_exactly() -> None:
    assert StopChecker(["stop"], False).feed("go stop go") == ("go ", "stop")
    assert StopChecker(["stop"], True).feed("go stop go") == ("go stop", "stop")


def test_earliest_wins_even_if_it_completes_later() -> None:
    # "c" is complete first, but "abcd" starts earlier and may still complete: wait for it.
    c = StopChecker(["c", "abcd"], False)
    assert c.feed("xab") == ("x", None)
    assert c.feed("c") == ("", None)
    assert c.feed("d!") == ("", "abcd")
    c = StopChecker(["c", "abcd"], False)
    c.feed("xab")
    c.feed("c")
    assert c.feed("e") == ("ab", "c")  # "x" went out with the first feed


def test_tie_goes_to_the_longest() -> None:
    c = StopChecker(["\n", "\n\n"], True)
    assert c.feed("para\n") == ("para", None)
    assert c.feed("\nnext") == ("\n\n", "\n\n")
    c = StopChecker(["\n", "\n\n"], True)
    c.feed("para\n")
    assert c.feed("next") == ("\n", "\n")


def test_pending_match_is_resolved_at_flush() -> None:
    c = StopChecker(["\n", "\n\n"], False)
    assert c.feed("end\n") == ("end", None)
    assert c.flush() == ""
    assert c.matched == "\n"


def test_unicode_stop_sequences() -> None:
    family = "👩‍👩‍👧‍👦"
    c = StopChecker([family, "。"], True)
    parts = ["你好", "👩\u200d", "👩\u200d👧", "\u200d👦 rest"]
    out, matched, tail = run(c, parts)
    assert "".join(out) + tail == "你好" + family
    assert matched == family


def test_random_streams_match_the_reference() -> None:
    rng = random.Random(7)
    alphabet = "ab\n é"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 4))
        ]
        include = rng.random() < 0.5
        want_text, want_stop = reference(text, stops, include)
        c = StopChecker(stops, include)
        released = ""
        for part in split(text, rng):
            emitted, matched = c.feed(part)
            released += emitted
            # hold-back means released text is never taken back
            assert want_text.startswith(released), (text, stops, released)
            if matched is not None:
                break
        released += c.flush()
        assert released == want_text, (text, stops, include)
        assert c.matched == want_stop, (text, stops)


@pytest.mark.parametrize("build", [sentencepiece_dir, byte_level_bpe_dir])
def test_with_detokenizer_across_plans(build: object) -> None:
    # A stop string spread over several tokens that arrive in different plans.
    tok = Tokenizer.from_dir(str(build()))  # type: ignore[operator]
    text = "Le café est très bon. ###STOP### ignored tail"
    ids = tok.raw.encode(text, add_special_tokens=False).ids
    det = IncrementalDetokenizer(tok, tok.encode("prompt"))
    checker = StopChecker(["###STOP###", "never"], include_stop_sequence=False)
    out, matched = [], None
    for plan in [ids[i:i + 3] for i in range(0, len(ids), 3)]:
        for t in plan:
            emitted, m = checker.feed(det.add([t]))
            out.append(emitted)
            if m:
                matched = m
                break
        if matched:
            break
    assert matched == "###STOP###"
    assert "".join(out) == tok.decode(ids).split("###STOP###")[0]
