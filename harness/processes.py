"""Processes the benchmarks and the end-to-end tests start and watch, read from /proc: free
ports, process trees, roles by title, resident memory and CPU time; and ending every process
a run started, orphans included (`set_child_subreaper`, `end_processes`)."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

# The checkout the benchmarks run from: servers start there, reports are written there.  Links
# resolved: scripts/gpu-check imports this folder through a view's tandem_serve/harness link.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the race with other binders is the usual one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out = [root]
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def is_zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (or is gone altogether)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def descendants(root: int | None = None) -> set[int]:
    """Every live (not zombie) descendant of `root` (default: this process), not `root`."""
    root = os.getpid() if root is None else root
    return {p for p in tree_pids(root)[1:] if not is_zombie(p)}


_PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    """Make this process the parent of its descendants' orphans (Linux): a process whose
    parent dies while it runs (a server whose `tandem bench` was killed) then stays in this
    process's tree, where `descendants` finds it, instead of moving to init. False where the
    kernel offers no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_zombies(pids: set[int] | list[int]) -> None:
    """Collect the exit status of those of `pids` that are this process's exited children
    (an orphan adopted by a subreaper has no `Popen` to do it)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def end_processes(pids: set[int], grace_s: float = 10.0, rescan: int | None = None
                  ) -> set[int]:
    """End `pids`: SIGTERM (their own clean-up: a server stops its roles), then SIGKILL for
    whatever is still alive after `grace_s`. With `rescan` (a root pid, usually this one),
    descendants of `rescan` that appear meanwhile and were not alive before are ended too
    (a launcher's children orphaned by its death, moved to a subreaper).  Returns every pid
    that was signalled."""
    seen = set(pids)
    before = descendants(rescan) - seen if rescan is not None else set()

    def alive() -> set[int]:
        now = {p for p in seen if not is_zombie(p)}
        if rescan is not None:
            fresh = descendants(rescan) - before
            seen.update(fresh)
            now |= fresh
        return now

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        targets = alive()
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap_zombies(seen)
            if not alive():
                break
            time.sleep(0.05)
    reap_zombies(seen)
    return seen


def role_of(pid: int) -> str:
    """The Tandem role a process plays, from its title or its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if args and args[0].startswith("tandem: "):  # setproctitle
        return args[0][len("tandem: "):].strip()
    if "run-role" in args:
        i = args.index("run-role")
        role = args[i + 1] if i + 1 < len(args) else "?"
        if role == "postproc" and "--index" in args:
            role += " " + args[args.index("--index") + 1]
        return role
    if any("resource_tracker" in a for a in args):  # multiprocessing's, for shm segments
        return "shm tracker"
    return "frontend" if "serve" in args else os.path.basename(args[0]) if args else "?"


def find_frontend() -> int | None:
    """The pid of the only `tandem: frontend` process on this host, if there is one."""
    found = [int(e) for e in os.listdir("/proc") if e.isdigit() and role_of(int(e)) == "frontend"]
    return found[0] if len(found) == 1 else None


def rss_kb(pid: int) -> int | None:
    """Resident set size (VmRSS) in kB; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds per process of a server tree (and of this load generator) over a run:
    on a CPU host every process shares the cores the forward pass runs on."""

    def __init__(self, root: int, label: str = "") -> None:
        self.pids = {p: label or role_of(p) for p in tree_pids(root)}
        self.start = {p: cpu_seconds(p) for p in self.pids}
        self.own = own_cpu_seconds()

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, role in self.pids.items():
            if role == "shm tracker":
                continue
            used = cpu_seconds(pid) - self.start[pid]
            out[role] = out.get(role, 0.0) + max(used, 0.0)
        out["load generator"] = own_cpu_seconds() - self.own
        return out


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, and SIGKILL when it has not exited within `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
