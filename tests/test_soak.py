"""The soak study on the tiny engine: 2 clients x 4 turns with disconnects, cancels and a burst past the queue,
every check passed and written to JSON and markdown."""
import json

import pytest

from cabinllm.benchmarks.studies.soak import main


@pytest.mark.slow
def test_soak_on_the_tiny_engine_passes_its_checks(tiny_engine_dir, tmp_path):
    output = tmp_path / "soak"
    # temperature 1 (seeded): replies of the random-weight model run to max_tokens, so a planned disconnect happens
    code = main(["--engine", str(tiny_engine_dir), "--clients", "2", "--turns", "4", "--max-tokens", "4",
                 "--temperature", "1", "--disconnect-rate", "0.5", "--cancel-rate", "0.25", "--bursts", "1",
                 "--max-sessions", "2", "--max-queue", "2", "--kv-budget-mb", "16", "--sample-interval", "0.1",
                 "--seed", "0", "--no-progress", "--output", str(output)])
    result = json.loads(output.with_suffix(".json").read_text())
    assert code == 0, result["failures"]
    assert result["passed"] and all(result["checks"].values())
    assert result["checks"]["no_unexpected_5xx"] and result["checks"]["no_connection_errors"]
    assert not any(status.startswith("5") and status != "503" for status in result["statuses"])
    assert 0 < result["kv"]["used_max_bytes"] <= result["kv"]["budget_bytes"]
    blocks = result["idle"]["blocks"]
    assert blocks["in_use"] == 0 and blocks["free"] + blocks["cached"] == blocks["total"]
    pooled = result["overall"]
    assert pooled["disconnected"] >= 1 and pooled["cancelled"] >= 1 and pooled["completed"] >= 1
    assert pooled["completed"] + pooled["disconnected"] + pooled["cancelled"] + pooled["gave_up"] == 8
    assert pooled["ttft_ms_p50"] > 0 and pooled["ttft_ms_p95"] >= pooled["ttft_ms_p50"]
    rss = result["rss"]
    assert rss["samples"] >= 1 and rss["first_quartile_median_mb"] > 0 and rss["last_quartile_median_mb"] > 0
    assert rss["ratio"] > 0
    assert result["burst_runs"] and sum(result["burst_runs"][0]["statuses"].values()) == result["burst_size"]
    assert output.with_suffix(".md").read_text().startswith("# cabin-serve soak")
