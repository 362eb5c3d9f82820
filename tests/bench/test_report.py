"""`tandem bench report` assembles BENCHMARKS.md from the sections it ran and the fragments
earlier runs left, in a fixed order."""
from __future__ import annotations

import pathlib
import subprocess

from tandem_serve.ipc.process import CLI

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def test_report_rewrites_one_section_and_keeps_the_others(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "soak.md").write_text("soak figures from an earlier run\n")
    (tmp_path / "bench" / "machine.md").write_text("stale machine line\n")
    proc = subprocess.run([*CLI, "bench", "report", "--docs",
                           str(tmp_path), "--only", "machine"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    assert "stale machine line" not in doc
    assert "torch" in doc and "cores" in doc
    assert doc.index("## Machine") < doc.index("## Soak") and "soak figures" in doc
    assert "section 1/1: machine" in proc.stderr


def test_report_rejects_an_unknown_section(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([*CLI, "bench", "report", "--docs",
                           str(tmp_path), "--only", "nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "unknown section 'nope'" in proc.stderr


def test_benchmarks_md_is_the_assembly_of_its_fragments() -> None:
    """docs/BENCHMARKS.md is written from docs/bench/*.md only: an edit to one without the
    other (or a fragment no section names) shows here."""
    from tandem_serve.bench.report.commands import Context
    from tandem_serve.bench.report.main import SECTIONS, assemble

    docs = pathlib.Path(ROOT) / "docs"
    ctx = Context(str(docs), {}, 1, 1.0)
    assert (docs / "BENCHMARKS.md").read_text() == assemble(ctx)
    assert {p.stem for p in (docs / "bench").glob("*.md")} <= set(SECTIONS)
