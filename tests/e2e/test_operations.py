"""Operations over a real server: TLS and mutual TLS (a CA made here with the `openssl` CLI),
the `tandem health` / `tandem generate` commands, messages over gRPC's 4 MiB default, and
the x-correlation-id in the server log."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from tandem_serve.ipc.process import CLI
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions, TandemClient
from tests.e2e.server import ROOT, Server, free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")]

PROMPT = "Once upon a time"


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: pathlib.Path, name: str, subject: str, ext: str) -> None:
    """A P-256 key and a certificate for it signed by the CA in `d`."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
             "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=Tandem test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _issue(d, "server", "/CN=localhost",
           "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _issue(d, "client", "/CN=tandem-test-client", "extendedKeyUsage=clientAuth\n")
    return d


def tls_client(server: Server, certs: pathlib.Path, mutual: bool = False) -> TandemClient:
    files = {"tls_ca": str(certs / "ca.pem")}
    if mutual:
        files |= {"tls_cert": str(certs / "client.pem"), "tls_key": str(certs / "client.key")}
    return TandemClient(f"127.0.0.1:{server.port}", **files)


def start(model: pathlib.Path, certs: pathlib.Path, *flags: str,
          mutual: bool = False) -> Server:
    server = Server(str(model), "--tls-cert", str(certs / "server.pem"),
                    "--tls-key", str(certs / "server.key"), *flags, http=True)
    server.client.close()  # the helper's plaintext client cannot talk to it
    server.client = tls_client(server, certs, mutual)
    return server.wait_ready()


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path, certs: pathlib.Path) -> Iterator[Server]:
    # INFO: the correlation-id test reads the log (few requests here: the pipe will not fill).
    s = start(tiny_model_dir, certs, "--log-level", "INFO")
    try:
        yield s
    finally:
        s.stop()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)


def test_tls_only_answers_tls(server: Server, certs: pathlib.Path) -> None:
    (resp,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=4))
    assert resp.generated_token_count == 4
    plain = TandemClient(f"127.0.0.1:{server.port}")
    try:
        with pytest.raises(grpc.RpcError) as err:
            plain.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        plain.close()


def https_get(server: Server, certs: pathlib.Path, path: str, client_cert: bool = False,
              plain: bool = False) -> int:
    """Status of GET path on the HTTP API, over TLS against our CA (or plain HTTP)."""
    import ssl

    import httpx2 as httpx

    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    scheme = "http" if plain else "https"
    return httpx.get(f"{scheme}://127.0.0.1:{server.http_port}{path}", verify=ctx,
                     timeout=10).status_code


def test_the_http_api_uses_the_same_tls(server: Server, certs: pathlib.Path) -> None:
    import httpx2 as httpx

    assert https_get(server, certs, "/health") == 200
    assert https_get(server, certs, "/v1/models") == 200
    with pytest.raises(httpx.TransportError):
        https_get(server, certs, "/health", plain=True)


def test_health_command_exit_codes(server: Server, certs: pathlib.Path) -> None:
    conn = ["--port", str(server.port), "--tls-ca", str(certs / "ca.pem")]
    ready = cli("health", *conn)
    assert (ready.returncode, ready.stdout.strip()) == (0, "SERVING")
    assert cli("health", *conn, "--service", "").returncode == 0  # liveness
    assert cli("health", *conn, "--service", "no.such.Service").returncode == 1
    assert cli("health", "--port", str(free_port())).returncode == 1  # nobody there


def test_generate_command(server: Server, certs: pathlib.Path) -> None:
    conn = ["--port", str(server.port), "--tls-ca", str(certs / "ca.pem")]
    (expected,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=6))
    out = cli("generate", PROMPT, *conn, "--max-new-tokens", "6", "--generated-tokens",
              "--logprobs", "--input-text", "--json", "--correlation-id", "cli-json-7")
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(line) for line in out.stdout.splitlines()]
    assert msgs[0]["text"] == PROMPT and msgs[0]["input_token_count"] > 0
    assert "".join(m.get("text", "") for m in msgs[1:]) == expected.text
    assert msgs[-1]["stop_reason"] == "MAX_TOKENS" and msgs[-1]["generated_token_count"] == 6
    assert all("logprob" in t for m in msgs[1:] for t in m.get("tokens", []))
    # Plain text on stdout, the summary on stderr; several prompts use the batched RPC.
    out = cli("generate", PROMPT, "Second prompt", *conn, "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == expected.text
    assert out.stderr.count("[6 tokens, MAX_TOKENS]") == 2
    bad = cli("generate", PROMPT, *conn, "--top-n-tokens", "11", "--generated-tokens")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_messages_over_four_mebibytes(server: Server) -> None:
    text = "a" * (5 << 20)  # 5 MiB in, and the token strings out are over 4 MiB too
    (resp,) = server.client.tokenize([text], tokens=True)
    assert resp.token_count == len(resp.tokens) > 100_000
    assert sum(len(t) for t in resp.tokens) >= 5 << 20
    # The server stays responsive to others meanwhile and after.
    (gen,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=2))
    assert gen.generated_token_count == 2


def test_mutual_tls(tiny_model_dir: pathlib.Path, certs: pathlib.Path) -> None:
    server = start(tiny_model_dir, certs, "--tls-client-ca", str(certs / "ca.pem"),
                   mutual=True)
    try:
        (resp,) = server.client.generate([PROMPT], GenerateOptions(max_new_tokens=3))
        assert resp.generated_token_count == 3
        anonymous = tls_client(server, certs)  # TLS, but no client certificate
        try:
            with pytest.raises(grpc.RpcError) as err:
                anonymous.model_info()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            anonymous.close()
        conn = ["--port", str(server.port), "--tls-ca", str(certs / "ca.pem")]
        assert cli("health", *conn).returncode == 1
        assert cli("health", *conn, "--tls-cert", str(certs / "client.pem"),
                   "--tls-key", str(certs / "client.key")).returncode == 0
        # HTTP asks for the client certificate too.
        assert https_get(server, certs, "/health", client_cert=True) == 200
        with pytest.raises(Exception):  # noqa: B017 - the handshake fails, however httpx says it
            https_get(server, certs, "/health")
    finally:
        assert server.stop() == 0


# Last in the module: it stops the server to read its whole log.
def test_correlation_id_names_the_request_in_the_log(server: Server) -> None:
    meta = [("x-correlation-id", "corr-stream-41")]
    list(server.client.stream(PROMPT, GenerateOptions(max_new_tokens=2), metadata=meta))
    server.client.generate([PROMPT], GenerateOptions(max_new_tokens=2),
                           metadata=[("x-correlation-id", "corr-batch-42")])
    with pytest.raises(grpc.RpcError):
        list(server.client.stream(PROMPT, GenerateOptions(max_new_tokens=2, min_new_tokens=3),
                                  metadata=[("x-correlation-id", "corr-bad-43")]))
    assert server.stop() == 0
    assert server.proc.stderr is not None
    log = server.proc.stderr.read()

    def lines(cid: str) -> list[str]:
        return [line for line in log.splitlines() if f"[{cid}]" in line]

    # Its arrival and its end, each naming it.
    for cid in ("corr-stream-41", "corr-batch-42", "cli-json-7"):
        assert len(lines(cid)) >= 2, (cid, lines(cid))
        assert pb.StopReason.Name(pb.MAX_TOKENS) in lines(cid)[-1]
    (rejected,) = lines("corr-bad-43")
    assert "INVALID_ARGUMENT" in rejected and "min_new_tokens" in rejected
