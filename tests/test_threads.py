"""The thread policy of the reference engine: the count for the cores other processes leave idle, a spinning
process taking a core away under ``auto``, a fixed count and torch's own setting left alone, and the flag."""
import os
import subprocess
import sys
import time

import pytest
import torch

from cabinllm.cli.serve import parse_args
from cabinllm.runtime.model.threads import AUTO, READ_EVERY_S, CpuThreads, parse_threads, threads_for


def test_threads_for_the_idle_cores():
    assert threads_for(2, 0.05) == 2
    assert threads_for(2, 0.9) == 1  # one core busy
    assert threads_for(2, 1.5) == 1 and threads_for(2, 4.0) == 1  # never fewer than one
    assert threads_for(8, 2.0) == 6 and threads_for(8, 0.0) == 8


def test_parse_threads_and_the_flag(capsys):
    assert parse_threads("auto") == AUTO and parse_threads("3") == 3
    with pytest.raises(ValueError):
        parse_threads("0")
    assert parse_args(["--engine", "e"]).threads == AUTO
    assert parse_args(["--engine", "e", "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e", "--threads", "many"])
    assert "need auto or an integer >= 1, got 'many'" in capsys.readouterr().err


def test_a_fixed_count_and_no_policy_leave_torch_be():
    before = torch.get_num_threads()
    policy = CpuThreads()
    try:
        policy.before_step()
        assert torch.get_num_threads() == before  # no policy: torch's own setting
        policy.use(1)
        policy.before_step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="auto reads /proc/stat and needs two cores to give one away")
def test_auto_gives_a_busy_core_away_and_takes_it_back():
    before = torch.get_num_threads()
    policy = CpuThreads()
    cores = len(policy.cores)

    def settle(want) -> int:
        for _ in range(12):  # readings over windows of 2 x READ_EVERY_S, until the count is what we want
            time.sleep(READ_EVERY_S * 2)
            policy.before_step()
            if want(torch.get_num_threads()):
                break
        return torch.get_num_threads()

    spinners = []
    try:
        policy.use(AUTO)
        assert torch.get_num_threads() == cores
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
        assert settle(lambda threads: threads < cores) < cores
        spinners.pop().kill()
        assert settle(lambda threads: threads == cores) == cores  # the core is back
    finally:
        for spinner in spinners:
            spinner.kill()
        torch.set_num_threads(before)
