"""The thread policy of the reference engine: the count for the cores other processes leave idle, a busy core given
away and taken back under ``auto`` (on faked CPU counters, so a busy test machine changes nothing), the reading's
window, a fixed count and torch's own setting left alone, and the flag."""
import os

import pytest
import torch

from cabinllm.cli.serve import parse_args
from cabinllm.runtime.model.threads import AUTO, READ_EVERY_S, CpuThreads, cpu_seconds, parse_threads, threads_for


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


class FakeCores:
    """A machine's CPU counters as ``auto`` reads them, moved by the test: this process busy on one core, and
    ``others`` cores' worth of other processes (a spinner, when 1)."""

    def __init__(self) -> None:
        self.now = self.busy_s = self.own_s = 0.0
        self.others = 0.0

    def pass_time(self, seconds: float) -> None:
        own = 1.0  # this process computes all the while: its time must not count as another's
        self.now += seconds
        self.own_s += own * seconds
        self.busy_s += (own + self.others) * seconds

    def read(self, cores: set[int]) -> tuple[float, float]:
        return self.busy_s, self.own_s


def test_auto_gives_a_busy_core_away_and_takes_it_back():
    before = torch.get_num_threads()
    machine = FakeCores()
    policy = CpuThreads(read=machine.read, clock=lambda: machine.now)
    policy.cores = [0, 1]  # two cores, whatever this machine has
    cores = len(policy.cores)

    def settle(want) -> int:
        for _ in range(12):  # readings over windows of 2 x READ_EVERY_S, until the count is what we want
            machine.pass_time(READ_EVERY_S * 2)
            policy.before_step()
            if want(torch.get_num_threads()):
                break
        return torch.get_num_threads()

    try:
        policy.use(AUTO)
        assert torch.get_num_threads() == cores
        assert settle(lambda threads: threads < cores) == cores  # quiet: this process's own work keeps both
        machine.others = 1.0  # a spinner takes a core
        assert settle(lambda threads: threads < cores) < cores
        machine.others = 0.0  # the spinner ends
        assert settle(lambda threads: threads == cores) == cores  # the core is back
    finally:
        torch.set_num_threads(before)


def test_auto_reads_no_sooner_than_every_read_every_s():
    before = torch.get_num_threads()
    machine = FakeCores()
    reads = []
    policy = CpuThreads(read=lambda cores: reads.append(cores) or machine.read(cores), clock=lambda: machine.now)
    policy.cores = [0, 1]
    try:
        policy.use(AUTO)
        policy.before_step()
        machine.pass_time(READ_EVERY_S / 2)
        policy.before_step()
        assert len(reads) == 1  # too soon: the window would hold too few clock ticks
        machine.pass_time(READ_EVERY_S / 2)
        policy.before_step()
        assert reads == [{0, 1}, {0, 1}]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the counters auto reads are Linux's /proc/stat")
def test_the_cores_cpu_seconds_come_from_proc_stat():
    cores = set(CpuThreads().cores)
    first = cpu_seconds(cores)
    sum(range(10**6))  # some CPU time of our own
    second = cpu_seconds(cores)
    assert first is not None and second is not None
    assert all(value >= 0 for value in first) and all(b >= a for a, b in zip(first, second))  # counters only grow
