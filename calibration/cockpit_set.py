"""The built-in cockpit dialogue set: hand-written threads strung into dialogues by a seeded script.

Each dialogue has a system prompt and 2 to 8 exchanges (4 to 16 turns) taken
from threads of different topics (a greeting first, a closing last), with slots
such as places, contacts, temperatures and times filled consistently within the
dialogue. Regenerate the shipped file with ``python -m calibration.cockpit_set``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from calibration import cockpit_blocks_en, cockpit_blocks_zh
from runtime.atomic import atomic_write_text

BLOCKS = {"en": cockpit_blocks_en, "zh": cockpit_blocks_zh}
DIALOGUES_PER_LANGUAGE = 100
MIN_EXCHANGES, MAX_EXCHANGES = 2, 8
SEED = 20240607
OUTPUT = Path(__file__).parent / "data" / "cockpit_dialogues.jsonl"


def _clock(minutes: int, lang: str) -> str:
    hours, mins = divmod(minutes % (24 * 60), 60)
    if lang == "zh":
        return f"{hours}:{mins:02d}"
    return f"{(hours - 1) % 12 + 1}:{mins:02d} {'am' if hours < 12 else 'pm'}"


def draw_slots(rng: random.Random, lang: str) -> dict[str, str]:
    """Slot values for one dialogue; numbers that depend on each other are drawn together."""
    slots = {name: rng.choice(values) for name, values in BLOCKS[lang].SLOTS.items() if name != "artist_song"}
    slots["artist"], slots["song"] = rng.choice(BLOCKS[lang].SLOTS["artist_song"])
    now = rng.randint(7 * 60, 21 * 60)
    dist = rng.randint(4, 60)
    eta = round(dist * rng.uniform(1.1, 1.6)) + 3
    temp = rng.randint(20, 24)
    fan = rng.randint(3, 6)
    battery = rng.randint(40, 90)
    range_km = battery * rng.randint(4, 5)
    round_trip = min(2 * dist, range_km - 30)
    slots.update({
        "dist": str(dist), "eta": str(eta), "kw": str(rng.choice([60, 120, 150, 250])),
        "detour": str(rng.randint(2, 8)), "arrive_battery": str(rng.randint(12, 35)),
        "charge_min": str(rng.randint(18, 35)), "exit": str(rng.randint(12, 48)), "delay": str(rng.randint(8, 25)),
        "arrival": _clock(now + eta, lang), "arrival_late": _clock(now + eta + rng.randint(5, 10), lang),
        "temp": str(temp), "temp_up": str(temp + 2), "temp_plus2": str(temp + 2), "temp_low": "18",
        "fan": str(fan), "fan_low": str(fan - 2), "leave_time": _clock(rng.randint(16 * 60, 19 * 60) // 15 * 15, lang),
        "aqi": str(rng.randint(18, 60)), "volume": str(rng.randint(12, 24)), "episode": str(rng.randint(100, 400)),
        "minute": str(rng.randint(5, 40)), "missed_time": _clock(now - rng.randint(20, 120), lang),
        "battery": str(battery), "range_km": str(range_km), "round_trip": str(round_trip),
        "spare": str(range_km - round_trip), "pressure": f"{rng.uniform(1.8, 2.1):.1f}",
        "service_km": str(rng.randint(8, 30) * 100), "service_weeks": str(rng.randint(2, 6)),
        "consumption": f"{rng.uniform(14.5, 18.9):.1f}", "week_km": str(rng.randint(150, 480)),
        "lock_time": _clock(rng.randint(20 * 60, 23 * 60), lang), "sw_version": f"2024.{rng.randint(8, 20)}.{rng.randint(1, 9)}",
        "speed": str(rng.choice([80, 90, 100, 110, 120])), "outside_temp": str(rng.randint(-3, 28)),
        "meeting_time": _clock(rng.randint(9 * 60, 11 * 60) // 30 * 30, lang),
        "drive_hours": str(rng.randint(2, 4)), "rest_km": str(rng.randint(5, 25)), "high": str(rng.randint(16, 31)),
    })
    return slots


def make_dialogue(rng: random.Random, lang: str) -> list[dict]:
    """One dialogue: a system prompt and threads of distinct topics, filled with one set of slots."""
    blocks = BLOCKS[lang]
    slots = draw_slots(rng, lang)
    target = rng.randint(MIN_EXCHANGES, MAX_EXCHANGES)
    topics = [t for t in blocks.THREADS if t not in ("greeting", "closing")]
    rng.shuffle(topics)
    if rng.random() < 0.25:
        topics.insert(0, "greeting")
    if rng.random() < 0.2:
        topics.append("closing")
    exchanges: list[tuple[str, str]] = []
    for topic in topics:
        room = target - len(exchanges)
        if topic == "closing" and len(exchanges) >= MIN_EXCHANGES:
            room = MAX_EXCHANGES - len(exchanges)
        if room <= 0:
            continue
        exchanges += rng.choice(blocks.THREADS[topic])[:room]
    messages = [{"role": "system", "content": rng.choice(blocks.SYSTEM_PROMPTS)}]
    for user, assistant in exchanges:
        messages.append({"role": "user", "content": user.format_map(slots)})
        messages.append({"role": "assistant", "content": assistant.format_map(slots)})
    return messages


def generate(seed: int = SEED) -> list[dict]:
    """All records of the set, ``{"id", "language", "messages"}``, distinct and reproducible."""
    rng = random.Random(seed)
    records, seen = [], set()
    for lang in BLOCKS:
        count = 0
        while count < DIALOGUES_PER_LANGUAGE:
            messages = make_dialogue(rng, lang)
            key = json.dumps(messages, ensure_ascii=False)
            if key in seen:
                continue
            seen.add(key)
            records.append({"id": f"cockpit-{lang}-{count:03d}", "language": lang, "messages": messages})
            count += 1
    return records


def render_jsonl(records: list[dict]) -> str:
    """The JSONL text of the records (UTF-8, one object per line)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main() -> None:
    """Write the shipped file."""
    atomic_write_text(OUTPUT, render_jsonl(generate()))
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
