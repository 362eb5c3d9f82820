"""A host's tensor-parallel ranks on their own (`run-role gpu-worker` with several ranks per
host): the first rank to exit decides, and the others do not outlive it."""
from __future__ import annotations

import subprocess
import sys
import time

from tandem_serve.proto.config import ServerConfig
from tandem_serve.tandem import tp_node


def sleeper(seconds: float, code: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c",
                             f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def test_a_failed_rank_stops_the_others_and_sets_the_status() -> None:
    procs = {0: sleeper(60), 1: sleeper(0.2, code=3)}
    started = time.monotonic()
    assert tp_node.watch(procs) == 3
    assert procs[0].poll() is not None  # stopped, not left running
    assert time.monotonic() - started < tp_node.STOP_TIMEOUT_S + 5


def test_a_killed_rank_reads_as_128_plus_the_signal() -> None:
    procs = {0: sleeper(60), 1: sleeper(60)}
    procs[1].kill()
    assert tp_node.watch(procs) == 128 + 9
    assert procs[0].poll() is not None


def test_a_clean_shutdown_waits_for_every_rank() -> None:
    procs = {0: sleeper(0.1), 1: sleeper(0.5)}
    assert tp_node.watch(procs) == 0
    assert procs[1].returncode == 0  # left on its own, not stopped


def test_one_host_group_gets_a_local_rendezvous_and_plan_socket(tmp_path: object) -> None:
    cfg = tp_node.node_config(ServerConfig(model="m", tensor_parallel_size=2, device="cpu",
                                           reserved_cpus=0), "/tmp/tandem-x")
    assert cfg.dist_init_addr.startswith("127.0.0.1:")
    assert cfg.addresses.worker_plans == "ipc:///tmp/tandem-x/worker-plans"
    two = ServerConfig(model="m", tensor_parallel_size=4, nnodes=2, node_rank=1,
                       dist_init_addr="node0:29500", reserved_cpus=0)
    cfg = tp_node.node_config(two, "/tmp/tandem-y")
    assert cfg.dist_init_addr == "node0:29500" and list(cfg.node_ranks()) == [2, 3]
