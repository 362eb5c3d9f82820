"""deploy/: the Helm chart, the Kustomize manifests and the KServe runtime render offline,
every object is valid against its API schema (Kubernetes' own, or the vendored CRD's), and
the objects of a deployment agree with each other and with the `tandem` command line.

The mutation tests prove the checks bite: a misspelt field, a wrong port or a probe that
would kill a draining pod must fail.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import pytest

from tests.deploy import consistency, k8s
from tests.deploy.k8s import CHART, CRDS, DEPLOY, Obj

ALL_ON = str(CHART / "ci" / "all-features-values.yaml")
# Name -> helm template arguments; the release is "tandem" in namespace "llm".
RENDERS = {
    "defaults": (),
    "all-features": ("-f", ALL_ON),
    # CPU replicas behind KEDA and an InferencePool, without LeaderWorkerSet.
    "cpu-keda-pool": ("--set", "server.device=cpu", "--set", "image.tag=cpu",
                      "--set", "keda.enabled=true", "--set", "inferencePool.enabled=true",
                      "--set", "serviceMonitor.enabled=true", "--set", "replicaCount=3"),
    # The API key from a Secret, beside env entries of the user's own.
    "api-key": ("--set", "server.apiKey.existingSecret=tandem-api-key",
                "--set", "server.env[0].name=HF_HUB_OFFLINE",
                "--set-string", "server.env[0].value=1",
                "--set", "server.livenessTimeout=120"),
}
KUSTOMIZE = {"base": DEPLOY / "kustomize" / "base",
             "overlay": DEPLOY / "kustomize" / "overlays" / "tp2-bf16"}
SERVING_RUNTIME = DEPLOY / "kserve" / "servingruntime.yaml"


T = TypeVar("T")


def tool_or_fail(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except k8s.ToolMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> k8s.Helm:
    return tool_or_fail(lambda: k8s.Helm(tmp_path_factory.mktemp("helm")))


@pytest.fixture(scope="module")
def rendered(helm: k8s.Helm) -> dict[str, list[Obj]]:
    out = {name: helm.template(*args) for name, args in RENDERS.items()}
    for name, folder in KUSTOMIZE.items():
        out[f"kustomize-{name}"] = tool_or_fail(partial(k8s.kustomize, folder))
    return out


def kinds(objs: list[Obj]) -> set[str]:
    return {o["kind"] for o in objs}


def find(objs: list[Obj], kind: str) -> Obj:
    return next(o for o in objs if o["kind"] == kind)


# ---------------------------------------------------------------- rendering and schemas


@pytest.mark.parametrize("values", [(), ("-f", ALL_ON)], ids=["defaults", "all-features"])
def test_helm_lint_is_clean(helm: k8s.Helm, values: tuple[str, ...]) -> None:
    out = helm.run("lint", "--strict", str(CHART), *values)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_switches_choose_the_objects(rendered: dict[str, list[Obj]]) -> None:
    assert kinds(rendered["defaults"]) == {"Deployment", "Service", "PodDisruptionBudget"}
    assert kinds(rendered["all-features"]) == {
        "LeaderWorkerSet", "Service", "PodDisruptionBudget", "ScaledObject", "InferencePool",
        "ServiceMonitor"}  # the LeaderWorkerSet replaces the Deployment
    assert "Deployment" in kinds(rendered["cpu-keda-pool"])
    # KEDA owns the replica count: a fixed one would fight it on every upgrade.
    assert "replicas" not in find(rendered["cpu-keda-pool"], "Deployment")["spec"]
    assert "replicas" not in find(rendered["all-features"], "LeaderWorkerSet")["spec"]


@pytest.mark.parametrize("name", [*RENDERS, *(f"kustomize-{k}" for k in KUSTOMIZE)])
def test_every_object_is_valid(rendered: dict[str, list[Obj]], name: str) -> None:
    problems = [e for o in rendered[name] for e in k8s.errors(o)]
    assert not problems, "\n".join(problems)


def test_the_serving_runtime_is_valid() -> None:
    (rt,) = k8s.load_all(SERVING_RUNTIME.read_text())
    problems = k8s.errors(rt) + consistency.check_serving_runtime(rt)
    assert not problems, "\n".join(problems)


def test_the_vendored_crds_are_the_ones_the_readme_names() -> None:
    readme = (CRDS / "README.md").read_text()
    for path in sorted(CRDS.glob("*.yaml")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"`{path.name}`" in readme and digest in readme, (
            f"{path.name} (sha256 {digest}) is not the file crds/README.md records")


# ---------------------------------------------------------------- consistency


@pytest.mark.parametrize("name", [*RENDERS, *(f"kustomize-{k}" for k in KUSTOMIZE)])
def test_every_deployment_is_consistent(rendered: dict[str, list[Obj]], name: str) -> None:
    problems = consistency.check_deployment(rendered[name])
    assert not problems, "\n".join(problems)


def test_the_kustomize_base_is_the_charts_default_pod(rendered: dict[str, list[Obj]]) -> None:
    """Two ways to deploy one pod: they must not drift apart."""
    chart = find(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]
    base = find(rendered["kustomize-base"], "Deployment")["spec"]["template"]["spec"]
    for key in ("enableServiceLinks", "terminationGracePeriodSeconds", "volumes"):
        assert chart[key] == base[key], key
    cc, bc = chart["containers"][0], base["containers"][0]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle",
                "resources", "securityContext", "volumeMounts", "image"):
        assert cc[key] == bc[key], key
    problems: list[str] = []
    a, b = consistency.tandem_config(cc, problems), consistency.tandem_config(bc, problems)
    assert a is not None and b is not None, problems
    assert a == b


def test_the_api_key_comes_from_the_secret(rendered: dict[str, list[Obj]]) -> None:
    c = server_container(find(rendered["api-key"], "Deployment"))
    env = {e["name"]: e for e in c["env"]}
    assert env["TANDEM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert not any("api-key" in str(a) for a in c["args"])  # on no command line
    problems: list[str] = []
    cfg = consistency.tandem_config(c, problems)
    assert cfg is not None, problems
    assert cfg.api_key == "secret:tandem-api-key/api-key" and cfg.liveness_timeout == 120
    for name in ("defaults", "all-features"):  # no secret: no key, no env entry
        kind = "Deployment" if name == "defaults" else "LeaderWorkerSet"
        c = server_container(find(rendered[name], kind))
        assert "TANDEM_API_KEY" not in consistency.container_env(c)


def test_multi_host_groups_put_their_ranks_on_gpus(rendered: dict[str, list[Obj]]) -> None:
    lws = find(rendered["all-features"], "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader = lws["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"][0] == "serve" and worker["args"][:2] == ["run-role", "gpu-worker"]
    assert "--node-rank" in worker["args"] and "$(LWS_WORKER_INDEX)" in worker["args"]
    assert lws["restartPolicy"] == "RecreateGroupOnPodRestart"
    for c in (leader, worker):  # tensor-parallel-size 4 over 2 pods
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "readinessProbe" not in worker  # workers serve nothing; they exit on their own


# ---------------------------------------------------------------- the checks bite


def mutated(objs: list[Obj], kind: str, change: Callable[[Obj], None]) -> list[Obj]:
    out = copy.deepcopy(objs)
    change(find(out, kind))
    return out


def server_container(o: Obj) -> Obj:
    if o["kind"] == "Deployment":
        return o["spec"]["template"]["spec"]["containers"][0]
    return o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


def rename(c: Obj, old: str, new: str) -> None:
    c[new] = c.pop(old)


def set_port(c: Obj, name: str, number: int) -> None:
    next(p for p in c["ports"] if p["name"] == name)["containerPort"] = number


def set_arg(c: Obj, flag: str, value: str) -> None:
    c["args"][c["args"].index(flag) + 1] = value


@pytest.mark.parametrize("render,kind", [("defaults", "Deployment"),
                                         ("all-features", "LeaderWorkerSet")])
def test_a_misspelt_probe_field_fails_validation(rendered: dict[str, list[Obj]], render: str,
                                                 kind: str) -> None:
    objs = mutated(rendered[render], kind,
                   lambda o: rename(server_container(o), "readinessProbe", "readinesProbe"))
    problems = k8s.errors(find(objs, kind))
    assert any("readinesProbe" in p for p in problems), problems


@pytest.mark.parametrize("kind,change,expect", [
    ("Deployment", lambda o: set_port(server_container(o), "grpc", 8034), "'grpc' is 8034"),
    ("Deployment", lambda o: set_arg(server_container(o), "--port", "9033"), "--port 9033"),
    ("Deployment", lambda o: set_arg(server_container(o), "--shutdown-timeout", "120"),
     "would kill the drain"),
    ("Deployment", lambda o: server_container(o)["livenessProbe"]["httpGet"].update(
        path="/health"), "livenessProbe must be HTTP GET /live"),
    ("Deployment", lambda o: server_container(o)["livenessProbe"]["httpGet"].update(
        path="/metrics"), "livenessProbe must be HTTP GET /live"),
    ("Deployment", lambda o: server_container(o)["startupProbe"]["grpc"].update(
        service="fmaas.Generation"), "turns 'fmaas.GenerationService' SERVING"),
    ("Deployment", lambda o: server_container(o)["resources"]["limits"].pop("nvidia.com/gpu"),
     "runs 1 rank"),
    ("Service", lambda o: o["spec"]["ports"][0].update(targetPort=8000), "targets 8000"),
    ("Service", lambda o: o["spec"]["ports"][0].pop("appProtocol"), "kubernetes.io/h2c"),
])
def test_a_wrong_port_or_probe_is_inconsistent(rendered: dict[str, list[Obj]], kind: str,
                                               change: Callable[[Obj], None],
                                               expect: str) -> None:
    problems = consistency.check_deployment(mutated(rendered["defaults"], kind, change))
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("kind,change,expect", [
    ("InferencePool", lambda o: o["spec"]["targetPorts"][0].update(number=8033),
     "not the HTTP API"),
    ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"].update(size=3),
     "the group has 3 pods"),
    ("ScaledObject", lambda o: o["spec"]["scaleTargetRef"].update(name="other"), "scales"),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(port="grpc"), "port http"),
])
def test_the_extras_follow_the_server(rendered: dict[str, list[Obj]], kind: str,
                                      change: Callable[[Obj], None], expect: str) -> None:
    problems = consistency.check_deployment(mutated(rendered["all-features"], kind, change))
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("kind,change,expect", [
    # KEDA trigger metadata is a map of strings.
    ("ScaledObject", lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=8),
     "is not of type 'string'"),
    ("InferencePool", lambda o: o["spec"].update(targetPort=[{"number": 8000}]),
     "'targetPort' was unexpected"),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(pathh="/metrics"),
     "'pathh' was unexpected"),
])
def test_custom_resources_are_checked_strictly(rendered: dict[str, list[Obj]], kind: str,
                                               change: Callable[[Obj], None],
                                               expect: str) -> None:
    objs = mutated(rendered["all-features"], kind, change)
    problems = k8s.errors(find(objs, kind))
    assert any(expect in p for p in problems), problems


def test_a_serving_runtime_with_grpc_first_is_inconsistent() -> None:
    (rt,) = k8s.load_all(SERVING_RUNTIME.read_text())
    c = rt["spec"]["containers"][0]
    c["ports"].reverse()
    assert any("HTTP port (8000) first" in p for p in consistency.check_serving_runtime(rt))


def test_values_the_chart_does_not_know_are_refused(helm: k8s.Helm) -> None:
    out = helm.run("template", "t", str(CHART), "--set", "server.grpcProt=8033")
    assert out.returncode != 0 and "grpcProt" in out.stderr
    out = helm.run("template", "t", str(CHART), "--set", "leaderWorkerSet.enabled=true",
                   "--set", "server.tensorParallelSize=3")
    assert out.returncode != 0 and "multiple of leaderWorkerSet.size" in out.stderr


def test_helm_is_a_real_helm(helm: k8s.Helm) -> None:
    out = helm.run("version", "--short")
    assert out.returncode == 0 and out.stdout.startswith("v"), out.stdout + out.stderr
