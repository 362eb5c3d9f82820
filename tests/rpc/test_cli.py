"""The server flags: every one reaches ServerConfig, from the command line or TANDEM_<FLAG>."""
from __future__ import annotations

import pytest

from rpc.cli import build_parser, config_from_args


def serve_config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", "--model", "/m", *argv]))


def test_kernel_flags_default_on_and_turn_off() -> None:
    d = serve_config([])
    assert (d.enforce_eager, d.onednn, d.flash_attn) == (False, True, True)
    c = serve_config(["--enforce-eager", "--no-onednn", "--no-flash-attn"])
    assert (c.enforce_eager, c.onednn, c.flash_attn) == (True, False, False)


@pytest.mark.parametrize("name, value, field, want", [
    ("TANDEM_ONEDNN", "0", "onednn", False),
    ("TANDEM_FLASH_ATTN", "false", "flash_attn", False),
    ("TANDEM_ENFORCE_EAGER", "1", "enforce_eager", True),
    ("TANDEM_NUM_SCHEDULER_STEPS", "4", "num_scheduler_steps", 4),
    ("TANDEM_ASYNC_POSTPROC", "false", "async_postproc", False),
])
def test_environment_sets_flag_defaults(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                        field: str, want: object) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(serve_config([]), field) == want


def test_command_line_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_ONEDNN", "0")
    assert serve_config(["--onednn"]).onednn is True
