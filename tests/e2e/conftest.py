"""Servers the end-to-end modules share across the session."""
from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.e2e.server import Server
from tests.e2e.tools_server import tools_server


@pytest.fixture(scope="session")
def shared_tools_server(tiny_model_dir: pathlib.Path,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tool-calling server (tests/e2e/tools_server.py), started on first use."""
    yield from tools_server(tiny_model_dir, tmp_path_factory)
