"""Two CPU processes under torchrun (gloo): gradients are averaged over ranks and weights stay identical."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.child_env import child_env
from helpers.train_tiny import make_trainer

TRAIN_TINY = Path(__file__).resolve().parents[1] / "helpers" / "train_tiny.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~40 s: two torchrun processes
def test_two_process_gradients_are_averaged(tmp_path):
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(TRAIN_TINY), str(tmp_path), "--grad-dump"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["idx"] != r1["idx"]  # each rank trained on its own shard
    # Independent check: recompute each rank's local gradients in this process and average them.
    tr = make_trainer(tmp_path / "single", noise=0.0)
    expected = {}
    for dump in (r0, r1):
        tr.opt.zero_grad(set_to_none=True)
        tr.compute_gradients(dump["idx"], noise=False)
        for n, p in tr.draft.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(dump["local"][n], g, rtol=1e-5, atol=1e-7)
            expected[n] = expected.get(n, 0) + g / 2
    for n in expected:
        torch.testing.assert_close(r0["avg"][n], expected[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r1["avg"][n], r0["avg"][n], rtol=0, atol=0)
        assert not torch.equal(r0["local"][n], r1["local"][n]) or r0["local"][n].abs().sum() == 0
    for n in r0["weights"]:
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
