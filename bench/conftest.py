import os

import pytest
import torch


@pytest.fixture
def bench_threads():
    """Pins torch's CPU threads to POSS_BENCH_THREADS (default 1) for one benchmark.

    On a shared 2-core box, multi-threaded timings mostly measure waiting for a descheduled thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("POSS_BENCH_THREADS", "1")))
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """``--benchmark-json out/x.json`` writes into a folder that a fresh clone does not have: create it.
    (pytest-benchmark before 5 opens the file itself while parsing the options, and hands over the file.)"""
    path = config.getoption("benchmark_json", None)
    if isinstance(path, (str, os.PathLike)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
