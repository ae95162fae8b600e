"""cabin-bench's bookkeeping: interleaving, failures, medians and ratios pair by pair (no timing asserted)."""
from __future__ import annotations

import pytest

from cabinllm.benchmarks.claims import check_claims
from cabinllm.benchmarks.machine import oversubscribed
from cabinllm.benchmarks.multiturn import growth
from cabinllm.benchmarks.paired import PairRatio, paired_ratio
from cabinllm.benchmarks.runners.base import KVFootprint, Runner, RunTiming
from cabinllm.benchmarks.speed import SpeedSamples, measure_speed, rotated, speed_ratios, speed_rows


def fake_runner(name: str, family: str, decode: list[float], calls: list[str], fail_at: int | None = None) -> Runner:
    """A runner whose n-th run reports decode[n] tokens/s (and prefill 10x that); raises on run fail_at."""
    runs = iter(range(100))

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        n = next(runs)
        calls.append(f"{name}@{len(prompt)}")
        if n == fail_at:
            raise RuntimeError("backend exploded")
        return RunTiming(len(prompt), len(prompt) / (10 * decode[n]), new_tokens - 1, (new_tokens - 1) / decode[n])

    return Runner(name, family, "kv", "weights", run, lambda b, p: KVFootprint(1.0, 0, b, "fake"))


def test_paired_ratio_is_the_median_of_ratios_within_repeats():
    assert paired_ratio([10.0, 20.0, None, 30.0], [5.0, 40.0, 10.0, 10.0]) == (2.0, 3)
    assert paired_ratio([None], [1.0]) == (None, 0)


def test_rotated_starts_each_repeat_elsewhere():
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_every_runner_warms_up_then_runs_back_to_back_per_context_in_a_rotating_order():
    calls: list[str] = []
    ours = fake_runner("cabin int8", "cabin", [1, 20, 30], calls)
    peer = fake_runner("transformers dynamic", "transformers", [1, 10, 30], calls)
    speed = measure_speed([ours, peer], {8: [1] * 8, 4: [1] * 4}, 5, repeats=1)
    assert calls == ["cabin int8@4", "transformers dynamic@4",  # warm-up on the shortest prompt, not recorded
                     "cabin int8@8", "transformers dynamic@8", "cabin int8@4", "transformers dynamic@4"]
    assert speed.samples["decode_tok_s"]["cabin int8"] == {8: [20], 4: [30]}
    calls.clear()
    ours, peer = (fake_runner(r.name, r.family, [10, 10, 10], calls) for r in (ours, peer))
    measure_speed([ours, peer], {4: [1] * 4}, 5, repeats=2)
    assert calls[2:] == ["cabin int8@4", "transformers dynamic@4", "transformers dynamic@4", "cabin int8@4"]


def test_a_failing_runner_is_recorded_once_and_not_run_again():
    calls: list[str] = []
    broken = fake_runner("transformers hqq int4", "transformers", [10, 10, 10, 10], calls, fail_at=2)
    speed = measure_speed([broken], {4: [1] * 4}, 5, repeats=3)
    assert calls == ["transformers hqq int4@4"] * 3  # warm-up, a timed run, the run that fails
    assert speed.errors == {"transformers hqq int4": "RuntimeError: backend exploded"}
    assert speed.samples["decode_tok_s"]["transformers hqq int4"][4] == [10, None, None]
    assert speed_rows(speed)[0]["decode_tok_s"] == 10


def test_a_runner_that_fails_its_warm_up_is_never_timed():
    calls: list[str] = []
    broken = fake_runner("transformers fp8", "transformers", [10, 10], calls, fail_at=0)
    speed = measure_speed([broken], {4: [1] * 4}, 5, repeats=2)
    assert calls == ["transformers fp8@4"]
    assert speed.samples["decode_tok_s"]["transformers fp8"][4] == [None, None]
    assert "backend exploded" in speed.errors["transformers fp8"]


def test_more_threads_than_idle_cores_is_flagged():
    info = {"cores": 2, "load_average_1m": 1.1, "torch_threads": 2}
    assert "--threads 1" in oversubscribed(info)
    assert oversubscribed({**info, "torch_threads": 1}) is None
    assert oversubscribed({**info, "load_average_1m": 0.2}) is None
    assert oversubscribed({**info, "load_average_1m": None}) is None


def test_ratios_pair_the_runs_of_the_same_repeat():
    speed = SpeedSamples()
    for ours, peer in [(20, 10), (30, 30), (12, 4)]:
        speed.add("cabin int8", 2048, {"decode_tok_s": ours, "prefill_tok_s": 100})
        speed.add("transformers dynamic", 2048, {"decode_tok_s": peer, "prefill_tok_s": 50})
    ratios = {(r.metric, r.peer): r for r in speed_ratios(speed, ["cabin int8"], ["transformers dynamic"])}
    decode = ratios[("decode_tok_s", "transformers dynamic")]
    assert (decode.ratio, decode.pairs) == (2.0, 3)  # median of 2, 1, 3, not 20.67 / 14.67
    assert ratios[("prefill_tok_s", "transformers dynamic")].ratio == 2.0


def test_growth_compares_the_last_quarter_of_turns_with_the_first_after_turn_one():
    assert growth([9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]) == pytest.approx(2.0)
    assert growth([5.0]) is None


def test_claims_read_the_ratios_at_2048_and_the_ttft_growth():
    ratios = [PairRatio("cabin int8", "transformers dynamic", "decode_tok_s", 2048, 1.1, 3),
              PairRatio("cabin int8", "transformers hqq int4", "decode_tok_s", 2048, 1.5, 3),
              PairRatio("cabin int8", "transformers dynamic", "decode_tok_s", 512, 0.5, 3)]
    claims = check_claims(ratios, [512, 2048], ["transformers hqq int4", "transformers quanto int4"],
                          {"cabin int8 (reuse)": 1.1, "transformers dynamic": 3.0}, "cabin int8 (reuse)")
    assert [(c.value, c.passed) for c in claims] == [(1.1, True), (1.5, False), (None, None), (1.1, True),
                                                     (3.0, True)]
