"""The committed gRPC stubs match proto/generation.proto (regenerate with `make proto`)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_stubs_match_the_proto(tmp_path: pathlib.Path) -> None:
    # Compiled as the installed layout names it, so the stubs import tandem_serve.proto.
    out = tmp_path / "tandem_serve" / "proto"
    out.mkdir(parents=True)
    for stem in ("generation", "admin"):
        (out / f"{stem}.proto").write_text((ROOT / "proto" / f"{stem}.proto").read_text())
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                        "--pyi_out=.", "--grpc_python_out=.",
                        f"tandem_serve/proto/{stem}.proto"], cwd=tmp_path, check=True)
        for name in (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi"):
            fresh = (out / name).read_text()
            assert fresh == (ROOT / "proto" / name).read_text(), f"{name} is stale: run make proto"


def test_field_numbers_follow_tgis() -> None:
    from tandem_serve.proto import generation_pb2 as pb

    def num(msg: type, field: str) -> int:
        return msg.DESCRIPTOR.fields_by_name[field].number

    assert num(pb.GenerationResponse, "input_token_count") == 6
    assert num(pb.GenerationResponse, "stop_sequence") == 11
    assert num(pb.BatchedGenerationRequest, "params") == 10
    assert num(pb.StoppingCriteria, "include_stop_sequence") == 5
    assert num(pb.TokenInfo, "top_tokens") == 5
    assert pb.StopReason.Value("TOKEN_LIMIT") == 6
    assert pb.DESCRIPTOR.package == "fmaas"
