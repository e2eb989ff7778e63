import torch


def pytest_configure(config):
    # Benchmarks time the kernels on every core the machine has, like a user would.
    torch.set_num_threads(torch.get_num_threads())
