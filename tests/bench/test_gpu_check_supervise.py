"""gpu-check ends every process a stage started: at the stage's deadline (its whole tree,
orphans included), when it returns with processes still running, when a `tandem` tool
times out, and at exit.  A stand-in gpu-check (this file's SCRIPT, in a process of its own,
as the real one is) runs stand-in stages that start process trees; afterwards no process
of theirs may be left."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import uuid

SCRIPT = r'''
import subprocess, sys, time
from dataclasses import replace

from tandem_serve.bench.gpu_check import main
from tandem_serve.bench.gpu_check.plans import CPU_PLAN
from tandem_serve.bench.gpu_check.report import Budget, Report
from tandem_serve.bench.gpu_check.supervise import run_tree

marker, pidfile, out = sys.argv[1:4]
SLEEPER = f"import time; time.sleep(600)  # {marker}"
# A parent that starts a grandchild in a session of its own (as a server's launcher starts
# its roles), records its pid, then sleeps ("stay") or exits at once ("leave": the grandchild
# is orphaned, as a killed `tandem bench` orphans its servers).
PARENT = ("import subprocess, sys, time; "
          "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True); "
          "open(sys.argv[2], 'a').write(f'{p.pid}\\n'); "
          "time.sleep(600 if sys.argv[3] == 'stay' else 0)  # " + marker)


def parent(how):
    return [sys.executable, "-c", PARENT, SLEEPER, pidfile, how]


def tree():
    """Two parents (one staying, one leaving) and their grandchildren: 4 processes."""
    start = len(open(pidfile).read().split())
    for how in ("stay", "leave"):
        p = subprocess.Popen(parent(how))
        open(pidfile, "a").write(f"{p.pid}\n")
    while len(open(pidfile).read().split()) < start + 4:
        time.sleep(0.05)


def hangs(plan, out, budget):  # runs past its cap
    tree()
    time.sleep(600)


def leaves(plan, out, budget):  # returns with its processes still running
    tree()
    return {}, "done"


def tool(plan, out, budget):  # a `tandem ...` that times out
    run_tree(parent("stay"), timeout=1.5)


open(pidfile, "w").close()
main.GUARD_GRACE_S = 0.5
plan = replace(CPU_PLAN, stage_caps={"hangs": 2.0})
report = Report(out, "supervised", {})
failed = main.run_stages([("hangs", hangs), ("leaves", leaves), ("tool", tool)], plan, out,
                         Budget(120), report)
tree()  # and a tree no stage owns, left for the exit
print(f"failed {failed}", flush=True)
'''


def marked(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            state = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            found.append(int(entry))
    return found


def test_stage_timeouts_and_the_exit_end_every_process_started(tmp_path: pathlib.Path) -> None:
    marker = f"gpu-check-test-{uuid.uuid4().hex}"
    pidfile, out = tmp_path / "pids", tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, marker, str(pidfile), str(out)],
                          capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "failed 2" in proc.stdout, proc.stdout + proc.stderr[-3000:]
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 4 * 3 + 1  # three trees of 4, the tool's grandchild
        stages = json.loads((out / "results.json").read_text())["stages"]
        assert stages["hangs"]["status"] == "failed"
        assert stages["hangs"]["error"].startswith("timed out after 2 s")
        assert stages["leaves"]["status"] == "passed"
        assert len(stages["leaves"]["figures"]["processes_left"]) == 3  # the leaving parent exited
        assert stages["tool"]["status"] == "failed" and "TimeoutExpired" in \
            stages["tool"]["error"] and "processes_left" not in stages["tool"]["figures"]
        assert time.monotonic() - t0 < 60
    finally:
        left = marked(marker)
        for pid in left:  # do not leak them into the other tests, whatever happened
            os.kill(pid, 9)
    assert left == [], f"{len(left)} processes left running"
