"""torch.ops.poss.tree_verify on a hand-made tree (docs/ops.md § Ops: `torch.ops.poss.*`).

    python examples/tree_verify.py

Tree (node 0 = root, the last committed token): 0 -> 1 -> 3, 0 -> 2; node 4 is padding.
"""

import torch

import poss_ext  # noqa: F401  (registers torch.ops.poss)

V = 8
parents = torch.tensor([[-1, 0, 0, 1, -2]], dtype=torch.int32)  # [B, N]
tokens = torch.tensor([[5, 3, 4, 6, 0]])                          # [B, N], tokens[b, 0] = root token
logits = torch.full((1, 5, V), -10.0)                             # [B, N, V]: the target at each node
logits[0, 0, 3] = 10.0  # after the root the target wants token 3: node 1 matches
logits[0, 1, 6] = 10.0  # after node 1 it wants 6: node 3 matches
logits[0, 3, 2] = 10.0  # after node 3 it wants 2: the bonus token
greedy = torch.zeros(1)                                           # temperature 0 => greedy

accept_nodes, accept_len, next_token = torch.ops.poss.tree_verify(
    parents, tokens, logits, greedy, None, None, None)
print("accepted nodes:", accept_nodes[0].tolist(), "accepted:", int(accept_len[0]), "bonus:", int(next_token[0]))
assert accept_nodes[0, :3].tolist() == [0, 1, 3] and int(next_token[0]) == 2
