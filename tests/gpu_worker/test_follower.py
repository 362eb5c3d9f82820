"""A tensor-parallel rank > 0: its profiler file, and how it watches rank 0 across hosts."""
from __future__ import annotations

import pytest

from tandem_serve.gpu_worker import follower, parallel
from tandem_serve.proto.config import Addresses, ServerConfig, plans_address


def test_each_rank_writes_its_own_torch_trace() -> None:
    assert follower.rank_trace_path("/tmp/t/trace.json", 1) == "/tmp/t/trace.rank1.json"
    assert follower.rank_trace_path("/tmp/t/trace", 3) == "/tmp/t/trace.rank3.json"


def test_rank_0_silence_ends_a_rank_on_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(follower.time, "monotonic", lambda: now[0])
    watch = follower._Silence(watching=True)
    now[0] += follower.START_GRACE - 1  # still loading, or rank 0 still starting
    watch.check()
    watch.heard()
    now[0] += follower.PEER_TIMEOUT - 0.1
    watch.check()
    now[0] += 0.2
    with pytest.raises(parallel.RankLost, match="stopped sending heartbeats"):
        watch.check()
    on_one_host = follower._Silence(watching=False)  # the launcher watches these
    now[0] += 10 * follower.START_GRACE
    on_one_host.check()


def test_plans_go_over_tcp_next_to_the_rendezvous_across_hosts() -> None:
    one = ServerConfig(model="", tensor_parallel_size=2, dist_init_addr="127.0.0.1:5000",
                       addresses=Addresses("", "", "", (), "", worker_plans="ipc:///r/p"))
    assert plans_address(one) == "ipc:///r/p"
    two = ServerConfig(model="", tensor_parallel_size=2, nnodes=2, dist_init_addr="n0:29500")
    assert plans_address(two) == "tcp://n0:29501"
