"""The decode_limit study on the tiny engine: each round's step time, probe, read bandwidth and fraction written to
JSON and markdown, the rounds split by their probe."""
import json

import pytest

from cabinllm.benchmarks.studies.decode_limit import main


@pytest.mark.slow  # a 1 GiB read per round
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_limit_writes_each_round_and_the_split_by_probe(tiny_engine_dir, tmp_path, keep_threads, threads):
    output = tmp_path / "limit"
    assert main(["--engine", str(tiny_engine_dir), "--context", "20", "--steps", "3", "--rounds", "2",
                 "--threads", str(threads), "--output", str(output)]) == 0
    result = json.loads(output.with_suffix(".json").read_text())
    assert len(result["rounds"]) == 2 and result["context"] == 20 and result["threads"] == threads
    assert result["read_bandwidth_bytes_s"] == max(r["read_bandwidth_bytes_s"] for r in result["rounds"])
    for r in result["rounds"]:
        assert r["step_ms"] > 0 and r["probe_us"] > 0
        expected = result["bytes_per_token"] / (r["step_ms"] / 1e3) / result["read_bandwidth_bytes_s"]
        assert abs(r["fraction"] - expected) < 1e-9
    assert sum(s["rounds"] for s in result["by_probe"].values()) == 2
    assert output.with_suffix(".md").read_text().startswith("# Decode at the memory limit, round by round")


def test_decode_limit_refuses_a_folder_without_an_engine(tmp_path, capsys):
    assert main(["--engine", str(tmp_path)]) == 2
    assert "no engine folder" in capsys.readouterr().err
