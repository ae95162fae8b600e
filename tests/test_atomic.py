"""Atomic writes under a kill: the target always holds the old or the new content, and the next run of a
writer removes what a killed one left and puts back an engine folder a killed replace had moved aside."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import pytest

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.atomic import atomic_write_text, clean_leftovers, staging_folder

from fakes.tiny_model import write_tiny_llama

OLD = {"a.txt": "old", "sub/b.txt": "old"}
NEW = {"a.txt": "new", "sub/b.txt": "new"}
REPLACE_STEPS = ["replace", "replace", "rmtree"]  # move the old folder aside, rename the new one in, delete the old


class Killed(BaseException):
    """The process died: this and every later file operation fail."""


@pytest.fixture
def dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def kill(monkeypatch, dead_pid: int, when: Callable[[int, str, tuple], bool]) -> list[str]:
    """Run as the process ``dead_pid`` that dies at the first os.replace/Path.unlink/shutil.rmtree call for which
    ``when(index, name, args)`` holds; returns the names of the calls made."""
    calls: list[str] = []
    real = {"replace": os.replace, "unlink": Path.unlink, "rmtree": shutil.rmtree}

    def operation(name: str):
        def run(*args, **kwargs):
            if "killed" in calls or when(len(calls), name, args):
                calls.append("killed")
                raise Killed(name)
            calls.append(name)
            return real[name](*args, **kwargs)
        return run

    for module, name in ((os, "replace"), (Path, "unlink"), (shutil, "rmtree")):
        monkeypatch.setattr(module, name, operation(name))
    monkeypatch.setattr(os, "getpid", lambda: dead_pid)
    return calls


def write_tree(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def tree(folder: Path) -> dict[str, str] | None:
    """The files of a folder and their text; None when there is no folder."""
    if not folder.is_dir():
        return None
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("step", range(len(REPLACE_STEPS) + 1))
def test_a_kill_at_each_step_of_a_folder_replace_leaves_the_old_or_the_new_folder(tmp_path, monkeypatch, dead_pid,
                                                                                step):
    target = tmp_path / "engine"
    write_tree(target, OLD)
    calls = kill(monkeypatch, dead_pid, lambda index, name, args: index == step)
    with pytest.raises(Killed) if step < len(REPLACE_STEPS) else nullcontext():
        with staging_folder(target) as tmp:
            write_tree(tmp, NEW)
    monkeypatch.undo()
    assert [c for c in calls if c != "killed"] == REPLACE_STEPS[:step]
    if REPLACE_STEPS[:step] == ["replace"]:  # killed between the two renames: the old folder waits aside, whole
        assert tree(target) is None and [tree(p) for p in tmp_path.glob(".engine.*.old")] == [OLD]
    else:
        assert tree(target) == (OLD if step == 0 else NEW)
    clean_leftovers(target)  # what the next run does first
    assert tree(target) == (OLD if step < 2 else NEW)
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_a_failed_rename_in_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "engine"
    write_tree(target, OLD)
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        with staging_folder(target) as tmp:
            write_tree(tmp, NEW)
    assert tree(target) == OLD and [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_a_killed_write_leaves_the_old_file_and_the_next_write_removes_its_temporary_file(tmp_path, monkeypatch,
                                                                                        dead_pid):
    target = tmp_path / "s.cabin"
    atomic_write_text(target, "first save")
    kill(monkeypatch, dead_pid, lambda index, name, args: name == "replace")
    with pytest.raises(Killed):
        atomic_write_text(target, "second save")
    monkeypatch.undo()
    assert target.read_text() == "first save"
    assert [p.name for p in tmp_path.glob(f".s.cabin.{dead_pid}.*.tmp")] != []
    atomic_write_text(target, "third save")
    assert target.read_text() == "third save" and [p.name for p in tmp_path.iterdir()] == ["s.cabin"]


def test_only_leftovers_of_this_target_whose_writer_is_gone_are_removed(tmp_path, dead_pid):
    stale = [f".s.cabin.{dead_pid}.abcd1234.tmp", ".s.cabin.k2j4h5g6.tmp"]  # a dead writer; one from before pids
    kept = [f".s.cabin.{os.getpid()}.abcd1234.tmp",  # a writer still running (this process)
            f".s.cabinet.{dead_pid}.abcd1234.tmp", f".other.{dead_pid}.abcd1234.tmp", "s.cabin.bak", ".s.cabin.notes"]
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    (tmp_path / f".s.cabin.{dead_pid}.abcd1234.partial").mkdir()
    atomic_write_text(tmp_path / "s.cabin", "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["s.cabin"])


def test_a_force_build_killed_between_its_renames_is_repaired_by_the_next_build(tmp_path, monkeypatch, dead_pid):
    request = BuildRequest(str(write_tiny_llama(tmp_path / "model")), tmp_path / "engines" / "tiny", "int8")
    build_engine(request, log=lambda _msg: None)
    old = snapshot(request.output)
    kill(monkeypatch, dead_pid, lambda index, name, args: name == "replace" and str(args[0]).endswith(".partial"))
    with pytest.raises(Killed):
        build_engine(dataclasses.replace(request, force=True), log=lambda _msg: None)
    monkeypatch.undo()
    assert not request.output.exists() and len(list(request.output.parent.iterdir())) == 2  # .old and .partial
    said: list[str] = []
    build_engine(request, log=said.append)  # the next run, no --force
    assert "is up to date" in said[0] and snapshot(request.output) == old
    assert [p.name for p in request.output.parent.iterdir()] == ["tiny"]
    assert Engine.load(request.output).fingerprint
