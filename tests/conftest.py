"""Shared fixtures: the tiny default checkpoint (built once per run), free ports, servers."""
from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Without a CUDA device, Triton kernels run under Triton's interpreter: the tests run
    the very kernels a GPU runs, on CPU tensors.  Triton reads TRITON_INTERPRET when a
    kernel is decorated, its own `triton.language` helpers included, and transformers
    imports triton as a side effect, so it is set before anything is collected."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch at one intra-op thread for a module: its models and tensors are tiny, and on a
    shared 2-core box intra-op threads only add barrier waits."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem_serve.harness.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-default")), "default")


@pytest.fixture(scope="session")
def fast_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem_serve.harness.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-fast")), "fast")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers the tests start (many at once, beside other users of this host) leave the HTTP API
# off unless a test asks for it with --http-port: they would all want port 8000.
os.environ.setdefault("TANDEM_HTTP_PORT", "0")


@pytest.fixture(scope="session")
def pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Tiny sentence-transformers folders by kind (`harness.tiny_pooling.KINDS`), built once;
    the BERT one declares Matryoshka dimensions 8, 16 and 32."""
    from tandem_serve.harness.tiny_pooling import KINDS, build_pooling_model

    root = tmp_path_factory.mktemp("pooling")
    return {kind: build_pooling_model(root / kind, kind,
                                      matryoshka=[8, 16, 32] if kind == "bert" else None)
            for kind in KINDS}
