"""`--speculative-config`: vLLM's JSON spelling, validated at start (exit 2, one error line)."""
from __future__ import annotations

import json
import pathlib

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
    # Every eligible row speculates, as in vLLM, instead of the measured rule's choice.
    assert not parse_speculative('{"method": "ngram", "num_speculative_tokens": 3, '
                                 '"adaptive": false}').adaptive  # type: ignore[union-attr]


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle", "num_speculative_tokens": 4}',
     "method 'eagle' is not one of ngram, draft_model"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}',
     "model is required for method 'draft_model'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be an integer between 1 and 16 (got 0)"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "between 1 and 16 (got 17)"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "(got 2.5)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}',
     "prompt_lookup_min (5) must not exceed prompt_lookup_max (4)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
     "unknown key 'model' for method 'ngram'"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 2, '
     '"prompt_lookup_max": 3}', "unknown key 'prompt_lookup_max' for method 'draft_model'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"}',
     "adaptive must be true or false (got 'no')"),
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


def write_config(folder: pathlib.Path, vocab_size: int) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "vocab_size": vocab_size}))
    return str(folder)


def test_a_draft_model_config_is_parsed(tmp_path: pathlib.Path) -> None:
    target, draft = write_config(tmp_path / "t", 512), write_config(tmp_path / "d", 512)
    text = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    assert serve_config(["--model", target, "--speculative-config", text]
                        ).speculative_config == text
    assert parse_speculative(text) == SpeculativeConfig("draft_model", 3, model=draft)


@pytest.mark.parametrize("draft, k, message", [
    ("d", 3, "has vocab_size 300, the target"),
    ("missing", 3, "has no config.json"),
    ("empty", 3, "has no config.json"),
    ("d", 0, "num_speculative_tokens must be an integer between 1 and 16 (got 0)"),
    ("d", 17, "num_speculative_tokens must be an integer between 1 and 16 (got 17)"),
])
def test_bad_draft_models_exit_2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                 draft: str, k: int, message: str) -> None:
    target = write_config(tmp_path / "t", 512)
    write_config(tmp_path / "d", 300)
    (tmp_path / "empty").mkdir()
    text = json.dumps({"method": "draft_model", "model": str(tmp_path / draft),
                       "num_speculative_tokens": k})
    with pytest.raises(SystemExit) as exc:
        serve_config(["--model", target, "--speculative-config", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tandem: error: --speculative-config")
    assert err.count("\n") == 1
