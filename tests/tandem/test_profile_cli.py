"""`tandem profile` argument handling that needs no server."""
from __future__ import annotations

import argparse

import pytest

from tandem_serve.tandem import profile_cli
from tests.e2e.server import free_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_window_defaults() -> None:
    assert profile_cli._window(parse())[0] == profile_cli.DEFAULT_DURATION
    assert profile_cli._window(parse("--duration", "2"))[0] == 2
    duration, what = profile_cli._window(parse("--plans", "20"))
    assert duration == profile_cli.PLANS_DEADLINE and "20 plans" in what
    assert profile_cli._window(parse("--plans", "20", "--duration", "9"))[0] == 9


def test_no_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_cli.main(parse("--port", str(free_port()), "--duration", "1")) == 1
    assert "failed: UNAVAILABLE" in capsys.readouterr().err
