"""The default 135M model with constraints on, over the 40 in-car commands of tests/data/vehicle_commands.jsonl:
every tool_choice="required" reply to a quarter of them is a valid call of a catalogue function, and every
json_schema reply to an eighth of them validates (all 40 of both: the tool_calls study, which also measures the
function picked, the model's doing, not asserted here)."""
from __future__ import annotations

from cabinllm.benchmarks.studies.tool_calls import COMMANDS, read_commands, run_replies, score
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.model.tools import read_tools


def test_every_constrained_reply_to_the_commands_is_valid(default_engine):
    tools, commands = read_tools(BUILTIN_TOOLS), read_commands(COMMANDS)
    assert len(commands) == 40 and {c["function"] for c in commands} == {t.name for t in tools}
    for mode, asked in (("tools", commands[::4]), ("json_schema", commands[1::8])):
        scored = score(default_engine, tools, asked, mode, run_replies(default_engine, tools, asked, mode, 128))
        assert [s.problem for s in scored if not s.valid] == [], mode
