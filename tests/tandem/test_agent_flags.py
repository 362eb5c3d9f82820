"""The tool, reasoning and chat-template flags: they reach ServerConfig (also from
TANDEM_<FLAG>), and a wrong value is one `tandem: error:` line with exit status 2."""
from __future__ import annotations

import pathlib

import pytest

from tandem_serve.tandem.cli import build_parser, config_from_args


def serve_config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", "--model", "/m", *argv]))


def test_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch,
                                tmp_path: pathlib.Path) -> None:
    d = serve_config([])
    assert (d.enable_auto_tool_choice, d.tool_call_parser, d.reasoning_parser,
            d.chat_template) == (False, "", "", "")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    c = serve_config(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--reasoning-parser", "qwen3", "--chat-template", "t.jinja"])
    assert (c.enable_auto_tool_choice, c.tool_call_parser, c.reasoning_parser) == (
        True, "hermes", "qwen3")
    assert c.chat_template == str(template)  # absolute: the frontend may start elsewhere
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert serve_config(["--chat-template", inline]).chat_template == inline
    monkeypatch.setenv("TANDEM_TOOL_CALL_PARSER", "mistral")
    monkeypatch.setenv("TANDEM_ENABLE_AUTO_TOOL_CHOICE", "true")
    e = serve_config([])
    assert (e.enable_auto_tool_choice, e.tool_call_parser) == (True, "mistral")


@pytest.mark.parametrize("argv, message", [
    (["--tool-call-parser", "gpt"], "--tool-call-parser 'gpt' is not one of hermes, "
                                    "llama3_json, mistral"),
    (["--reasoning-parser", "o1"], "--reasoning-parser 'o1' is not one of deepseek_r1, qwen3"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "no/such/file.jinja"], "--chat-template 'no/such/file.jinja' does "
                                                "not exist"),
])
def test_wrong_values_are_one_error_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                    argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_config(argv)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith("tandem: error: ") and message in err[0], err
