#!/usr/bin/env python3
"""The installed import layout of this checkout, without installing it.

setup.cfg installs each top-level folder X as `tandem_serve.X`.  Where the project runs
from a bare checkout (scripts/gpu-check on a GPU host), and for tools that do not follow
setuptools' editable import hook (mypy, protoc), this makes DIR/tandem_serve/X a link to
X/; put DIR on the path.  The folder list is read from setup.cfg, so there is one list.

    python3 scripts/package_view.py build/view     # prints build/view
"""
from __future__ import annotations

import configparser
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tandem_serve"


def packages() -> dict[str, str]:
    """`tandem_serve.X` → the folder it installs from, as setup.cfg's package_dir says."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (s.strip() for s in line.partition("="))
        out[name] = folder
    return out


def make_view(dest: str) -> str:
    """Create (or refresh) DEST/tandem_serve/X → ROOT/X for every package; returns DEST."""
    dest = os.path.abspath(dest)
    top = os.path.join(dest, NAME)
    os.makedirs(top, exist_ok=True)
    for name, folder in packages().items():
        # The root package is one file, `tandem_serve/__init__.py` (the offline API's names).
        sub = name.split(".", 1)[1] if "." in name else "__init__.py"
        link = os.path.join(top, sub)
        target = os.path.join(ROOT, folder, "__init__.py" if sub == "__init__.py" else "")
        target = target.rstrip(os.sep)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR")
    print(make_view(sys.argv[1]))
