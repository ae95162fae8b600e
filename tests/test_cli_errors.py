"""Bad values on every command line are one clear error line with exit code 2, never a traceback: numbers that are
0, negative, nan or inf, a KV budget larger than the machine's memory, a lone surrogate in a script, a full disk.
Interactively, a turn that fails is one line and the session is kept."""
import builtins
import errno
import io
import json
import sys

import pytest
import torch

import cabinllm.builders.engine_build
import cabinllm.cli.args
import cabinllm.cli.chat
import cabinllm.cli.eval
import cabinllm.cli.plan
import cabinllm.runtime.dialogue.session
import cabinllm.runtime.engine.loader
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.cli import build as build_cli
from cabinllm.cli import calibrate as cli_calibrate
from cabinllm.cli import eval as cli_eval
from cabinllm.cli import plan as plan_cli
from cabinllm.runtime.errors import CapacityError, ConfigError, Fix, Hint
from cabinllm.runtime.generation.sampling import SamplingParams, make_generator, sample
from cabinllm.server.app import SERVER_WORDS


def run_cli(main, argv, capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a CLI's ``main`` (argparse exits through SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error(code: int, err: str, *words: str) -> None:
    """Exit code 2 and one ``error:`` line that names each of ``words``, and no traceback."""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, err
    assert all(word in errors[0] for word in words), errors[0]
    assert "Traceback" not in err


@pytest.fixture
def script(tmp_path):
    """A one-turn dialogue script."""
    path = tmp_path / "dialogue.jsonl"
    path.write_text(json.dumps({"role": "user", "content": "navigate to the nearest charging station"}) + "\n")
    return path


class FullDisk(io.StringIO):
    """A redirected stdout on a full disk."""

    name = "/mnt/full/out.jsonl"

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


CHAT_FLAGS = [("--kv-budget-mb", "inf"), ("--kv-budget-mb", "nan"), ("--kv-budget-mb", "0"), ("--kv-budget-mb", "-8"),
              ("--tokens-per-block", "0"), ("--tokens-per-block", "-16"), ("--temperature", "nan"),
              ("--temperature", "inf"), ("--temperature", "-0.5"), ("--top-p", "nan"), ("--top-p", "0"),
              ("--top-p", "1.5"), ("--top-k", "-1"), ("--max-new-tokens", "0"), ("--max-new-tokens", "-3"),
              ("--seed", str(2**64))]


@pytest.mark.parametrize("flag,value", CHAT_FLAGS)
def test_chat_numbers_out_of_range_are_one_error_naming_the_flag(tiny_engine_dir, script, capsys, flag, value):
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script),
                                                   flag, value], capsys)
    assert_one_error(code, err, flag, repr(value))


def test_chat_budget_above_the_machines_memory_is_refused_before_allocating(tiny_engine_dir, script, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(cabinllm.cli.args, "available_memory", lambda: 8 << 30)
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script),
                                                   "--kv-budget-mb", "1e6"], capsys)
    assert_one_error(code, err, "--kv-budget-mb 1e+06", "8,192 MiB of memory this machine has available")


def test_chat_budget_below_one_byte_is_one_error(tiny_engine_dir, script, capsys):
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script),
                                                   "--kv-budget-mb", "1e-9"], capsys)
    assert_one_error(code, err, "--kv-budget-mb 1e-09 is less than one byte")


def test_chat_budget_check_reads_this_machines_memory():
    assert 0 < cabinllm.cli.args.available_memory() < 1 << 60


def test_lone_surrogate_in_a_script_is_refused_naming_the_line(tiny_engine_dir, tmp_path, capsys, monkeypatch):
    script = tmp_path / "dialogue.jsonl"
    script.write_text('{"role": "user", "content": "set cabin"}\n{"role": "user", "content": "jazz \\ud800"}\n')
    monkeypatch.setattr(cabinllm.runtime.engine.loader.Engine, "load", lambda path: pytest.fail("the engine was loaded"))
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script)], capsys)
    assert_one_error(code, err, f"{script}:2", "lone surrogate \\ud800 at character 6")


def test_lone_surrogate_in_the_system_prompt_is_refused(tiny_engine_dir, script, capsys):
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script),
                                                   "--system", "Be brief\udce9"], capsys)
    assert_one_error(code, err, "--system has a lone surrogate \\udce9 at character 9")


def test_chat_json_output_on_a_full_disk_is_one_error(tiny_engine_dir, script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", FullDisk())
    code, _, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--script", str(script),
                                                   "--json", "--max-new-tokens", "2"], capsys)
    assert_one_error(code, err, "/mnt/full/out.jsonl", "the disk is full")


def test_interactive_failures_keep_the_session(tiny_engine_dir, capsys, monkeypatch):
    real_generate, calls = EngineCore.generate, []

    def generate_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the kernel failed")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(EngineCore, "generate", generate_failing_once)
    typed = iter(["set cabin temperature", "/foo bar", "play \ud800 jazz", "/stats", "play some jazz", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    code, out, err = run_cli(cabinllm.cli.chat.main, ["--engine", str(tiny_engine_dir), "--max-new-tokens", "3"],
                             capsys)
    assert code == 0 and "Traceback" not in out + err
    assert "error: the kernel failed (the conversation is kept)" in out
    assert f"unknown command /foo; {cabinllm.cli.chat.HELP_COMMANDS}" in out
    assert "error: the message has a lone surrogate \\ud800" in out
    assert len(calls) == 2 and out.count("prefill") == 1  # neither /foo nor the surrogate went to the model


def test_build_on_a_full_disk_is_one_error_naming_the_file(tiny_engine_dir, tmp_path, capsys, monkeypatch):
    weights = tmp_path / "out" / "checkpoint" / "rank0.safetensors"

    def save_on_full_disk(folder, config, weights_):
        raise OSError(errno.ENOSPC, "No space left on device", str(weights))

    monkeypatch.setattr(cabinllm.builders.engine_build, "save_checkpoint", save_on_full_disk)
    code, _, err = run_cli(build_cli.main, ["--model", str(tiny_engine_dir.parent / "model"), "--dtype", "float32",
                                            "--output", str(tmp_path / "out")], capsys)
    assert_one_error(code, err, str(weights), "the disk is full")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e300"])
def test_reserve_out_of_range_is_one_error(tiny_engine_dir, tmp_path, capsys, value):
    model = str(tiny_engine_dir.parent / "model")
    code, _, err = run_cli(plan_cli.main, ["--model", model, "--target", "orin-nano-8gb", "--reserve-gb", value],
                           capsys)
    assert_one_error(code, err, "--reserve-gb", repr(value))
    code, _, err = run_cli(build_cli.main, ["--model", model, "--output", str(tmp_path / "out"),
                                            "--reserve-gb", value], capsys)
    assert_one_error(code, err, "--reserve-gb", repr(value))


def test_plan_json_on_a_full_disk_is_one_error(tiny_engine_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", FullDisk())
    code, _, err = run_cli(plan_cli.main, ["--model", str(tiny_engine_dir.parent / "model"),
                                           "--target", "orin-nano-8gb", "--json"], capsys)
    assert_one_error(code, err, "/mnt/full/out.jsonl", "the disk is full")


CALIBRATE_FLAGS = [("--num-dialogues", "0"), ("--num-dialogues", "-1"), ("--max-tokens", "0"), ("--max-tokens", "-5"),
                   ("--min-tokens", "-1"), ("--percentile", "nan"), ("--percentile", "0"), ("--percentile", "inf"),
                   ("--percentile", "100.5")]


@pytest.mark.parametrize("flag,value", CALIBRATE_FLAGS)
def test_calibrate_numbers_out_of_range_are_one_error(tiny_engine_dir, tmp_path, capsys, flag, value):
    code, _, err = run_cli(cli_calibrate.main, ["--model", str(tiny_engine_dir), "--method", "percentile",
                                                "--output", str(tmp_path / "k.json"), flag, value], capsys)
    assert_one_error(code, err, flag, repr(value))


@pytest.mark.parametrize("flag,value", [("--num-dialogues", "0"), ("--max-tokens", "-1"), ("--min-tokens", "-2"),
                                        ("--calib-dialogues", "0"), ("--num-dialogues", "nan")])
def test_eval_numbers_out_of_range_are_one_error(tiny_engine_dir, tmp_path, capsys, flag, value):
    code, _, err = run_cli(cli_eval.main, ["--model", str(tiny_engine_dir), "--output", str(tmp_path / "eval"),
                                           flag, value], capsys)
    assert_one_error(code, err, flag, repr(value))


def test_eval_results_on_a_full_disk_are_one_error(tiny_engine_dir, tmp_path, capsys, monkeypatch):
    def write_on_full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cabinllm.cli.eval, "atomic_write_text", write_on_full_disk)
    code, _, err = run_cli(cli_eval.main, ["--model", str(tiny_engine_dir), "--output", str(tmp_path / "eval"),
                                           "--kv-cache", "fp16", "--num-dialogues", "1", "--max-tokens", "16"], capsys)
    assert_one_error(code, err, str(tmp_path / "eval"), "the disk is full")


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -1.0), ("top_p", float("nan")), ("top_p", 0.0),
                                         ("top_k", -1), ("max_new_tokens", 0), ("seed", 2**64),
                                         ("temperature", "hot")])
def test_sampling_params_refuse_values_that_fail_mid_turn(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-9])
def test_a_top_p_that_rounds_to_zero_still_samples_the_most_likely_token(top_p):
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert sample(logits, params, make_generator(0)) == 1


def test_sampling_params_cut_text_at_the_earliest_stop_string():
    params = SamplingParams(stop_strings=["END", "\n\n"])
    assert params.stops("one\n\ntwo END") and not params.stops("one END-less".replace("END", "E-N-D"))
    assert params.cut_at_stop("one\n\ntwo END") == "one" and params.cut_at_stop("a END b\n\nc") == "a "
    assert params.cut_at_stop("no stop here") == "no stop here"
    assert SamplingParams().cut_at_stop("END") == "END" and not SamplingParams().stops("END")


@pytest.mark.parametrize("debug", [False, True])
def test_a_bug_is_one_line_asking_for_a_report_not_a_user_error(tiny_engine_dir, capsys, monkeypatch, debug):
    def broken(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cabinllm.cli.plan, "load_model_config", broken)
    if debug:
        monkeypatch.setenv(cabinllm.cli.args.DEBUG_ENV, "1")
    else:
        monkeypatch.delenv(cabinllm.cli.args.DEBUG_ENV, raising=False)
    code, _, err = run_cli(plan_cli.main, ["--model", str(tiny_engine_dir), "--target", "orin-nano-8gb"], capsys)
    lines = [line for line in err.splitlines() if "internal error" in line]
    assert code == cabinllm.cli.args.BUG_EXIT and len(lines) == 1 and "error: " not in err.replace("internal error", "")
    assert "TypeError: unsupported operand" in lines[0] and "report" in lines[0]
    assert ("Traceback" in err) == debug


def test_every_fix_is_in_the_library_s_words_and_the_command_line_words_each():
    for fix in Fix:
        assert "--" not in fix.value and "/reset" not in fix.value, fix
        assert fix in cabinllm.cli.args.CLI_WORDS, fix


def test_an_error_s_hints_are_worded_by_each_front_end():
    refused = CapacityError("the turn does not fit", (Hint(Fix.NEW_CONVERSATION), Hint(Fix.RAISE_KV_BUDGET)))
    assert str(refused) == ("the turn does not fit; start a new conversation (DialogueSession.reset) or raise "
                            "KvCacheConfig.max_bytes")
    assert cabinllm.cli.args.cli_message(refused) == ("the turn does not fit; start a new conversation (/reset) or "
                                                      "raise --kv-budget-mb")
    assert refused.words(SERVER_WORDS) == ("the turn does not fit; start a new conversation or ask the server's "
                                           "operator to raise --kv-budget-mb")
    placed = ConfigError("saving needs another backend ({})", (Hint(Fix.BACKEND_NAME, "reference"),))
    assert cabinllm.cli.args.cli_message(placed) == "saving needs another backend (--backend reference)"
    assert str(ConfigError("plain")) == "plain" and ConfigError("plain").hints == ()
