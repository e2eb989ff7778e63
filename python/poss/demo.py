"""A small, readable tour of torch.ops.poss.tree_verify: one draft tree, verified greedily and by sampling."""

import time

import torch

import poss_ext
from poss_ext import reference


def build_demo_case(V: int = 49152, seed: int = 0):
    """A 7-node draft tree whose left branch agrees with the target for two levels.

        root(0) ─┬─ 1 ─┬─ 3 ── 5
                 │     └─ 4
                 └─ 2 ── 6
    """
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2]], dtype=torch.int32)
    tokens = torch.randint(0, V, (1, 7), generator=gen)
    logits = torch.randn(1, 7, V, generator=gen)
    logits[0, 0, tokens[0, 1]] = 9.0  # the target's favourite after the root is node 1's token
    logits[0, 1, tokens[0, 3]] = 9.0  # ... and after node 1, node 3's token
    return parents, tokens, logits


def main() -> int:
    info = poss_ext.build_info()
    print(f"poss_ext built against torch {info['torch_version']}, CUDA kernels: {info['cuda']}")
    parents, tokens, logits = build_demo_case()
    nodes, length, nxt = poss_ext.tree_verify(parents, tokens, logits)
    path = [int(n) for n in nodes[0] if n >= 0]
    print(f"greedy: accepted nodes {path} -> {int(length[0])} draft tokens + next token {int(nxt[0])}")

    gen = torch.Generator().manual_seed(1)
    uniforms = torch.rand(1, 8, generator=gen)
    temperature, top_k, top_p = torch.tensor([0.7]), torch.tensor([50], dtype=torch.int32), torch.tensor([0.9])
    nodes, length, nxt = poss_ext.tree_verify(parents, tokens, logits, temperature, top_k, top_p, uniforms)
    path = [int(n) for n in nodes[0] if n >= 0]
    print(f"sampling (T=0.7, top-k 50, top-p 0.9): accepted nodes {path}, next token {int(nxt[0])}")

    B = 64
    batch = [t.expand(B, *t.shape[1:]).contiguous() for t in (parents, tokens, logits)]
    for name, fn in (("kernel", poss_ext.tree_verify), ("reference", reference.tree_verify)):
        start = time.perf_counter()
        fn(*batch)
        print(f"greedy verify of {B} trees, {name}: {(time.perf_counter() - start) * 1e3:.2f} ms")
    return 0
