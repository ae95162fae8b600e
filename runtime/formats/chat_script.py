"""Reading a scripted dialogue: JSONL with one ``{"role", "content"}`` message per line: an optional first system
line, then user lines and tool lines (a tool's result for the call the reply before it made; ``tool_call_id``
is optional). A user line may show pictures: ``"images": ["cam.png", ...]``, paths from the script's folder, and may be
spoken: ``"audio": "cmd.wav"`` (or a list of clips; its ``content``, optional then, follows what was heard). A
confirm line, ``{"role": "user", "confirm": true}`` (or false, no content), answers a front end that asks the user
to confirm a call before it is carried out."""
from __future__ import annotations

import json
from pathlib import Path

from cabinllm.runtime.errors import ScriptError


def text_problem(text: str) -> str | None:
    """Why a message cannot be encoded (a lone UTF-16 surrogate, as a JSON escape like "\\ud800" makes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"has a lone surrogate \\u{ord(text[err.start]):04x} at character {err.start + 1}, which is no "
                "character (an unpaired \\uXXXX escape, or a byte that is not UTF-8); write the character itself")
    return None


def read_script(path: str | Path) -> tuple[str | None, list[dict]]:
    """The optional system prompt (first line only) and the messages of a script file (user and tool)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ScriptError(f"{path}: cannot read ({err.strerror})") from err
    except UnicodeDecodeError as err:
        raise ScriptError(f"{path}: not valid UTF-8 at byte {err.start}; save the file as UTF-8") from err
    system, users = None, []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
            if isinstance(message, dict) and "confirm" in message and message.get("role") == "user":
                users.append(_confirm_line(message, f"{path}:{number}"))
                continue
            spoken = isinstance(message, dict) and "audio" in message  # its content is optional
            role, content = message["role"], message.get("content", "") if spoken else message["content"]
        except (ValueError, KeyError, TypeError) as err:
            raise ScriptError(f"{path}:{number}: expected {{\"role\": ..., \"content\": ...}} ({err})") from err
        if not isinstance(content, str):
            raise ScriptError(f"{path}:{number}: content must be a string")
        problem = text_problem(content)
        if problem:
            raise ScriptError(f"{path}:{number}: content {problem}")
        if role == "system" and system is None and not users:
            system = content
        elif role in ("user", "tool"):
            users.append({"role": role, "content": content, **({"tool_call_id": message["tool_call_id"]}
                                                               if "tool_call_id" in message else {})})
            images = message.get("images", [])
            if not (isinstance(images, list) and all(isinstance(i, str) and i for i in images)) or \
                    images and role != "user":
                raise ScriptError(f"{path}:{number}: images must be a list of picture paths, on user lines")
            if images:
                users[-1]["images"] = [str(path.parent / image) for image in images]
            audio = message.get("audio", [])
            audio = [audio] if isinstance(audio, str) else audio
            if not (isinstance(audio, list) and all(isinstance(a, str) and a for a in audio)) or \
                    audio and role != "user":
                raise ScriptError(f"{path}:{number}: audio must be a clip's path or a list of them, on user lines")
            if audio:
                users[-1]["audio"] = [str(path.parent / clip) for clip in audio]
        else:
            raise ScriptError(f"{path}:{number}: role {role!r} not allowed here; use one first 'system' line, then "
                              "'user' lines (and 'tool' lines with the results of calls)")
    if not users:
        raise ScriptError(f"{path}: no user turns")
    return system, users


def _confirm_line(message: dict, where: str) -> dict:
    """A confirm line as the script's message ``{"role": "user", "confirm": bool}``."""
    if not isinstance(message["confirm"], bool) or set(message) != {"role", "confirm"}:
        raise ScriptError(f"{where}: a confirm line is {{\"role\": \"user\", \"confirm\": true}} (or false), "
                          "nothing else")
    return {"role": "user", "confirm": message["confirm"]}
