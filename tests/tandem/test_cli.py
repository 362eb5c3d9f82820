"""The server flags: every one reaches ServerConfig, from the command line or TANDEM_<FLAG>."""
from __future__ import annotations

import os

import pytest

from tandem_serve.tandem import cli
from tandem_serve.tandem.cli import build_parser, config_from_args


def serve_config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", "--model", "/m", *argv]))


def test_kernel_flags_default_on_and_turn_off() -> None:
    d = serve_config([])
    assert (d.enforce_eager, d.onednn, d.flash_attn) == (False, True, True)
    c = serve_config(["--enforce-eager", "--no-onednn", "--no-flash-attn"])
    assert (c.enforce_eager, c.onednn, c.flash_attn) == (True, False, False)


def test_attention_backend_flag(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Named on the command line or TANDEM_ATTENTION_BACKEND; a name that is not a backend,
    or flash with --no-flash-attn (auto then never picks flash), is one error line."""
    assert serve_config([]).attention_backend == "auto"
    for name in ("auto", "sdpa", "flex", "flash", "triton"):
        assert serve_config(["--attention-backend", name]).attention_backend == name
    assert serve_config(["--attention-backend", "flex", "--no-flash-attn"]).flash_attn is False
    for argv, message in [
            (["--attention-backend", "nope"],
             "--attention-backend 'nope' is not one of auto, flash, triton, flex, sdpa"),
            (["--attention-backend", "flash", "--no-flash-attn"],
             "--attention-backend flash contradicts --no-flash-attn")]:
        with pytest.raises(SystemExit) as exc:
            serve_config(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"tandem: error: {message}"), err
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "sdpa")
    assert serve_config([]).attention_backend == "sdpa"


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


def test_guided_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/cache")
    d = serve_config([])
    assert (d.guided_cache_dir, d.guided_compile_timeout, d.guided_precompile_json) == (
        "/cache/guided", 30.0, True)
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert serve_config([]).guided_cache_dir == "/xdg/tandem/guided"
    c = serve_config(["--guided-cache-dir", "", "--guided-compile-timeout", "5",
                      "--no-guided-precompile-json"])
    assert (c.guided_cache_dir, c.guided_compile_timeout, c.guided_precompile_json) == (
        "", 5.0, False)


def test_adapter_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    d = serve_config([])
    assert (d.adapter_cache, d.max_loras, d.max_lora_rank) == ("", 8, 16)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TANDEM_ADAPTER_CACHE", "adapters")
    c = serve_config(["--max-loras", "2", "--max-lora-rank", "64"])
    # Made absolute: every process reads it, the gpu worker perhaps from elsewhere.
    assert c.adapter_cache == os.path.join(str(tmp_path), "adapters")
    assert (c.max_loras, c.max_lora_rank) == (2, 64)


def test_scheduling_and_runtime_lora_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    d = serve_config([])
    assert (d.scheduling_policy, d.allow_runtime_lora_updating) == ("fcfs", False)
    monkeypatch.setenv("TANDEM_SCHEDULING_POLICY", "priority")
    c = serve_config(["--adapter-cache", "/a", "--allow-runtime-lora-updating"])
    assert (c.scheduling_policy, c.allow_runtime_lora_updating) == ("priority", True)
    with pytest.raises(SystemExit):
        serve_config(["--scheduling-policy", "lottery"])


def test_command_line_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_ONEDNN", "0")
    assert serve_config(["--onednn"]).onednn is True


def test_an_unparsable_environment_value_stops_only_commands_that_use_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Kubernetes gives every pod TANDEM_PORT=tcp://IP:PORT when a Service is named tandem.
    monkeypatch.setenv("TANDEM_PORT", "tcp://10.0.0.1:8033")
    assert serve_config(["--port", "9000"]).port == 9000  # the flag wins: no error
    with pytest.raises(SystemExit) as exc:
        serve_config([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port: TANDEM_PORT='tcp://10.0.0.1:8033' is not a valid int" in err
    assert "enableServiceLinks: false" in err
    monkeypatch.setenv("TANDEM_PORT", "9001")
    assert serve_config([]).port == 9001


@pytest.mark.parametrize("argv, message", [
    (["--num-scheduler-steps", "0"], "--num-scheduler-steps must be between 1 and 1024 (got 0)"),
    (["--port", "70000"], "--port must be between 0 and 65535 (got 70000)"),
    (["--plan-lead-ms", "-1"], "--plan-lead-ms must be >= 0 (got -1.0)"),
    (["--num-postproc-workers", "0"], "--num-postproc-workers must be between 1 and 64"),
    (["--max-new-tokens", "8"], "--default-max-new-tokens (20) must not exceed --max-new-tokens"),
    (["--http-port", "70000"], "--http-port must be between 0 and 65535 (got 70000)"),
    (["--port", "9000", "--http-port", "9000"], "--http-port 9000 must differ from --port"),
    (["--metrics-port", "9100", "--http-port", "9100"],
     "--http-port 9100 must differ from --metrics-port"),
    (["--guided-compile-timeout", "0"], "--guided-compile-timeout must be between 0.1 and 3600"),
    (["--max-loras", "0"], "--max-loras must be between 1 and 256 (got 0)"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --adapter-cache"),
])
def test_out_of_range_flags_exit_2_naming_the_flag_and_limit(
        capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_config(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_cache_dtype_takes_vllm_spellings_and_refuses_the_rest_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_config([]).kv_cache_dtype == "auto"
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert serve_config(["--kv-cache-dtype", name]).kv_cache_dtype == name
    for bad in ("fp8_e5m2", "bfloat16", "FP8"):
        with pytest.raises(SystemExit) as exc:
            serve_config(["--kv-cache-dtype", bad])
        assert exc.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"tandem: error: --kv-cache-dtype {bad!r} is not one of auto, fp8, fp8_e4m3 "
            "(fp8 is e4m3; e5m2 is not supported)"]


def test_default_model_is_built_without_loading_torch_into_the_frontend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A first start builds the tiny model in a child process: torch and transformers stay
    out of the frontend (hundreds of MB of resident memory for the server's lifetime)."""
    import subprocess
    import sys

    code = ("import sys; from tandem_serve.tandem.cli import build_parser, config_from_args; "
            "cfg = config_from_args(build_parser().parse_args(['serve'])); "
            "print(cfg.model, 'torch' in sys.modules, 'transformers' in sys.modules)")
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == [str(tmp_path / "tiny-llama-default"), "False", "False"]
    assert (tmp_path / "tiny-llama-default" / "model.safetensors").exists()


def test_http_api_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_HTTP_PORT", raising=False)  # tests/conftest.py sets it to 0
    d = serve_config([])
    assert (d.http_port, d.served_model_name) == (8000, "")
    c = serve_config(["--http-port", "0", "--served-model-name", "tiny"])
    assert (c.http_port, c.served_model_name) == (0, "tiny")
    monkeypatch.setenv("TANDEM_HTTP_PORT", "8080")
    assert serve_config([]).http_port == 8080


def test_the_frontend_stays_torch_free() -> None:
    """Everything the frontend process imports, the HTTP API included, runs without torch
    (seconds of start-up and hundreds of MB of memory it would never use)."""
    import subprocess
    import sys

    code = ("import sys, tandem.launcher, openai_api.server, openai_api.app, "
            "openai_api.chat.serving, openai_api.chat.chat_template, uvicorn, fastapi; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]"


def test_building_the_parser_loads_no_heavy_library() -> None:
    """Every role process builds the CLI's parser before it runs: a subcommand's heavy
    imports (fastapi, the offline engine, torch, transformers) belong in its function, or
    each process of a server pays them at start-up."""
    import subprocess
    import sys

    code = ("import sys; from tandem_serve.tandem.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('fastapi', 'torch', 'transformers', "
            "'tandem_serve.tandem.offline.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_a_role_process_builds_its_own_subcommand_alone() -> None:
    """A server's processes each parse `run-role ...`: the benchmarks' and tools' argument
    declarations (a third of a second of imports) are not built for them."""
    import subprocess
    import sys

    code = ("import sys; from tandem_serve.tandem import cli; "
            "cli.build_parser('run-role').parse_args(['run-role', 'postproc']); "
            "print(sorted(m for m in sys.modules if m.startswith(('tandem_serve.bench', "
            "'tandem_serve.tandem.profile_cli', 'tandem_serve.tandem.offline.run_batch', "
            "'tandem_serve.harness.tiny_model')) or m == 'grpc'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
    usage = cli.build_parser().format_usage()
    assert all(name in usage for name in cli.COMMANDS)
    with pytest.raises(SystemExit):  # the whole usage for what is not a subcommand
        cli.main(["serv"])
