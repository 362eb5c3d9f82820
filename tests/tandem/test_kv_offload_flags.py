"""`--kv-offloading-size` and `--kv-events-config`: vLLM's spellings, validated at start (exit
2, one error line naming the key)."""
from __future__ import annotations

import pathlib

import pytest

from tandem_serve.harness.processes import free_port
from tandem_serve.proto.kv_events import parse_kv_events
from tandem_serve.tandem.cli import build_parser, config_from_args
from tests.tandem.test_startup_errors import assert_one_line_error, serve


def serve_config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))


def test_off_by_default_and_spread_over_the_ranks() -> None:
    cfg = serve_config([])
    assert cfg.kv_offloading_size == 0 and not parse_kv_events(cfg.kv_events_config).publishing
    cfg = serve_config(["--kv-offloading-size", "8", "--tensor-parallel-size", "2",
                        "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert cfg.worker().kv_offloading_gib == 4.0  # vLLM's size is the sum over the ranks
    assert parse_kv_events(cfg.kv_events_config).publishing


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-offloading-size", "-1"], "--kv-offloading-size must be between 0"),
    (["--kv-offloading-size", "1", "--no-prefix-caching"],
     "--kv-offloading-size needs prefix caching"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": 5557}'],
     "--kv-events-config: endpoint must be a string"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "topik": "x"}'],
     "--kv-events-config: unknown key 'topik'"),
    (["--kv-events-config", "{"], "--kv-events-config is not JSON"),
])
def test_bad_values_exit_2_naming_the_key(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_config(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and message in err and err.count("\n") == 1


def test_a_pool_larger_than_free_memory_is_refused_at_start(
        fast_model_dir: pathlib.Path) -> None:
    """Before any process starts (the gpu worker checks again on its own host: under the
    compose roles it may be another one, tests/gpu_worker/test_kv_offload.py)."""
    proc = serve("--model", str(fast_model_dir), "--port", str(free_port()),
                 "--http-port", "0", "--log-level", "WARNING", "--kv-offloading-size",
                 "100000")
    line = assert_one_line_error(proc, "--kv-offloading-size asks for 100000.00 GiB of host "
                                 "memory", "available: lower it")
    assert proc.stderr.strip() == line
