"""cabin-calibrate and cabin-eval end to end on short dialogues: the mechanics on the tiny model and the default
one, what only real weights show (a sane perplexity, which INT8 mode loses least) on the default model."""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cabinllm.benchmarks.studies import int8_ceiling, kv_oracle
from cabinllm.calibration.calibrate import CalibrationRequest, calibrate
from cabinllm.calibration.clip_search import CANDIDATES
from cabinllm.calibration.clips import DEFAULT_PERCENTILE, compute_clips
from cabinllm.calibration.evaluate import EVAL_MODES, Totals, accumulate, evaluate, stored_bytes_per_token
from cabinllm.calibration.selection import prepare_dialogues, split_of
from cabinllm.cli import calibrate as cli_calibrate
from cabinllm.cli import eval as cli_eval
from cabinllm.runtime.formats.scales_file import load_scales_file
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK
from cabinllm.runtime.kv.int4 import Int4KV
from cabinllm.runtime.kv.modes import bytes_per_token, kv_mode
from cabinllm.runtime.sources.model_source import load_model


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Callable[[Path], Path]:
    """cabin-calibrate on three builtin cabin sessions of 64 tokens, no general dialogue mixed in and no grade,
    run once per engine folder: the folder of its kv_scales.json and report."""

    @functools.cache
    def calibrate(engine_folder: Path) -> Path:
        folder = tmp_path_factory.mktemp("calibration")
        code = cli_calibrate.main(["--model", str(engine_folder), "--data", "builtin", "--num-dialogues", "3",
                                   "--max-tokens", "64", "--min-tokens", "64", "--method", "percentile",
                                   "--percentile", "99.9", "--mix", "none", "--no-grade",
                                   "--output", str(folder / "kv_scales.json"),
                                   "--report", str(folder / "report")])
        assert code == 0
        return folder

    return calibrate


@pytest.fixture
def calibrated_scales(engine, calibrated) -> Path:
    """The engine's kv_scales.json and report folder made by cabin-calibrate."""
    return calibrated(engine.folder)


@pytest.fixture(scope="module")
def evaluated(calibrated) -> Callable[[Path], tuple]:
    """``evaluate`` of every mode against fp32 on one held-out dialogue of 64 tokens with the calibrated scales,
    run once per engine folder: the model, the dialogues and the results."""

    @functools.cache
    def run(engine_folder: Path) -> tuple:
        model = load_model(str(engine_folder))
        config = model.config
        scales = load_scales_file(calibrated(engine_folder) / "kv_scales.json", model.fingerprint,
                                  config.num_hidden_layers)
        dialogues, _ = prepare_dialogues("builtin", "heldout", 1, 0, model.tokenizer, max_tokens=64, min_tokens=64)
        return model, dialogues, evaluate(model, dialogues, list(EVAL_MODES), scales, progress=False)

    return run


def test_cabin_calibrate_writes_scales_with_ranges_and_a_report(calibrated_scales, engine):
    config = engine.config
    loaded = load_scales_file(calibrated_scales / "kv_scales.json", engine.fingerprint,
                              config.num_hidden_layers, (config.num_key_value_heads, config.head_size))
    assert loaded.method == "percentile-99.9" and loaded.ranges is not None
    assert loaded.data["dialogues"] == 3 and loaded.data["tokens"] == 192 and loaded.data["split"] == "train"
    assert any(r.k_clip_rate > 0 for r in loaded.ranges)
    for layer, r in enumerate(loaded.ranges):  # the percentile clip never exceeds the measured max
        assert loaded.scales.k[layer] * 127 <= max(max(h) for h in r.k_channel_amax) * (1 + 1e-9)
    summary = (calibrated_scales / "report" / "summary.md").read_text(encoding="utf-8")
    last_layer_row = f"| {config.num_hidden_layers - 1} |"
    assert last_layer_row in summary and "K clipped %" in summary and "malformed skipped: 0" in summary
    assert (calibrated_scales / "report" / "ranges.png").stat().st_size > 10_000



def test_the_report_records_the_command_line_it_was_given(calibrated_scales, engine):
    summary = (calibrated_scales / "report" / "summary.md").read_text(encoding="utf-8")
    assert f"- command: `cabin-calibrate --model {engine.folder} --data builtin --num-dialogues 3" in summary
    assert "--percentile 99.9 --mix none --no-grade" in summary

def test_cabin_calibrate_explains_bad_requests(engine, tmp_path, capsys):
    code = cli_calibrate.main(["--model", str(engine.folder), "--data", str(tmp_path / "none.jsonl"),
                               "--output", str(tmp_path / "s.json")])
    assert code == 2 and "no such file" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_evaluate_compares_every_mode_with_full_precision(engine, evaluated):
    model, dialogues, results = evaluated(engine.folder)
    assert list(EVAL_MODES) == ["fp16", "int8", "int8-eq", "int8-separate", "int8-dynamic", "int4", "fp8",
                               "fp8-eq"]  # one name a mode
    assert list(results) == ["fp32", *EVAL_MODES]
    assert 1 < results["fp32"].ppl < math.inf and results["fp32"].kl == 0
    for mode in EVAL_MODES:
        r = results[mode]
        assert math.isclose(r.ppl_delta_pct, 100 * (r.ppl / results["fp32"].ppl - 1))
        assert r.kl >= -1e-6 and 0 <= r.top1_agree <= 1
    assert results["fp16"].top1_agree > 0.98
    # int4 counts its fp16 window: more than int8 on this short dialogue, less on a long one
    layout, tokens = model.transformer().kv_layout, len(dialogues[0].token_ids)
    window = Int4KV.reserved_bytes(layout, DEFAULT_TOKENS_PER_BLOCK)
    int4_bytes = bytes_per_token(layout, "int4", DEFAULT_TOKENS_PER_BLOCK)
    assert results["int4"].kv_bytes_per_token == -(-(int4_bytes * tokens + window) // tokens)
    assert stored_bytes_per_token(layout, kv_mode("int4"), 2048) < \
        0.8 * stored_bytes_per_token(layout, kv_mode("int8"), 2048)


def test_real_weights_keep_fp16_close_and_rank_the_int8_modes(default_engine, evaluated):
    """What the default model's weights show and the tiny random ones need not: a sane perplexity, fp16 within
    0.1 % of it, per-token scales and equalization both beating one plain shared INT8 scale per layer, and fp8's
    3-bit mantissa behind equalized int8 at the same bytes."""
    _, _, results = evaluated(default_engine.folder)
    assert results["fp32"].ppl < 1000
    assert abs(results["fp16"].ppl_delta_pct) < 0.1
    assert results["int8-dynamic"].kl < results["int8"].kl
    assert results["int8-eq"].kl < results["int8"].kl
    assert results["fp16"].kl < results["int8-eq"].kl < results["fp8"].kl


def test_cabin_eval_prints_json_keyed_by_mode(engine, calibrated_scales, tmp_path, capsys):
    out = tmp_path / "eval"
    code = cli_eval.main(["--model", str(engine.folder), "--data", "builtin", "--kv-cache",
                          "int8-shared,int8-shared-eq", "--scales", str(calibrated_scales / "kv_scales.json"),
                          "--num-dialogues", "1", "--max-tokens", "48", "--min-tokens", "48", "--json",
                          "--output", str(out)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == ["fp32", "int8-shared", "int8-shared-eq"]
    assert set(printed["int8-shared-eq"]) >= {"ppl", "ppl_delta_pct", "kl", "top1_agree"}
    record = json.loads((out / "eval.json").read_text())
    assert record["modes"] == printed and record["data"]["split"] == "heldout"
    assert (out / "accuracy.png").stat().st_size > 10_000


def test_cabin_eval_rejects_unknown_modes_and_foreign_scales(engine, tmp_path, capsys):
    assert cli_eval.main(["--model", str(engine.folder), "--kv-cache", "int3"]) == 2
    assert "unknown --kv-cache mode" in capsys.readouterr().err
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"version": 2, "model_fingerprint": "0" * 16, "method": "max", "layers": []}))
    assert cli_eval.main(["--model", str(engine.folder), "--kv-cache", "int8-shared",
                          "--scales", str(foreign), "--output", str(tmp_path / "e")]) == 2
    assert "calibrate this model instead" in capsys.readouterr().err


def test_int8_ceiling_rounds_only_the_side_it_names(engine, calibrated_scales, tmp_path):
    out = tmp_path / "ceiling.json"
    code = int8_ceiling.main(["--model", str(engine.folder), "--scales", str(calibrated_scales / "kv_scales.json"),
                              "--data", "builtin", "--num-dialogues", "1", "--max-tokens", "64", "--min-tokens", "64",
                              "--json", str(out)])
    assert code == 0
    kl = {name: r["kl"] for name, r in json.loads(out.read_text())["variants"].items()}
    both = kl["K and V static per-channel"]
    assert 0 < kl["K static per-channel, V exact"] < both and 0 < kl["K exact, V static per-channel"] < both
    assert kl["K dynamic per-token, V exact"] > 0


def test_kv_oracle_fits_its_scales_on_the_dialogues_it_measures(engine, tmp_path):
    model = load_model(str(engine.folder))
    dialogues, _ = prepare_dialogues("builtin", "heldout", 1, 0, model.tokenizer, 64, 64)
    fitted = kv_oracle.fitted_scales(model, dialogues, 100.0)
    run = run_tokens(model.transformer(), dialogues[0].token_ids)
    for layer, ranges in enumerate(fitted.ranges):
        k, v = run.kv(layer)
        assert torch.allclose(torch.tensor(ranges.k_channel_clip).float(), k.abs().amax(0))
        assert torch.allclose(torch.tensor(ranges.v_channel_clip).float(), v.abs().amax(0))
    assert fitted.data["first_token"] == dialogues[0].token_ids[0]
    clipped = kv_oracle.fitted_scales(model, dialogues, 99.0)
    assert all(c.k_clip_rate > 0 for c in clipped.ranges) and fitted.ranges[0].k_clip_rate == 0
    out = tmp_path / "oracle.json"
    assert kv_oracle.main(["--model", str(engine.folder), "--data", "builtin", "--num-dialogues", "1",
                           "--max-tokens", "64", "--min-tokens", "64", "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"fp32", *kv_oracle.MODES} and all(modes[m]["kl"] > 0 for m in kv_oracle.MODES)


def test_static_per_channel_rounding_is_within_half_a_step():
    steps = [torch.rand(3, 64) + 0.01]
    x = (torch.rand(50, 3, 64) * 2 - 1) * steps[0] * 127
    rounded = int8_ceiling.static_per_channel(steps)(0, x)
    assert torch.all((rounded - x).abs() <= steps[0] / 2 * 1.0001 + 1e-6)
    assert torch.allclose(rounded / steps[0], torch.round(rounded / steps[0]), atol=1e-3)
    clipped = int8_ceiling.static_per_channel(steps)(0, x * 3)  # values past the range are clipped to it
    assert torch.all(clipped.abs() <= steps[0] * 127 * 1.0001)


def _write_dialogues(path: Path, count: int) -> Path:
    lines = [json.dumps({"id": f"mine-{i}", "messages": [
        {"role": "user", "content": f"how far is the next charging station number {i}"},
        {"role": "assistant", "content": "the next charging station is twelve kilometers ahead on the right"}]})
        for i in range(count)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cabin_eval_evaluates_every_dialogue_of_a_file_the_user_brings(tiny_engine, calibrated, tmp_path):
    data = _write_dialogues(tmp_path / "mine.jsonl", 12)
    common = ["--model", str(tiny_engine.folder), "--data", str(data), "--kv-cache", "int8-shared",
              "--scales", str(calibrated(tiny_engine.folder) / "kv_scales.json"), "--max-tokens", "32"]

    def evaluated_ids(*extra: str) -> tuple[str, list[str]]:
        out = tmp_path / "-".join(("eval", *extra))
        assert cli_eval.main([*common, "--output", str(out), *extra]) == 0
        data_record = json.loads((out / "eval.json").read_text())["data"]
        return data_record["split"], data_record["ids"]

    split, ids = evaluated_ids()  # a file with --scales: every dialogue by default
    assert split == "all" and sorted(ids) == sorted(f"mine-{i}" for i in range(12))
    expected_held = sorted(i for i in ids if split_of(i) == "heldout")
    assert 0 < len(expected_held) < 12
    split, held = evaluated_ids("--split", "heldout", "--num-dialogues", str(len(expected_held)))
    assert split == "heldout" and sorted(held) == expected_held


def test_cabin_eval_split_default_is_in_help(capsys):
    with pytest.raises(SystemExit):
        cli_eval.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: heldout for builtin and sharegpt, all for a file you bring" in text
    args = cli_eval.parse_args(["--data", "builtin"])
    assert cli_eval.eval_split(args, "kv_scales.json") == "heldout"
    args = cli_eval.parse_args(["--data", "mine.jsonl"])
    assert cli_eval.eval_split(args, "kv_scales.json") == "all"
    assert cli_eval.eval_split(args, cli_eval.CALIBRATED_NOW + ": 16 train dialogues") == "heldout"


def test_accumulate_sorts_kl_and_agreement_into_position_buckets():
    torch.manual_seed(0)
    ref = torch.randn(1500, 7).log_softmax(-1)
    logits = ref.clone()
    logits[600:, :] = torch.randn(900, 7)  # only positions from 600 on disagree with the reference
    totals = Totals()
    accumulate(totals, ref, logits, torch.zeros(1500, dtype=torch.long))
    by_position = totals.by_position()
    assert list(by_position) == ["0-512", "512-1k", "1k-2k"]
    assert [b.tokens for b in by_position.values()] == [512, 512, 476]
    assert by_position["0-512"].kl == pytest.approx(0, abs=1e-6) and by_position["0-512"].top1_agree == 1
    assert by_position["1k-2k"].kl > 0.05 and by_position["1k-2k"].top1_agree < 0.8
    # 88 of the 512 positions in 512-1k still agree exactly, the rest as in 1k-2k
    expected = (88 * 0 + 424 * by_position["1k-2k"].kl) / 512
    assert by_position["512-1k"].kl == pytest.approx(expected, rel=0.25)
    weighted = sum(b.kl * b.tokens for b in by_position.values()) / 1500
    assert weighted == pytest.approx(totals.kl / totals.tokens)


def test_cabin_eval_reports_fidelity_by_position_on_stitched_sessions(tiny_engine, tmp_path, capsys):
    scales = tmp_path / "scales.json"
    assert cli_calibrate.main(["--model", str(tiny_engine.folder), "--num-dialogues", "2", "--max-tokens", "64",
                               "--mix", "none", "--method", "max", "--no-grade", "--output", str(scales)]) == 0
    out = tmp_path / "eval"
    code = cli_eval.main(["--model", str(tiny_engine.folder), "--data", "builtin", "--kv-cache", "int8-shared-eq",
                          "--scales", str(scales), "--num-dialogues", "1", "--max-tokens", "1000",
                          "--min-tokens", "1000", "--sessions", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "0-512 (512 tok)" in printed and "512-1k (487 tok)" in printed
    record = json.loads((out / "eval.json").read_text())
    session = record["data"]["ids"][0].split("+")
    assert len(session) > 2 and all(split_of(part) == "heldout" for part in session)
    by_position = record["modes"]["int8-shared-eq"]["by_position"]
    assert list(by_position) == ["0-512", "512-1k"] and by_position["512-1k"]["tokens"] == 487
    assert 0 <= by_position["512-1k"]["kl"] and 0 < by_position["0-512"]["top1_agree"] <= 1


def test_default_calibration_chooses_clips_by_kl_and_grades_itself(tiny_engine, tmp_path, capsys):
    """The default run: long cabin sessions reaching the context plus ShareGPT, clips chosen by validation KL,
    a grade on held-out sessions in the scales file and the report."""
    out, report = tmp_path / "kv_scales.json", tmp_path / "report"
    words = " ".join(["how far is the next charging station"] * 80)
    general = [{"id": f"chat{i}_{part}", "conversations": [{"from": "human", "value": words},
                                                           {"from": "gpt", "value": words}]}
               for i in range(12) for part in range(2)]
    (tmp_path / "general.json").write_text(json.dumps(general), encoding="utf-8")
    assert cli_calibrate.main(["--model", str(tiny_engine.folder), "--num-dialogues", "1", "--mix-dialogues", "2",
                               "--mix", str(tmp_path / "general.json"), "--output", str(out),
                               "--report", str(report)]) == 0
    err = capsys.readouterr().err
    config = tiny_engine.config
    loaded = load_scales_file(out, tiny_engine.fingerprint, config.num_hidden_layers)
    data = loaded.data
    context = config.max_position_embeddings
    assert data["sessions"] and data["tokens"] == context and data["positions"] == {"longest": context,
                                                                                   "context": context}
    assert data["mixed"]["dialogues"] == 2 and data["mixed"]["source"].endswith("general.json")
    assert all(split_of(part) == "train" for part in data["ids"][0].split("+"))
    searched = {c["rule"]: c["kl"] for c in data["clip_search"]}
    assert list(searched) == ["max", "mse"]
    chosen = loaded.method.removeprefix("kl:")
    assert chosen in searched and (chosen == "max" or searched["mse"] < searched["max"])  # wins only by less KL
    assert set(data["validation_ids"]).isdisjoint(data["ids"] + data["mixed"]["ids"])
    tokenizer = tiny_engine.tokenizer
    assert data["first_token"] == tokenizer.encode_prompt(tokenizer.render([{"role": "user", "content": "hi"}]))[0]
    assert set(data["grade"]) == {"fp32", "int8", "int8-eq", "int8-dynamic"}
    assert all(split_of(part) == "heldout" for part in data["grade_ids"][0].split("+"))
    assert 0 < data["grade"]["int8-eq"]["top1_agree"] <= 1 and "held-out grade int8-eq" in err
    assert "warning" not in err
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert f"token positions covered: 0 to {context} of the model's context of {context} (100%)" in summary
    assert f"| {chosen} (chosen) |" in summary and "| int8-dynamic |" in summary


def test_kl_search_sets_the_channel_clips_and_the_percentile_the_per_layer_scales(tiny_engine):
    """The search's chosen rule gives the channel clips equalization reads; the unequalized modes' one scale per
    layer comes from the --percentile clip."""
    result = calibrate(load_model(str(tiny_engine.folder)), CalibrationRequest(num_dialogues=1, mix="none",
                                                                                grade=False), progress=False)
    rule = next(r for r in CANDIDATES if result.scales_file.method == f"kl:{r.name}")
    searched, per_layer = rule.clips(result.stats), compute_clips(result.stats, "percentile", DEFAULT_PERCENTILE)
    assert torch.equal(result.clips.k_channel, searched.k_channel)
    assert torch.equal(result.clips.v_channel, searched.v_channel)
    assert (result.clips.k, result.clips.v) == (per_layer.k, per_layer.v)
    assert result.scales_file.scales.k == per_layer.scales().k


def test_calibration_on_short_sequences_warns(tiny_engine, tmp_path, capsys):
    out = tmp_path / "kv_scales.json"
    assert cli_calibrate.main(["--model", str(tiny_engine.folder), "--num-dialogues", "2", "--max-tokens", "64",
                               "--mix", "none", "--method", "max", "--no-grade", "--output", str(out)]) == 0
    assert "calibrated on sequences of at most 64 tokens, the model holds 1024" in capsys.readouterr().err
