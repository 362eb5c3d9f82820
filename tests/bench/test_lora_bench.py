"""`tandem bench lora`: its synthetic adapters are valid PEFT LoRA folders, and its ratios are
taken within each repeat."""
from __future__ import annotations

import pathlib

from tandem_serve.adapters.peft import ModelShapes, read_adapter
from tandem_serve.bench.lora.adapters import write_adapter
from tandem_serve.bench.lora.main import COLUMNS
from tandem_serve.harness.stats import paired_ratio
from tandem_serve.harness.tables import paired_table


def test_written_adapters_read_back_at_their_rank(tmp_path: pathlib.Path) -> None:
    shapes = ModelShapes(2, 100, {"q_proj": (32, 16), "k_proj": (8, 16), "v_proj": (8, 16),
                                  "o_proj": (16, 32), "gate_proj": (40, 16),
                                  "up_proj": (40, 16), "down_proj": (16, 40)})
    write_adapter(str(tmp_path / "a"), shapes, rank=4, seed=0)
    adapter = read_adapter(str(tmp_path), "a", shapes, max_rank=4)
    assert len(adapter.modules) == 14 and {(m.rank, m.scaling) for m in adapter.modules} == {
        (4, 1.0)}


def test_ratios_pair_the_arms_of_each_repeat() -> None:
    def run(tpot: float, tput: float) -> dict[str, float]:
        return {"mean_ttft_ms": 1.0, "mean_tpot_ms": tpot, "mean_itl_ms": tpot,
                "output_throughput": tput}

    # The machine slows down by 2x in the second repeat; each pair still says 1.1x.
    runs = {"base model": [run(10, 100), run(20, 50), run(10, 100)],
            "4 adapters": [run(11, 90), run(22, 45), run(11, 90)]}
    assert paired_ratio(runs, "4 adapters", "base model", "mean_tpot_ms") == 1.1
    table = paired_table(runs, "base model", COLUMNS)
    assert "| 4 adapters | 1.00 | 11.00 | 11.00 | 90.00 | 1.10× | 0.90× |" in table
