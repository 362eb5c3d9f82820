"""`tandem generate` and `tandem health`."""
from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions, TandemClient


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8033)
    p.add_argument("--tls-ca", default="", help="CA bundle: connect with TLS")
    p.add_argument("--tls-cert", default="", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", help="client key (mTLS)")
    p.add_argument("--api-key", default="", help="the server's --api-key")


def _client(args: argparse.Namespace) -> TandemClient:
    return TandemClient(f"{args.host}:{args.port}", tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, api_key=args.api_key)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="+", help="prompt text (several: one batched request)")
    _connection_args(p)
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--typical-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=0.0)
    p.add_argument("--length-penalty", nargs=2, metavar=("START", "DECAY"), default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--include-stop-sequence", action=argparse.BooleanOptionalAction,
                   default=None)
    p.add_argument("--time-limit-ms", type=int, default=0)
    p.add_argument("--truncate-input-tokens", type=int, default=0)
    p.add_argument("--input-text", action="store_true")
    p.add_argument("--generated-tokens", action="store_true")
    p.add_argument("--input-tokens", action="store_true")
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--ranks", action="store_true")
    p.add_argument("--top-n-tokens", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--regex", default=None, help="guided: the output matches this regex")
    g.add_argument("--json-schema", default=None, metavar="JSON",
                   help="guided: the output is JSON valid for this schema (text, or @FILE)")
    g.add_argument("--grammar", default=None,
                   help="guided: GBNF (root ::= ...) or Lark grammar (text, or @FILE)")
    g.add_argument("--choice", action="append", default=None, dest="choices",
                   help="guided: the output is exactly one of these (repeat, 2 or more)")
    g.add_argument("--response-format", choices=["json", "text"], default=None,
                   help="guided: json = one JSON object of any content")
    p.add_argument("--adapter-id", default="",
                   help="a LoRA adapter of the server's --adapter-cache (default: the base model)")
    p.add_argument("--correlation-id", default="")
    p.add_argument("--json", action="store_true", help="one JSON object per response message")
    p.add_argument("--no-stream", action="store_true", help="use the batched Generate RPC")


def _options(args: argparse.Namespace) -> GenerateOptions:
    lp = None
    if args.length_penalty:
        lp = (int(args.length_penalty[0]), float(args.length_penalty[1]))
    return GenerateOptions(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
        sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        typical_p=args.typical_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        length_penalty=lp, stop_sequences=args.stop,
        include_stop_sequence=args.include_stop_sequence, time_limit_millis=args.time_limit_ms,
        truncate_input_tokens=args.truncate_input_tokens, input_text=args.input_text,
        generated_tokens=args.generated_tokens, input_tokens=args.input_tokens,
        token_logprobs=args.logprobs, token_ranks=args.ranks, top_n_tokens=args.top_n_tokens,
        regex=args.regex, json_schema=_text_or_file(args.json_schema),
        grammar=_text_or_file(args.grammar), choices=args.choices,
        response_format=args.response_format)


def _text_or_file(value: str | None) -> str | None:
    """curl's convention: @path reads the file."""
    if value is not None and value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def _dump(msg: object) -> None:
    print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True)), flush=True)


def generate_main(args: argparse.Namespace) -> int:
    client = _client(args)
    opts = _options(args)
    meta = [("x-correlation-id", args.correlation_id)] if args.correlation_id else None
    try:
        if args.no_stream or len(args.prompt) > 1:
            for resp in client.generate(args.prompt, opts, metadata=meta,
                                        adapter_id=args.adapter_id):
                if args.json:
                    _dump(resp)
                else:
                    print(resp.text)
                    print(f"[{resp.generated_token_count} tokens, "
                          f"{pb.StopReason.Name(resp.stop_reason)}]", file=sys.stderr)
            return 0
        t0 = time.monotonic()
        last = None
        for resp in client.stream(args.prompt[0], opts, metadata=meta,
                                  adapter_id=args.adapter_id):
            if args.json:
                _dump(resp)
            else:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
            last = resp
        if not args.json and last is not None:
            took = time.monotonic() - t0
            print(f"\n[{last.generated_token_count} tokens in {took:.2f} s, "
                  f"{pb.StopReason.Name(last.stop_reason)}]", file=sys.stderr)
        return 0
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


def add_health_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("--service", default="fmaas.GenerationService",
                   help='"" for liveness; the generation service for readiness')
    p.add_argument("--wait", type=float, default=0.0,
                   help="keep trying for up to this many seconds")


def health_main(args: argparse.Namespace) -> int:
    client = _client(args)
    deadline = time.monotonic() + args.wait
    try:
        while True:
            if client.is_serving(args.service):
                print("SERVING")
                return 0
            if time.monotonic() >= deadline:
                print("NOT_SERVING", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        client.close()
