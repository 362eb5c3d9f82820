"""`tandem run-batch`'s parts that need no engine: the command line, the input lines, the
summary (the engine-backed run is in test_offline_llm.py)."""
from __future__ import annotations

import json

from tandem_serve.tandem.cli import build_parser
from tandem_serve.tandem.offline.run_batch import output_line, parse_line, summary


def test_the_command_takes_the_batch_files_and_the_server_flags() -> None:
    args = build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl",
                                      "--model", "m", "--max-num-seqs", "8"])
    assert (args.input_file, args.output_file, args.model, args.max_num_seqs) == \
        ("in.jsonl", "out.jsonl", "m", 8)


def test_each_bad_line_says_what_is_wrong() -> None:
    def problem(item: object) -> tuple[str, str] | None:
        return parse_line(1, json.dumps(item)).error

    good = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}
    assert problem(good) is None
    assert problem({**good, "custom_id": 3})[0] == "missing_custom_id"  # type: ignore[index]
    assert problem({**good, "method": "GET"})[0] == "invalid_method"  # type: ignore[index]
    assert problem({**good, "url": "/v2/x"})[0] == "invalid_url"  # type: ignore[index]
    assert problem({**good, "body": []})[0] == "invalid_body"  # type: ignore[index]
    assert problem([1])[0] == "invalid_request"  # type: ignore[index]
    line = parse_line(7, "{")
    assert line.error is not None and line.error[1].startswith("line 7:")
    out = output_line(line)
    assert out["response"] is None and out["error"]["code"] == "invalid_json"


def test_the_summary_counts_outcomes() -> None:
    ok = output_line(parse_line(1, json.dumps(
        {"custom_id": "a", "url": "/v1/completions", "body": {}})), 200, b'{"x": 1}')
    refused = output_line(parse_line(2, json.dumps(
        {"custom_id": "b", "url": "/v1/completions", "body": {}})), 400, b'{"error": {}}')
    assert ok["response"]["body"] == {"x": 1} and ok["error"] is None
    assert summary([ok, refused, ok], 2.0) == \
        "run-batch: 3 requests in 2.0 s: 2 succeeded, 1 failed (400: 1)"
