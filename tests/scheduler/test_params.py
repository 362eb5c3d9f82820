"""What the scheduler makes of the gpu worker's handshake."""
from __future__ import annotations

from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.scheduler.main import make_params


def test_prefix_caching_is_off_for_a_long_rope_model_that_may_pass_its_original_context() -> None:
    """LongRoPE rotates a long history with other factors: the same prompt tokens have other
    KV in a longer request, and a block hash of the tokens alone would share the wrong KV."""
    cfg = ServerConfig(model="")
    assert make_params(cfg, WorkerReady(100, 16, 8192, 512)).enable_prefix_caching
    assert make_params(cfg, WorkerReady(100, 16, 4096, 512, 4096)).enable_prefix_caching
    assert not make_params(cfg, WorkerReady(100, 16, 8192, 512, 4096)).enable_prefix_caching
    off = ServerConfig(model="", enable_prefix_caching=False)
    assert not make_params(off, WorkerReady(100, 16, 8192, 512)).enable_prefix_caching
