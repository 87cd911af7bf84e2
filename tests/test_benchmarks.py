"""The GPU throughput benchmark's smoke mode runs end to end on the CPU (tiny model, tiny contexts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_throughput_smoke_writes_every_part(tmp_path):
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("gpu.*")}
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--smoke", "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert {"command", "environment", "model", "notes", "copy_GBps", "speed", "max_batch", "quality",
            "criterion", "unavailable"} <= set(data)
    assert {"device", "torch", "transformers", "commit"} <= set(data["environment"])
    assert data["model"]["random_weights"] and any("RANDOM" in note for note in data["notes"])
    assert data["copy_GBps"] > 0
    ok = [row for row in data["speed"] if row["status"] == "ok"]
    assert {row["setting"] for row in ok} >= {"sdpa-dynamic", "sdpa-static", "h2o0.2-4", "h2o0.5-16",
                                              "sdpa-static+compile", "h2o0.2-4+compile"}
    assert all(row["decode_tokens_per_s"] > 0 and row["kv_bytes"] > 0 and row["floor_ms"] > 0 for row in ok)
    assert all(row["kv_GBps"] > 0 for row in ok if not row["compiled"])  # per-layer hooks time eager steps only
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert any(row["status"] == "does not fit" for row in data["speed"])  # the smoke memory cap bites
    compressed = next(r for r in ok if r["setting"] == "h2o0.2-4" and r["context"] == 192 and r["batch"] == 1)
    full = next(r for r in ok if r["setting"] == "sdpa-dynamic" and r["context"] == 192 and r["batch"] == 1)
    assert compressed["kv_bytes"] < full["kv_bytes"] / 4
    assert all(row["confirmed"] >= 1 for row in data["max_batch"])
    crit = data["criterion"]
    assert crit["layers"] == 1 and "speedup" in crit and crit["kv_ratio"] > 10  # measured on a 1-layer slice
    if "rows" in data["quality"]:  # the real SmolLM2 (its model wheel) is installed
        rows = {row["setting"]: row for row in data["quality"]["rows"]}
        assert abs(rows["sdpa-dynamic"]["perplexity_ratio"] - 1) < 1e-4 and rows["h2o0.2-4"]["perplexity_ratio"] > 0
    else:
        assert data["quality"]["error"]
    markdown = (tmp_path / "gpu.md").read_text()
    assert "Done criterion" in markdown and "RANDOM" in markdown and "## Decode at 192 tokens" in markdown
    assert before == {p.name: p.stat().st_mtime_ns for p in results.glob("gpu.*")}  # GPU results untouched
