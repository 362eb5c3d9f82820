"""The committed gRPC stubs match proto/generation.proto (regenerate with `make proto`)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_stubs_match_the_proto(tmp_path: pathlib.Path) -> None:
    (tmp_path / "proto").mkdir()
    for stem in ("generation", "admin"):
        (tmp_path / "proto" / f"{stem}.proto").write_text(
            (ROOT / "proto" / f"{stem}.proto").read_text())
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                        "--pyi_out=.", "--grpc_python_out=.", f"proto/{stem}.proto"],
                       cwd=tmp_path, check=True)
        for name in (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi"):
            fresh = (tmp_path / "proto" / name).read_text()
            assert fresh == (ROOT / "proto" / name).read_text(), f"{name} is stale: run make proto"


def test_field_numbers_follow_tgis() -> None:
    from proto import generation_pb2 as pb

    def num(msg: type, field: str) -> int:
        return msg.DESCRIPTOR.fields_by_name[field].number

    assert num(pb.GenerationResponse, "input_token_count") == 6
    assert num(pb.GenerationResponse, "stop_sequence") == 11
    assert num(pb.BatchedGenerationRequest, "params") == 10
    assert num(pb.StoppingCriteria, "include_stop_sequence") == 5
    assert num(pb.TokenInfo, "top_tokens") == 5
    assert pb.StopReason.Value("TOKEN_LIMIT") == 6
    assert pb.DESCRIPTOR.package == "fmaas"
