"""Tandem installs under one root import name, so it lives beside the distributions whose
import names are our folder names: proto-plus (`proto`, a dependency of every Google Cloud
client), AdapterHub (`adapters`) and `scheduler`.  Before, setup.cfg installed `proto`,
`adapters` and `scheduler` as top-level names: with theirs first on the path `tandem serve`
died at import, with ours first theirs broke.

Their wheels go into a folder of their own, first on the path (PYTHONPATH) or last (a
sitecustomize that appends it), and the server runs outside the checkout, as a user's would.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

THEIRS = {"proto": "proto-plus", "adapters": "adapters", "scheduler": "scheduler"}
WHEELS = pathlib.Path(sys.prefix) / "conflict-wheels"  # kept between runs, like the venv


def _their_wheels() -> pathlib.Path:
    if len(list(WHEELS.glob("*.whl"))) < len(THEIRS):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(WHEELS), *THEIRS.values()], check=True, timeout=300)
    return WHEELS


@pytest.fixture(scope="module")
def their_site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    site = tmp_path_factory.mktemp("their-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--find-links", str(_their_wheels()), "--target", str(site),
                    *THEIRS.values()], check=True, timeout=300)
    return site


def _env(order: str, site: pathlib.Path, tmp_path: pathlib.Path) -> dict[str, str]:
    if order == "theirs first":
        return {"PYTHONPATH": str(site)}
    shim = tmp_path / "shim"
    shim.mkdir()
    # Imported by `site` after site-packages are on the path: theirs come after ours.
    (shim / "sitecustomize.py").write_text(f"import sys\nsys.path.append({str(site)!r})\n")
    return {"PYTHONPATH": str(shim)}


@pytest.mark.parametrize("order", ["theirs first", "theirs last"])
def test_serves_beside_distributions_named_like_our_folders(
        order: str, their_site: pathlib.Path, fast_model_dir: pathlib.Path,
        tmp_path: pathlib.Path) -> None:
    env = _env(order, their_site, tmp_path)
    probe = ("import importlib, tandem_serve.proto.messages, tandem_serve.scheduler.core, "
             "tandem_serve.adapters.peft\n"
             "for name in ('proto', 'adapters', 'scheduler'):\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    print(name, spec.origin if spec else None)\n"
             "import proto\n"
             "print('proto-plus', hasattr(proto, 'Message') and hasattr(proto, 'Field'))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, text=True, check=True,
                         capture_output=True, env={**os.environ, **env}, timeout=120).stdout
    found = dict(line.split(" ", 1) for line in out.splitlines())
    for name in THEIRS:  # their packages, not our folders, answer to their names
        assert found[name].startswith(str(their_site)), (name, found[name])
    assert found["proto-plus"] == "True"

    server = Server(str(fast_model_dir), env=env, cwd=str(tmp_path))
    try:
        server.wait_ready()
        out_ = list(server.client.stream("Once upon a time", GenerateOptions(max_new_tokens=4)))
        assert out_[-1].generated_token_count == 4
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []
