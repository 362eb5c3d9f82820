"""The compose files: valid for `docker compose`, and every command parses with our CLI."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

from tandem_serve.tandem.cli import build_parser

DOCKER = pathlib.Path(__file__).resolve().parents[2] / "docker"


def compose_services() -> dict[str, dict]:
    data = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    return data["services"]


def test_every_service_command_parses_with_the_cli() -> None:
    parser = build_parser()
    services = compose_services()
    assert {"frontend", "scheduler", "gpu-worker", "postproc-0", "tandem"} <= set(services)
    for name, svc in services.items():
        args = parser.parse_args([str(a) for a in svc["command"]])
        assert callable(args.func), name
    gpu = yaml.safe_load((DOCKER / "docker-compose.gpu.yml").read_text())["services"]
    for name, svc in gpu.items():
        parser.parse_args([str(a) for a in svc["command"]])
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name


def test_postproc_addresses_match_the_services() -> None:
    services = compose_services()
    env = services["frontend"]["environment"]
    addrs = env["TANDEM_POSTPROC_ADDRS"].split(",")
    workers = sorted(n for n in services if n.startswith("postproc-"))
    assert len(addrs) == len(workers) == int(env["TANDEM_NUM_POSTPROC_WORKERS"])
    for i, (addr, name) in enumerate(zip(addrs, workers, strict=True)):
        assert addr.startswith(f"tcp://{name}:")
        assert services[name]["command"][-1] == str(i)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_compose_check_rejects_an_invalid_file(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: 3\n    ports: [not-a-port-spec:::]\n")
    root = DOCKER.parent
    ok = subprocess.run(["make", "-s", "compose-check"], cwd=root, capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = subprocess.run(["make", "-s", "compose-check", f"COMPOSE_FILES={bad}"], cwd=root,
                            capture_output=True, text=True)
    assert broken.returncode != 0


def test_tensor_parallel_overlay_runs_two_ranks_of_one_group() -> None:
    tp = yaml.safe_load((DOCKER / "docker-compose.tp.yml").read_text())["services"]
    parser = build_parser()
    ranks = {}
    for name in ("gpu-worker", "gpu-worker-1"):
        args = parser.parse_args([str(a) for a in tp[name]["command"]])
        assert args.role == "gpu-worker", name
        env = tp[name]["environment"]
        assert (env["TANDEM_TENSOR_PARALLEL_SIZE"], env["TANDEM_NNODES"]) == ("2", "2")
        assert env["TANDEM_DIST_INIT_ADDR"].startswith("gpu-worker:")  # rank 0's service
        ranks[args.node_rank] = name
    assert ranks == {0: "gpu-worker", 1: "gpu-worker-1"}
    assert tp["gpu-worker-1"]["extends"]["service"] == "gpu-worker"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_copy_every_package_setup_cfg_installs(dockerfile: str) -> None:
    """`pip install .` in the image needs every folder setup.cfg maps (adapters/ was missing)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(DOCKER.parent / "setup.cfg")
    folders = {line.split("=")[1].strip()
               for line in cfg["options"]["package_dir"].strip().splitlines()}
    copied = {line.split()[1] for line in (DOCKER / dockerfile).read_text().splitlines()
              if line.startswith("COPY ") and "--from" not in line}
    assert folders <= copied, f"{dockerfile} does not COPY {sorted(folders - copied)}"
