"""`bench ab`'s arms and table, without servers."""
from __future__ import annotations

from tandem_serve.bench.ab.main import engine_arms
from tandem_serve.bench.ab.tables import http_ratios, peer_ratios, prefill_ratios, table
from tandem_serve.harness.arms import Arm


def test_unpaced_arms_only_where_a_plan_has_several_steps() -> None:
    assert [a.name for a in engine_arms("1,8", unpaced=False)] == [
        "sync K=1", "async K=1", "sync K=8", "async K=8"]
    arms = engine_arms("1,8", unpaced=True)
    assert [a.name for a in arms] == [
        "sync K=1", "async K=1", "sync K=8", "async K=8", "async unpaced K=8"]
    assert arms[-1] == Arm(8, True, paced=False)


def row(tpot: float, tput: float) -> dict[str, float]:
    return {"mean_tpot_ms": tpot, "output_throughput": tput}


def test_ratios_are_to_sync_k1_or_else_the_first_sync_arm() -> None:
    text = table({"sync K=1": row(10.0, 100.0), "async K=8": row(5.0, 250.0)})
    assert "TPOT vs sync K=1" in text and "| 0.50× | 2.50× |" in text
    text = table({"sync K=8": row(8.0, 200.0), "async K=8": row(6.0, 300.0)})
    assert "TPOT vs sync K=8" in text and "| 0.75× | 1.50× |" in text
    assert "nan" not in table({"async K=8": row(6.0, 300.0)})


def test_http_arms_for_the_ratio_and_for_transformers_serve() -> None:
    assert [a.name for a in engine_arms("1,8", unpaced=False, http=True)][-2:] == [
        "async K=1 HTTP", "async K=8 HTTP"]
    # transformers serve is compared through the same HTTP client: the largest K over HTTP.
    arms = engine_arms("1,8", unpaced=False, peers=("transformers-serve",))
    assert arms[-1] == Arm(8, True, http=True) and arms[-1].name == "async K=8 HTTP"
    assert not any(a.http for a in engine_arms("1,8", unpaced=False, peers=("hf-generate",)))


def test_http_and_peer_ratios() -> None:
    results = {"async K=8": row(5.0, 200.0), "async K=8 HTTP": row(5.5, 190.0),
               "transformers serve": row(50.0, 20.0), "hf generate()": row(10.0, 100.0)}
    assert http_ratios(results) == ("async K=8 HTTP: output throughput = 0.950× gRPC's, "
                                    "mean TPOT = 1.100× gRPC's")
    assert peer_ratios(results) == ("async K=8 HTTP output throughput = 9.50× transformers "
                                    "serve's; async K=8 output throughput = 2.00× "
                                    "hf generate()'s")


def test_prefill_phase_twins_and_their_ratios() -> None:
    arms = engine_arms("8", unpaced=True, prefill_phase=True)
    assert [a.name for a in arms] == ["sync K=8", "async K=8", "async unpaced K=8",
                                      "sync K=8 prefill-phase", "async K=8 prefill-phase"]
    assert "--prefill-phase" in arms[-1].flags and "--prefill-phase" not in arms[1].flags
    mixed = {"p99_itl_ms": 20.0, "median_itl_ms": 10.0, "p99_tpot_ms": 12.0,
             "median_tpot_ms": 10.0, "mean_ttft_ms": 300.0, "output_throughput": 99.0}
    phase = {"p99_itl_ms": 80.0, "median_itl_ms": 10.0, "p99_tpot_ms": 24.0,
             "median_tpot_ms": 11.0, "mean_ttft_ms": 200.0, "output_throughput": 100.0}
    text = prefill_ratios({"async K=8": mixed, "async K=8 prefill-phase": phase,
                           "sync K=8 prefill-phase": phase})
    assert text == ("async K=8 (mixed steps) / async K=8 prefill-phase: ITL p99 0.25×, "
                    "ITL p50 1.00×, TPOT p99 0.50×, TPOT p50 0.91×, TTFT 1.50×, "
                    "output throughput 0.99×")
