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
