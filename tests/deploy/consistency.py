"""What a schema cannot see: the objects of one deployment agree with each other and with
the `tandem` command line their containers run.

Container ports, Service target ports, probe ports, the InferencePool's target port and the
ServiceMonitor's port must be the ports the `tandem serve` args listen on; the probes must
ask the right questions (startup: gRPC readiness of the TGIS service; readiness: /health;
liveness: /live, which stays OK while draining); the grace period must cover the drain;
/dev/shm must be memory; the GPUs must be the ranks the pod runs. Each check returns the
problems it found, as sentences, so a failing test names every one of them.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem_serve.proto import generation_pb2
from tandem_serve.proto.config import ServerConfig
from tandem_serve.tandem.cli import build_parser, config_from_args, role_config

Obj = dict[str, Any]
# The health service the launcher turns SERVING after warm-up (docs/DESIGN.md section 5).
READINESS_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
GPU = "nvidia.com/gpu"
# What LeaderWorkerSet injects into every container, with values of a plausible group.
LWS_ENV = {"LWS_LEADER_ADDRESS": "tandem-0.tandem.llm", "LWS_GROUP_SIZE": "2"}
# After the drain, the server still flushes failed streams and stops its servers and
# children (tandem/launcher.py): the grace period must leave it this much.
STOP_TAIL_S = 10
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@contextmanager
def tandem_env(env: dict[str, str]) -> Iterator[None]:
    """Only the container's TANDEM_* variables, while its command line is parsed (every
    flag's default comes from TANDEM_<FLAG>)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({k: v for k, v in env.items() if k.startswith("TANDEM_")})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("TANDEM_")]:
            del os.environ[k]
        os.environ.update(saved)


def container_env(container: Obj) -> dict[str, str]:
    """Plain values, and a Secret's key as `secret:<name>/<key>` (the value is not ours)."""
    out = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        out[e["name"]] = f"secret:{ref['name']}/{ref['key']}" if ref else str(e.get("value", ""))
    return out


def expand(args: list[str], env: dict[str, str], problems: list[str]) -> list[str]:
    """The args as the kubelet expands $(VAR) references."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            problems.append(f"args reference $({m.group(1)}), which nothing defines")
            return m.group(0)
        return env[m.group(1)]
    return [VAR.sub(sub, str(a)) for a in args]


def tandem_config(container: Obj, problems: list[str], extra_env: dict[str, str] | None = None,
                  ) -> ServerConfig | None:
    """The config `tandem <args>` would run with, or None (and a problem) if it would not."""
    env = {**(extra_env or {}), **container_env(container)}
    args = expand(container.get("args", []), env, problems)
    with tandem_env(env):
        try:
            ns = build_parser().parse_args(args)
            if not ns.model:  # the CLI would build its tiny default model
                problems.append(f"`tandem {' '.join(args)}` names no --model")
                return None
            if ns.command == "serve":
                return config_from_args(ns)
            if ns.command == "run-role" and ns.role == "gpu-worker":
                return role_config(ns)
        except SystemExit:
            problems.append(f"`tandem {' '.join(args)}` does not parse (see stderr)")
            return None
    problems.append(f"`tandem {' '.join(args)}` is neither serve nor run-role gpu-worker")
    return None


def port_number(container: Obj, port: int | str) -> int | None:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


def named_ports(container: Obj) -> dict[str, int]:
    return {p.get("name", ""): int(p["containerPort"]) for p in container.get("ports", [])}


def check_probes(c: Obj, cfg: ServerConfig) -> list[str]:
    out = []
    startup = c.get("startupProbe", {}).get("grpc")
    if not startup or startup.get("port") != cfg.port:
        out.append(f"startupProbe must be gRPC health on --port {cfg.port} (got "
                   f"{c.get('startupProbe')})")
    elif startup.get("service") != READINESS_SERVICE:
        out.append(f"startupProbe asks for service {startup.get('service')!r}; the server "
                   f"turns {READINESS_SERVICE!r} SERVING once it can serve")
    want = {"readinessProbe": "/health", "livenessProbe": "/live"}
    for probe, path in want.items():
        http = c.get(probe, {}).get("httpGet")
        if not http or http.get("path") != path:
            out.append(f"{probe} must be HTTP GET {path} (got {c.get(probe)})")
        elif port_number(c, http.get("port")) != cfg.http_port:
            out.append(f"{probe} port {http.get('port')} is not --http-port {cfg.http_port}")
    return out


def check_server(pod: Obj, cfg: ServerConfig) -> list[str]:
    """A pod running `tandem serve`: ports, probes, the drain."""
    c = pod["containers"][0]
    out = []
    ports = named_ports(c)
    for name, want in (("grpc", cfg.port), ("http", cfg.http_port)):
        if ports.get(name) != want:
            out.append(f"container port {name!r} is {ports.get(name)}, the server listens on "
                       f"{want}")
    if cfg.host != "0.0.0.0":
        out.append(f"--host {cfg.host}: probes and Services cannot reach it")
    out += check_probes(c, cfg)
    sleep = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop = int(sleep[1]) if sleep[:1] == ["sleep"] else 0
    need = pre_stop + cfg.shutdown_timeout + STOP_TAIL_S
    if pod.get("terminationGracePeriodSeconds", 30) < need:
        out.append(f"terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds')} "
                   f"< preStop {pre_stop} + --shutdown-timeout {cfg.shutdown_timeout:g} + "
                   f"{STOP_TAIL_S}: the kubelet would kill the drain")
    return out


def check_pod(pod: Obj, cfg: ServerConfig) -> list[str]:
    """Every pod of a replica: memory /dev/shm, mounts, GPUs, no service links."""
    c = pod["containers"][0]
    out = []
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    out += [f"volumeMount {n!r} has no volume" for n in mounts.values() if n not in volumes]
    shm = volumes.get(mounts.get("/dev/shm", ""), {}).get("emptyDir", {})
    if shm.get("medium") != "Memory":
        out.append("/dev/shm must be an emptyDir with medium: Memory (the token ring)")
    for flag, path in (("--model", cfg.model), ("--adapter-cache", cfg.adapter_cache)):
        if path and not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts):
            out.append(f"{flag} {path} is on no mounted volume")
    gpus = int(c.get("resources", {}).get("limits", {}).get(GPU, 0))
    want = cfg.ranks_per_node if cfg.device == "cuda" else 0
    if cfg.device in ("cuda", "cpu") and gpus != want:
        out.append(f"{GPU}: {gpus}, but the pod runs {cfg.ranks_per_node} rank(s) on "
                   f"--device {cfg.device}")
    if pod.get("enableServiceLinks", True):
        out.append("enableServiceLinks must be false: a Service named `tandem` would set "
                   "TANDEM_PORT=tcp://..., which the CLI reads as --port")
    return out


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_service(svc: Obj, server_pods: list[Obj], other_pods: list[Obj]) -> list[str]:
    """The Service selects the server pods only, and each port reaches the right one."""
    sel = svc["spec"]["selector"]
    out = []
    if not all(matches(sel, p["metadata"]["labels"]) for p in server_pods):
        out.append(f"Service selector {sel} misses a server pod")
    if any(matches(sel, p["metadata"]["labels"]) for p in other_pods):
        out.append(f"Service selector {sel} selects pods that serve no API (workers)")
    for pod in server_pods:
        ports = named_ports(pod["spec"]["containers"][0])
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            number = ports.get(target) if isinstance(target, str) else target
            if number is None or ports.get(p["name"]) != number:
                out.append(f"Service port {p['name']!r} targets {target}, not the "
                           f"container's {p['name']!r} port {ports.get(p['name'])}")
            if p["name"] == "grpc" and p.get("appProtocol") != "kubernetes.io/h2c":
                out.append("Service port grpc needs appProtocol kubernetes.io/h2c")
    return out


# ---------------------------------------------------------------- a whole deployment


def pods(objs: list[Obj]) -> tuple[list[Obj], list[Obj], Obj]:
    """(server pod templates, worker pod templates, the workload) of one render."""
    for o in objs:
        if o["kind"] == "Deployment":
            return [o["spec"]["template"]], [], o
        if o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            return [lwt["leaderTemplate"]], [lwt["workerTemplate"]], o
    raise AssertionError("no Deployment or LeaderWorkerSet rendered")


def check_workers(workload: Obj, leader: ServerConfig, workers: list[Obj]) -> list[str]:
    """LeaderWorkerSet: every pod of a group runs its share of the same tensor-parallel
    group, and meets the leader at its rendezvous."""
    out: list[str] = []
    size = workload["spec"]["leaderWorkerTemplate"]["size"]
    if leader.nnodes != size:
        out.append(f"leader runs --nnodes {leader.nnodes}, the group has {size} pods")
    port = leader.dist_init_addr.rpartition(":")[2]
    leader_c = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    if int(port) not in named_ports(leader_c["containers"][0]).values():
        out.append(f"the leader declares no container port for its rendezvous {port}")
    for w in workers:
        env = {**LWS_ENV, "LWS_WORKER_INDEX": "1"}
        cfg = tandem_config(w["spec"]["containers"][0], out, env)
        if cfg is None:
            continue
        for field in ("model", "tensor_parallel_size", "nnodes", "dist_init_addr", "device"):
            if getattr(cfg, field) != getattr(leader, field):
                out.append(f"worker {field} {getattr(cfg, field)!r} != leader's "
                           f"{getattr(leader, field)!r}")
        if cfg.node_rank != 1:
            out.append("workers must take --node-rank from $(LWS_WORKER_INDEX)")
        out += check_pod(w["spec"], cfg)
    return out


def check_extras(objs: list[Obj], workload: Obj, cfg: ServerConfig, server: list[Obj],
                 others: list[Obj]) -> list[str]:
    """PDB, KEDA, InferencePool and ServiceMonitor point at this deployment's pieces."""
    out: list[str] = []
    everyone = [p["metadata"]["labels"] for p in server + others]
    services = [o for o in objs if o["kind"] == "Service"]
    for o in objs:
        spec = o["spec"]
        if o["kind"] == "PodDisruptionBudget":
            if not all(matches(spec["selector"]["matchLabels"], lb) for lb in everyone):
                out.append("the PodDisruptionBudget misses some pods of the replicas")
        elif o["kind"] == "ScaledObject":
            ref = spec["scaleTargetRef"]
            if (ref.get("kind"), ref["name"]) != (workload["kind"], workload["metadata"]["name"]):
                out.append(f"ScaledObject scales {ref}, not the {workload['kind']}")
            queries = [t["metadata"].get("query", "") for t in spec["triggers"]]
            if not any("vllm:num_requests_waiting" in q for q in queries):
                out.append("ScaledObject does not scale on vllm:num_requests_waiting")
        elif o["kind"] == "InferencePool":
            if [p["number"] for p in spec["targetPorts"]] != [cfg.http_port]:
                out.append(f"InferencePool targets {spec['targetPorts']}, not the HTTP API "
                           f"on {cfg.http_port}")
            sel = spec["selector"]["matchLabels"]
            if not all(matches(sel, p["metadata"]["labels"]) for p in server) or any(
                    matches(sel, p["metadata"]["labels"]) for p in others):
                out.append(f"InferencePool selector {sel} must select the server pods only")
        elif o["kind"] == "ServiceMonitor":
            out += check_monitor(o, services)
    return out


def check_monitor(mon: Obj, services: list[Obj]) -> list[str]:
    sel = mon["spec"]["selector"]["matchLabels"]
    chosen = [s for s in services if matches(sel, s["metadata"].get("labels", {}))]
    if not chosen:
        return [f"ServiceMonitor selector {sel} matches no Service"]
    out = []
    for ep in mon["spec"]["endpoints"]:
        if ep.get("path") != "/metrics" or ep.get("port") != "http":
            out.append(f"ServiceMonitor endpoint {ep} must scrape /metrics on port http")
    for s in chosen:
        if "http" not in {p["name"] for p in s["spec"]["ports"]}:
            out.append(f"Service {s['metadata']['name']} has no port named http")
    return out


def check_deployment(objs: list[Obj]) -> list[str]:
    """Every consistency problem of one rendered deployment (empty: none)."""
    server, others, workload = pods(objs)
    out: list[str] = []
    leader_env = LWS_ENV if workload["kind"] == "LeaderWorkerSet" else {}
    cfg = tandem_config(server[0]["spec"]["containers"][0], out, leader_env)
    if cfg is None:
        return out
    for p in server:
        out += check_server(p["spec"], cfg) + check_pod(p["spec"], cfg)
    if workload["kind"] == "LeaderWorkerSet":
        out += check_workers(workload, cfg, others)
    services = [o for o in objs if o["kind"] == "Service"]
    if not services:
        out.append("no Service")
    for svc in services:
        out += check_service(svc, server, others)
    return out + check_extras(objs, workload, cfg, server, others)


def check_serving_runtime(rt: Obj) -> list[str]:
    """KServe: HTTP first, gRPC as h2c; the model where KServe puts it, named after the
    InferenceService."""
    c = rt["spec"]["containers"][0]
    out: list[str] = []
    if c["name"] != "kserve-container":
        out.append(f"container {c['name']!r}: KServe expects kserve-container")
    args = [str(a) for a in c.get("args", [])]
    for flag, value in (("--model", "/mnt/models"), ("--served-model-name", "{{.Name}}")):
        if flag not in args or args[args.index(flag) + 1] != value:
            out.append(f"args need {flag} {value}")
    cfg = tandem_config({**c, "args": [a.replace("{{.Name}}", "isvc") for a in args]}, out)
    if cfg is None:
        return out
    ports = c.get("ports", [])
    if [p["containerPort"] for p in ports] != [cfg.http_port, cfg.port]:
        out.append(f"ports {ports}: the HTTP port ({cfg.http_port}) first, then gRPC "
                   f"({cfg.port})")
    elif ports[1].get("name") != "h2c":
        out.append("the gRPC port must be named h2c (HTTP/2 without TLS)")
    out += check_probes(c, cfg)
    volumes = {v["name"]: v for v in rt["spec"].get("volumes", [])}
    shm = [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm or volumes.get(shm[0], {}).get("emptyDir", {}).get("medium") != "Memory":
        out.append("/dev/shm must be an emptyDir with medium: Memory (the token ring)")
    return out
