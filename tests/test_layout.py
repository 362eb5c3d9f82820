"""The package layout's import rule (docs/DESIGN.md section 7), checked on every source file.

Each top-level package holds one kind of thing, and imports only the kinds below it:

    proto                 wire formats                      third-party only
    ipc                   transport and process runtime     proto
    tokenization, guided, shared text, constraint and       proto, ipc, each other
    adapters              adapter-format code
    scheduler, gpu_worker, postproc_worker                  the above; never each other
    rpc, openai_api       the frontend's services           the above but no process package
    bench                 benchmarks                        anything
    tandem                command line and launcher         anything (the one place that may
                                                            start every process and benchmark)

Only `tandem` imports `bench`: the engine never depends on its benchmarks.

Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 500
# Generated gRPC stubs are not written by hand.
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

PROCESSES = {"scheduler", "gpu_worker", "postproc_worker"}
SHARED = {"tokenization", "guided", "adapters"}
FRONTEND = {"rpc", "openai_api"}
OURS = {"proto", "ipc", *SHARED, *PROCESSES, *FRONTEND, "bench", "tandem"}
ALLOWED: dict[str, set[str]] = {
    "proto": {"proto"},
    "ipc": {"proto", "ipc"},
    **{p: {"proto", "ipc", *SHARED} for p in SHARED},
    **{p: {"proto", "ipc", *SHARED, p} for p in PROCESSES},
    **{p: {"proto", "ipc", *SHARED, *FRONTEND} for p in FRONTEND},
    "bench": OURS,
    "tandem": OURS,
}


def _packages() -> list[str]:
    return sorted(p for p in OURS if (ROOT / p / "__init__.py").exists())


def _sources(package: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(GENERATED))


def _imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & OURS


def test_every_package_has_a_rule() -> None:
    dirs = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert dirs <= OURS, f"top-level packages without an import rule: {sorted(dirs - OURS)}"


@pytest.mark.parametrize("package", _packages())
def test_imports_follow_the_layout(package: str) -> None:
    bad = []
    for path in _sources(package):
        wrong = _imported_packages(path) - ALLOWED[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(wrong))}")
    assert not bad, f"{package}/ may import only {sorted(ALLOWED[package])}:\n" + "\n".join(bad)


def test_nothing_imports_bench() -> None:
    bad = [str(path.relative_to(ROOT)) for package in _packages()
           if package not in ("bench", "tandem")
           for path in _sources(package) if "bench" in _imported_packages(path)]
    assert not bad, f"the engine must not depend on the benchmarks: {bad}"


def test_no_source_file_is_too_long() -> None:
    files = [p for package in [*_packages(), "tests"] for p in _sources(package)]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along their seams): {long}"
