"""The stop rules every token loop shares (runtime.generation.stops.ReplyStream): a stop id, a stop string, the
length, a loop's own reason; the pieces handed out never hold half a character or text a stop string cuts away,
and together they are the reply's text."""
import pytest

from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.stops import ReplyStream

STOP_ID = 0


def utf8(ids: list[int]) -> str:
    """Byte-level tokens: an incomplete character decodes to U+FFFD, as a BPE tokenizer's does."""
    return bytes(ids).decode("utf-8", errors="replace")


def play(text: str, **params) -> tuple[ReplyStream, list[str]]:
    """Push the UTF-8 bytes of ``text`` (then a stop id) until the reply ends; the stream and its pieces."""
    reply = ReplyStream(SamplingParams(stop_token_ids=[STOP_ID], **params), utf8)
    pieces = []
    for token in list(text.encode("utf-8")) + [STOP_ID]:
        pieces.append(reply.push(token))
        if reply.finish_reason:
            break
    pieces.append(reply.close("interrupted"))
    return reply, pieces


def test_a_stop_id_ends_the_reply_and_stays_out_of_its_text():
    reply, pieces = play("turn left")
    assert reply.finish_reason == "stop" and reply.ids[-1] == STOP_ID and reply.text == "turn left"
    assert "".join(pieces) == "turn left"


def test_a_stop_string_cuts_the_text_and_no_piece_shows_what_it_cuts():
    reply, pieces = play("open the window. Then", stop_strings=["window."])
    assert reply.finish_reason == "stop" and reply.text == "open the "
    assert "".join(pieces) == "open the " and not any("w" in piece for piece in pieces)


def test_text_a_stop_string_might_start_is_held_back_until_it_cannot():
    reply, pieces = play("a windy road", stop_strings=["window."])
    assert reply.finish_reason == "stop"  # at the stop id: the stop string never came
    assert "".join(pieces) == "a windy road" and pieces[-1] != ""  # the held-back tail came out at the end


def test_the_length_rule_counts_every_token():
    reply, pieces = play("abcdefgh", max_new_tokens=3)
    assert reply.finish_reason == "length" and len(reply.ids) == 3 and "".join(pieces) == reply.text == "abc"


def test_no_piece_holds_half_a_character():
    reply, pieces = play("21 °C, Straße")
    assert "".join(pieces) == "21 °C, Straße" and not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("reason", ["interrupted", "capacity", "cancelled"])
def test_a_loops_own_reason_ends_a_reply_no_rule_ended(reason):
    reply = ReplyStream(SamplingParams(stop_strings=["."]), utf8)
    shown = [reply.push(token) for token in b"go on"]
    assert reply.finish_reason is None
    assert "".join(shown) + reply.close(reason) == "go on" and reply.finish_reason == reason


def test_a_rule_that_ended_the_reply_wins_over_the_loops_reason():
    reply, _ = play("abc", max_new_tokens=2)
    assert reply.close("cancelled") == "" and reply.finish_reason == "length"


def test_on_text_receives_the_pieces_it_returns():
    seen = []
    reply = ReplyStream(SamplingParams(stop_strings=["!"]), utf8, on_text=seen.append)
    returned = [reply.push(token) for token in b"hi there!"] + [reply.close()]
    assert seen == [piece for piece in returned if piece] and "".join(seen) == "hi there"
