"""Render the deploy/ manifests offline and validate every object against its API schema.

Built-in kinds are checked by `kubernetes-validate` (the Kubernetes OpenAPI schemas, strict:
an unknown field is an error, as `kubectl apply`'s server-side field validation makes it).
Custom resources are checked against the CRDs vendored in crds/ (crds/README.md: where each
comes from). A CRD's schema is structural: the API server drops or, with strict field
validation, rejects fields it does not declare, so every object node that declares
properties gets `additionalProperties: false` here. CEL rules (x-kubernetes-validations)
are not evaluated.
"""
from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "tandem"
CRDS = Path(__file__).resolve().parent / "crds"
# The oldest release the chart supports (Chart.yaml kubeVersion) and the newest one whose
# schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())

Obj = dict[str, Any]
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the LWS CRD is 1.3 MB


class ToolMissing(Exception):
    pass


def tool(name: str) -> str:
    """A binary from the virtualenv (`make bootstrap` installs helm and kubectl there), else
    from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise ToolMissing(f"`{name}` is not in {beside.parent} nor on PATH: run `make bootstrap` "
                      f"(deploy/tools/install_k8s_tools.py installs helm and kubectl)")


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def load_all(text: str) -> list[Obj]:
    return [d for d in yaml.load_all(text, Loader=Loader) if d]


class Helm:
    """helm with its cache, config and data folders in a scratch folder (nothing in $HOME)."""

    def __init__(self, home: Path) -> None:
        self.bin = tool("helm")
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return run([self.bin, *args], env=self.env)

    def template(self, *args: str, release: str = "tandem",
                 namespace: str = "llm") -> list[Obj]:
        out = self.run("template", release, str(CHART), "--namespace", namespace,
                       "--kube-version", KUBE_VERSIONS[0], *args)
        assert out.returncode == 0, out.stderr
        return load_all(out.stdout)


def kustomize(folder: Path) -> list[Obj]:
    """`kubectl kustomize`, or a standalone `kustomize build`."""
    try:
        cmd = [tool("kubectl"), "kustomize", str(folder)]
    except ToolMissing:
        try:
            cmd = [tool("kustomize"), "build", str(folder)]
        except ToolMissing:
            raise ToolMissing("neither `kubectl` (for `kubectl kustomize`) nor `kustomize` "
                              "is installed: run `make bootstrap`") from None
    out = run(cmd)
    assert out.returncode == 0, out.stderr
    return load_all(out.stdout)


# ---------------------------------------------------------------- custom resources


SUBSCHEMAS = ("items", "additionalProperties", "not")
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it: undeclared fields are errors."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in SUBSCHEMA_LISTS:
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    if "properties" in out:
        out["properties"] = {name: strict(s) for name, s in out["properties"].items()}
        if ("additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator, for every served version of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = load_all(path.read_text())[0]
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = strict(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft4Validator.check_schema(schema)
                out[(f"{group}/{version['name']}", kind)] = jsonschema.Draft4Validator(schema)
    return out


# ---------------------------------------------------------------- validation


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(root)"


def errors(obj: Obj) -> list[str]:
    """Every schema violation of one object, against every Kubernetes version checked."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    crd = crd_validators().get(key)
    if crd is not None:
        return [f"{name}: {_where(e)}: {e.message}" for e in crd.iter_errors(obj)] + [
            err for sub in embedded_pods(obj) for err in errors(sub)]
    out = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{name} (Kubernetes {version}): {_where(e)}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            out.append(f"{name}: no schema ({e.message}; vendor its CRD in {CRDS})")
    return out


def embedded_pods(obj: Obj) -> Iterator[Obj]:
    """The pod templates inside a custom resource, as the built-in kinds that hold them, so
    the Kubernetes schemas check them too (the CRDs copy them from some older release)."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for part in ("leaderTemplate", "workerTemplate"):
            if part in lwt:
                yield {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{name}-{part}"}, "template": lwt[part]}
    elif obj["kind"] == "ServingRuntime":
        spec = {k: obj["spec"][k] for k in ("containers", "volumes") if k in obj["spec"]}
        yield {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-pod"},
               "spec": spec}
