"""How `tandem bench report` runs what a reader would type: `tandem` subcommands from the
checkout, the command lines shown with model folders named by preset, and the sections
made of an intro, the command and what it printed."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

from tandem_serve.harness.processes import REPO_ROOT
from tandem_serve.ipc.process import CLI


@dataclass
class Context:
    docs: str
    models: dict[str, str]  # preset -> checkpoint folder
    repeats: int
    soak_minutes: float
    fuzz_examples: int = 5000

    @property
    def img(self) -> str:
        return os.path.join(self.docs, "img")

    @property
    def frag(self) -> str:
        return os.path.join(self.docs, "bench")


def progress(msg: str) -> None:
    print(f"[bench report] {msg}", file=sys.stderr, flush=True)


def tandem(*args: str, timeout: float = 3600) -> str:
    """Run a `tandem` subcommand from the repository root; its stdout (stderr streams)."""
    cmd = [*CLI, *args]
    progress("$ tandem " + " ".join(args))
    out = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout,
                         check=True)
    return out.stdout


def shown(args: list[str], ctx: Context) -> str:
    """The command as a reader would type it: model folders by preset, not temp paths."""
    names = {path: f"/tmp/tiny-{preset}" for preset, path in ctx.models.items()}
    return "tandem " + " ".join(shlex.quote(names.get(a, a)) for a in args)


def scrub(text: str, ctx: Context) -> str:
    """A command's output with the report's temporary model folders named by preset."""
    for preset, path in ctx.models.items():
        text = text.replace(path, f"/tmp/tiny-{preset}")
    return text


def code(*lines: str) -> str:
    return "```sh\n" + "\n".join(lines) + "\n```"


def command_section(ctx: Context, intro: str, args: list[str], *, fenced: bool = False,
                    timeout: float = 3600) -> str:
    """The intro, the command as typed, and what it printed (`fenced`: as plain text)."""
    text = tandem(*args, timeout=timeout).strip()
    return "\n\n".join([intro, code(shown(args, ctx)),
                        f"```\n{text}\n```" if fenced else text])
