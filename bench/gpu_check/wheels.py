"""The wheels `scripts/gpu-check` carries to a GPU host that has no network: fetching them
where pip works, and installing them there. Standard library only: it runs before they are in.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from importlib import metadata

# What the project imports beyond a stock torch image (torch, transformers, numpy, grpcio,
# msgpack, safetensors, sentencepiece, tokenizers and prometheus-client are there), pinned
# by `--fetch-wheels` to the versions installed where it runs: the ones the tests passed with.
WHEELS = ("pyzmq", "setproctitle", "grpcio", "protobuf", "grpcio-health-checking",
          "grpcio-reflection", "outlines-core", "llguidance", "fastapi", "starlette",
          "annotated-doc", "uvicorn", "h11", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "pydantic-extra-types", "mistral-common", "jsonschema",
          "jsonschema-specifications", "referencing", "rpds-py", "openai", "jiter", "distro",
          "sniffio", "httpx2", "opentelemetry-api")


def _say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def fetch_wheels(dest: str) -> int:
    """Download the wheels a stock torch image lacks (CPython 3.12, manylinux x86_64), at the
    versions installed here."""
    os.makedirs(dest, exist_ok=True)
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    platforms = [f"--platform={p}" for p in (
        "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
        "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
        "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", dest]
    failed = []
    for pin in pins:  # one at a time: one missing wheel must not stop the others
        if subprocess.run([*cmd, pin], capture_output=True, text=True).returncode:
            failed.append(pin)
    _say(f"{len(pins) - len(failed)} wheels in {dest}" +
         (f"; not found: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0



def install_wheels(wheels: str, target: str) -> None:
    """`pip install --no-index --no-deps --target` every wheel in `wheels`, then put the
    target first on this process's path and its children's PYTHONPATH."""
    files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not files:
        raise SystemExit(f"gpu-check: --wheels {wheels}: no .whl files there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", target, *files], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (target, os.environ.get("PYTHONPATH", "")) if p)
    _say(f"installed {len(files)} wheels into {target}")
