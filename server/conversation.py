"""From a conversation re-sent in full to the tokens to prefill: the chat template, then the overflow policy.

The whole conversation is rendered every request (the API is stateless); the cache finds its already
computed prefix by block hash. A conversation longer than one sequence can hold is cut by the server's
overflow policy (cabinllm.runtime.dialogue.overflow), the same policies a dialogue session uses.
"""
from __future__ import annotations

from cabinllm.runtime.dialogue.overflow import OverflowPolicy, Room, TurnPlan, plan_turn
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.model.tokenizer import ChatTokenizer


def plan_prompt(tokenizer: ChatTokenizer, messages: list[dict], max_new_tokens: int, capacity: int,
                tokens_per_block: int, policy: OverflowPolicy, sink_tokens: int) -> TurnPlan:
    """The tokens to prefill for ``messages`` (message content escaped by the template rendering).

    ``capacity`` is what one sequence may hold in tokens, its reply included; CapacityError when the
    policy cannot make the conversation fit (always under ``error`` once it does not fit).
    """
    room = Room(capacity, lambda n: cdiv(n, tokens_per_block) * tokens_per_block <= capacity, appends_turns=False)
    return plan_turn(tokenizer, messages, room, policy, sink_tokens, max_new_tokens)
