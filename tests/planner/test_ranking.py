"""The planner's measured quality ranking: the shipped table equals the results it is built from, and a candidate is
ranked by its own entry, else by the best measured setting it keeps at least as much as, else after the ranked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from h2o_compress.config import CompressionConfig
from h2o_compress.planner import describe_choice, plan
from h2o_compress.planner.ranking import RANKING_FILE, keeps_at_least, rank, shipped_ranking

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_table_is_rebuilt_from_the_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality_ranking
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shipped = json.loads((ROOT / "h2o_compress" / RANKING_FILE).read_text())
    assert quality_ranking.table() == shipped
    assert all((ROOT / source).exists() for source in shipped["sources"])
    worst = {json.dumps(e["setting"]): (e["ratio"], e["worst_text"]) for e in shipped["entries"]}
    # the README's streaming column: the default's ratio on its worst text, python_reference
    assert worst[json.dumps({"policy": "h2o", "budget": 0.2, "kv_bits": 4})] == (1.1203, "python_reference")
    assert "sherlock" not in {t for e in shipped["entries"] for t in e["texts"]}  # the tuning text is left out


def test_measured_bound_and_unranked():
    full4 = rank(CompressionConfig(policy="full", kv_bits=4))
    assert (full4.basis, full4.ratio) == ("measured", 1.0363) and full4.note().startswith("1.036x perplexity")
    assert rank(CompressionConfig()).ratio == 1.0 and "reference" in rank(CompressionConfig()).note()
    bound = rank(CompressionConfig(budget=0.5, kv_bits=8))  # keeps more than h2o 20% int4, not than h2o 20% 16-bit
    assert (bound.basis, bound.ratio, bound.entry.label) == ("bound", 1.1203, "h2o 20% int4 g32 r3")
    assert bound.note().startswith("at most 1.120x") and "h2o 20% int4 g32 r3" in bound.note()
    assert rank(CompressionConfig(budget=0.5)).entry.label == "h2o 20% 16-bit"
    for unranked in (CompressionConfig(policy="local", budget=0.5, kv_bits=4),  # no local entry
                     CompressionConfig(budget=0.5, kv_bits=4, group_size=128),  # coarser groups than measured
                     CompressionConfig(budget=0.05, kv_bits=16),                # smaller budget than any entry
                     CompressionConfig(budget=0.5, kv_bits=4, quant="nf4", group_size=64)):
        assert rank(unranked).basis == "unranked" and rank(unranked).ratio is None and rank(unranked).note() == ""
    # lookahead and snapkv rank a stream as h2o does
    assert rank(CompressionConfig(policy="lookahead", budget=0.2, kv_bits=4)).ratio == 1.1203


def test_keeps_at_least():
    int4 = CompressionConfig(budget=0.2, kv_bits=4)
    assert keeps_at_least(CompressionConfig(policy="full", kv_bits=8), int4)
    assert keeps_at_least(CompressionConfig(budget=0.2, k_bits=16, v_bits=4), int4)
    assert not keeps_at_least(CompressionConfig(budget=0.2, kv_bits=4, residual=1), int4)
    assert not keeps_at_least(CompressionConfig(budget=0.2, kv_bits=4, heavy_ratio=0.25), int4)
    assert not keeps_at_least(CompressionConfig(budget=0.2, kv_bits=16), CompressionConfig(policy="full", kv_bits=4))
    assert not keeps_at_least(CompressionConfig(policy="tova", budget=0.5, kv_bits=16), int4)
    assert keeps_at_least(CompressionConfig(policy="snapkv", budget=0.5), int4, shipped_ranking().same_as)


def test_unranked_rows_come_after_by_cache_bytes_and_the_reason_says_so():
    report = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, budgets=(0.5, 0.25), bits=(4,),
                  group_sizes=(128,))
    assert all(r.quality is None for r in report.rows)
    assert [r.cache.total for r in report.rows] == sorted((r.cache.total for r in report.rows), reverse=True)
    assert report.recommended is report.rows[0]
    assert report.reason == ("no setting in the measured quality ranking fits: the least compressed that fits "
                             "(most cache bytes)")
    mixed = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, budgets=(0.5, 0.1), bits=(4,))
    ranked = [r.quality is not None for r in mixed.rows]
    assert ranked == sorted(ranked, reverse=True) and mixed.recommended.label == "h2o 50% int4 g32 r3"


def test_describe_choice_says_the_quality():
    row = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, headroom="10%").recommended
    assert describe_choice(row, "24GiB").endswith(
        "; quality: 1.036x perplexity of uncompressed on the reporting corpus's worst text (python_reference, of 3 "
        "measured)")
