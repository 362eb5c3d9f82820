"""`--speculative-config`: vLLM's JSON spelling, validated at start (exit 2, one error line)."""
from __future__ import annotations

import pytest

from tandem_serve.proto.speculative import SpeculativeConfig, parse_speculative
from tandem_serve.tandem.cli import build_parser, config_from_args


def serve_config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))


def test_off_by_default_and_parsed_as_vllm_spells_it() -> None:
    assert serve_config([]).speculative_config == ""
    assert parse_speculative("") is None
    text = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, '
            '"prompt_lookup_min": 2}')
    assert serve_config(["--speculative-config", text]).speculative_config == text
    assert parse_speculative(text) == SpeculativeConfig("ngram", 4, 5, 2)
    # vLLM's defaults for the lookup window when only k is given.
    assert parse_speculative('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, 4, 2)


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle' is not one of ngram"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "method 'draft_model'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be an integer between 1 and 16 (got 0)"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "between 1 and 16 (got 17)"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "(got 2.5)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}',
     "prompt_lookup_min (5) must not exceed prompt_lookup_max (4)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown key 'model'"),
    ("[4]", "must be a JSON object"),
    ("{method", "is not JSON"),
])
def test_bad_configs_exit_2_naming_the_key(capsys: pytest.CaptureFixture[str], value: str,
                                           message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_config(["--speculative-config", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tandem: error: --speculative-config")
    assert err.count("\n") == 1
