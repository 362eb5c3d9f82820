"""The detokenizer benchmark runs, and is not wildly slow, on each fast-path tokenizer kind."""

from __future__ import annotations

from tandem_serve.bench.postproc.detokenizer import bench_detokenizer
from tests.tokenizer_utils import byte_level_bpe_dir, sentencepiece_dir


def test_bench_detokenizer_runs() -> None:
    for build in (sentencepiece_dir, byte_level_bpe_dir):
        rate = bench_detokenizer(str(build()), n_tokens=20_000)
        # The real figures are ~1-4M tokens/s; this only guards against a collapse.
        assert rate > 100_000, (build.__name__, rate)
