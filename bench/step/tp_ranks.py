"""A tensor-parallel gpu worker group for in-process benchmarks (`tandem bench step
--tensor-parallel-size N`).

This process is rank 0 with a real `ModelRunner`; ranks 1..N-1 are real gpu worker
processes (`tandem run-role gpu-worker`), started here with the same config the launcher
would write.  Each plan goes to them over the plan channel before rank 0 runs it, exactly as
in a server: what is timed is the production path, collectives and plan fan-out included.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

from tandem_serve.ipc.process import CLI
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.proto.control_messages import Shutdown
from tandem_serve.proto.plan_messages import StepPlan

STOP_TIMEOUT_S = 10.0


class RankGroup:
    """Rank 0 (this process) of a group of `size` ranks on this host."""

    def __init__(self, model: str, size: int, threads: int, **runner: Any) -> None:
        from tandem_serve.gpu_worker import parallel
        from tandem_serve.gpu_worker.runner import ModelRunner
        from tandem_serve.proto.config import WorkerConfig
        from tandem_serve.tandem.tp_node import free_local_addr

        self.run_dir = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-bench-tp-")
        addr = Addresses("", "", "", (), "", worker_plans=f"ipc://{self.run_dir}/plans")
        cfg = ServerConfig(model=model, device="cpu", dtype="float32",
                           block_size=runner["block_size"], num_kv_blocks=runner["num_kv_blocks"],
                           max_num_seqs=runner["max_num_seqs"], tensor_parallel_size=size,
                           dist_init_addr=free_local_addr(), torch_threads=threads,
                           reserved_cpus=0, run_dir=self.run_dir, addresses=addr,
                           log_level="WARNING")
        path = os.path.join(self.run_dir, "config.json")
        with open(path, "w") as f:
            f.write(cfg.to_json())
        self.procs = [subprocess.Popen(
            [*CLI, "run-role", "gpu-worker", "--config-file", path,
             "--index", str(r), "--parent-pid", str(os.getpid())], stdin=subprocess.DEVNULL)
            for r in range(1, size)]
        self.leader = parallel.Leader(cfg)
        self.tp = parallel.start(cfg, 0)
        self.runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", **runner),
                                  self.tp)
        self.leader.wait_followers(120.0)

    def forward(self, plan: StepPlan) -> None:
        """Hand `plan` to the other ranks (call before running it here)."""
        self.leader.forward(plan)

    def close(self) -> None:
        try:
            self.leader.forward(Shutdown("benchmark done"))
            for p in self.procs:
                try:
                    p.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self.tp.close()
        finally:
            self.leader.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
