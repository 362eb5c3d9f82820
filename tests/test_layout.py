"""The package layout's import rule (docs/DESIGN.md section 7), checked on every source file.

Each top-level package holds one kind of thing, and imports only the kinds below it:

    proto                 wire formats                      third-party only
    ipc                   transport and process runtime     proto
    tokenization, guided, shared text, constraint,          proto, ipc, each other
    adapters, pooling     adapter- and pooling-folder code
    scheduler, gpu_worker, postproc_worker                  the above; never each other
    frontend              what both APIs share (a library)  the above but no process package
                                                            and neither API
    rpc, openai_api       the gRPC service, the HTTP API    proto, ipc, the shared packages
                                                            and frontend; never each other
    harness               what benchmarks and tests drive   the above but no process package
                          servers with (processes, clients,
                          compose roles, stats)
    bench                 benchmarks                        anything
    tandem                command line, launcher and the    anything (the one place that may
                          frontend process (serve.py, which start every process and benchmark)
                          serves both APIs)

Only `tandem` imports `bench`: the engine never depends on its benchmarks.

Imports inside functions count too: a lazy import is still a dependency.

Beside the imports: no source file over 500 lines, no folder over 15 modules, and no two
classes of the shipped packages with the same public name.
"""
from __future__ import annotations

import ast
import configparser
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 500
MAX_MODULES = 15  # per folder, __init__.py and generated stubs aside
ROOT_NAME = "tandem_serve"  # setup.cfg installs folder X as tandem_serve.X
# Generated gRPC stubs are not written by hand.
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

PROCESSES = {"scheduler", "gpu_worker", "postproc_worker"}
SHARED = {"tokenization", "guided", "adapters", "pooling"}
APIS = {"rpc", "openai_api"}
OURS = {"proto", "ipc", *SHARED, *PROCESSES, "frontend", *APIS, "harness", "bench", "tandem"}
# root/ installs as `tandem_serve` itself: the offline API's names, imported on first use.
ROOT_FOLDER = "root"
VLLM_SHAPES = ROOT / "tandem" / "offline" / "params.py"
ALLOWED: dict[str, set[str]] = {
    "proto": {"proto"},
    "ipc": {"proto", "ipc"},
    **{p: {"proto", "ipc", *SHARED} for p in SHARED},
    **{p: {"proto", "ipc", *SHARED, p} for p in PROCESSES},
    # Both APIs use it, so it imports neither: test_frontend_imports_neither_api.
    "frontend": {"proto", "ipc", *SHARED, "frontend"},
    **{p: {"proto", "ipc", *SHARED, "frontend", p} for p in APIS},
    # Drives servers from outside, as a client: no process package, no benchmark.
    "harness": {"proto", "ipc", *SHARED, "frontend", *APIS, "harness"},
    "bench": OURS,
    "tandem": OURS,
    ROOT_FOLDER: {"tandem"},
}


def _packages() -> list[str]:
    return sorted(p for p in OURS if (ROOT / p / "__init__.py").exists())


def _sources(package: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(GENERATED))


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute module name the file imports, lazy imports included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _imported_packages(path: pathlib.Path) -> set[str]:
    return {m.split(".")[1] for m in _imported_modules(path)
            if m.startswith(ROOT_NAME + ".")} & OURS


@pytest.mark.parametrize("package", [*_packages(), "tests"])
def test_every_import_goes_through_the_root_name(package: str) -> None:
    """`import proto` would be proto-plus's (or nothing) once installed: setup.cfg installs
    each folder X as tandem_serve.X only."""
    bad = [f"{path.relative_to(ROOT)}: {m}" for path in _sources(package)
           for m in _imported_modules(path) if m.split(".")[0] in OURS]
    assert not bad, f"import these as {ROOT_NAME}.<package>:\n" + "\n".join(bad)


def test_setup_cfg_installs_every_package() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    mapped = {line.split("=")[0].strip() for line in
              cfg["options"]["package_dir"].strip().splitlines()}
    listed = set(cfg["options"]["packages"].split())
    folders = {".".join(p.parent.relative_to(ROOT).parts) for package in _packages()
               for p in (ROOT / package).rglob("__init__.py")}
    assert mapped == {f"{ROOT_NAME}.{p}" for p in _packages()} | {ROOT_NAME}
    assert listed == {f"{ROOT_NAME}.{p}" for p in folders} | {ROOT_NAME}


def test_every_package_has_a_rule() -> None:
    dirs = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    known = OURS | {ROOT_FOLDER}
    assert dirs <= known, f"top-level packages without an import rule: {sorted(dirs - known)}"


@pytest.mark.parametrize("package", [*_packages(), ROOT_FOLDER])
def test_imports_follow_the_layout(package: str) -> None:
    bad = []
    for path in _sources(package):
        wrong = _imported_packages(path) - ALLOWED[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(wrong))}")
    assert not bad, f"{package}/ may import only {sorted(ALLOWED[package])}:\n" + "\n".join(bad)


def test_frontend_imports_neither_api() -> None:
    """frontend/ is a library both APIs use, so it depends on neither of them: the process
    that serves both is assembled above them (tandem/serve.py)."""
    bad = [f"{path.relative_to(ROOT)} imports {', '.join(sorted(wrong))}"
           for path in _sources("frontend") if (wrong := _imported_packages(path) & APIS)]
    assert not bad, "frontend/ may import neither rpc/ nor openai_api/:\n" + "\n".join(bad)


def test_nothing_imports_bench() -> None:
    bad = [str(path.relative_to(ROOT)) for package in _packages()
           if package not in ("bench", "tandem")
           for path in _sources(package) if "bench" in _imported_packages(path)]
    assert not bad, f"the engine must not depend on the benchmarks: {bad}"


def test_only_the_benchmark_tests_import_bench() -> None:
    """Tests take process helpers from tests/ utilities, not from benchmarks."""
    bad = [str(path.relative_to(ROOT)) for path in _sources("tests")
           if "bench" in _imported_packages(path)
           and path.relative_to(ROOT).parts[:2] != ("tests", "bench")]
    assert not bad, f"only tests/bench/ may import bench: {bad}"


def test_no_source_file_is_too_long() -> None:
    files = [p for package in [*_packages(), "tests"] for p in _sources(package)]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along their seams): {long}"


def test_no_folder_holds_too_many_modules() -> None:
    """A folder past a screenful of modules is several concerns side by side: it splits into
    subfolders by concern, each with its __init__.py saying what lives there."""
    folders = {p.parent for package in _packages() for p in (ROOT / package).rglob("__init__.py")}
    crowded: dict[str, int] = {}
    for folder in sorted(folders):
        modules = [p for p in folder.glob("*.py")
                   if p.name != "__init__.py" and not p.name.endswith(GENERATED)]
        if len(modules) > MAX_MODULES:
            crowded[f"{folder.relative_to(ROOT)}/"] = len(modules)
    assert not crowded, (f"folders with more than {MAX_MODULES} modules (split them into "
                         f"subfolders by concern): {crowded}")


def test_no_two_classes_share_a_public_name() -> None:
    """A public class name names one thing in the whole engine: a reader (or a grep) meeting
    `Request` should not have to ask which one.  Private (`_Name`) classes are their module's
    own business; nested and function-local classes count.  The offline API's module is left
    out: its classes carry vLLM's names (`SamplingParams`, `RequestOutput`), which its users
    import as they are."""
    where: dict[str, list[str]] = {}
    for package in _packages():
        for path in _sources(package):
            if path == VLLM_SHAPES:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}
    assert not shared, "classes that share a name (give each a name saying what it is):\n" + \
        "\n".join(f"{name}: {', '.join(paths)}" for name, paths in shared.items())


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT_NAME, *parts])


def _import_graph() -> dict[str, set[str]]:
    """Source module → the project's modules it imports (`from pkg import mod` is an import
    of pkg.mod when that is a module; lazy and TYPE_CHECKING imports count)."""
    files = {_module_name(p): p for package in _packages() for p in _sources(package)}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in files else node.module)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_files() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import each other (move what both need below them):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names() -> None:
    """`_name` is private to its module: what another module needs gets a public name (or
    moves to where both can import it)."""
    bad = []
    for package in [*_packages(), "tests"]:
        for path in _sources(package):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.startswith(ROOT_NAME + ".")):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [p for p in node.module.split(".") if p.startswith("_")]
                if private:
                    bad.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert not bad, "private names used from another package:\n" + "\n".join(bad)


MAX_PARAMS = 10


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters, `self` and `cls` not counted."""
    a = fn.args
    names = [p.arg for p in [*a.posonlyargs, *a.args]]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0] in ("self", "cls") else 0)


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (`@triton.jit`): its parameters are its ABI (pointers, strides and
    compile-time constants), which no object can group."""
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_no_function_takes_too_many_parameters() -> None:
    """A long parameter list is a bag of settings or state waiting to be one object (a config
    section, the sampler's `SamplingBatch`).  Triton kernels are exempt (`_is_kernel`)."""
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})"
           for package in _packages() for path in _sources(package)
           for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
           and not _is_kernel(node) and (n := _parameters(node)) > MAX_PARAMS]
    assert not bad, f"functions of more than {MAX_PARAMS} parameters:\n" + "\n".join(bad)
