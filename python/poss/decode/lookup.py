"""Prompt lookup in the draft tree: a chain of tokens copied from the request's own context.

Answers quote their prompts, and a small model's answers repeat themselves. The tokens that followed
the latest earlier occurrence of the context's last n tokens (n = 3, then 2, then 1) are a free guess
at what comes next (prompt lookup decoding; ``transformers``' ``prompt_lookup_num_tokens``). Here
the guess joins the drafted tree as a trie: it follows the tree's nodes while their tokens agree and
hangs its remainder below the last of them as a chain. Verification does not change, so the output
is still exactly the target's; a wrong guess costs only its rows in the verify forward.

Tried and not kept (AVX512-BF16 EPYC, one thread, 2026-12-04): the continuations of the 2 or 3 latest
distinct occurrences as one trie. With PosS-2's 4/1 tree and 4 tokens on 8 MT-Bench prompts, tau went
from 2.30 to 2.37-2.38, but the extra rows cost 0.6-1.2 ms a verify, so it ran no faster (three
alternating repeats).
"""

from array import array
from typing import List, Sequence

import torch

from poss.decode.draft_tree import Tree

MAX_NGRAM = 3


def continuation(context: Sequence[int], k: int, max_ngram: int = MAX_NGRAM) -> List[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``context``'s last n tokens,
    trying n = ``max_ngram`` down to 1; ``[]`` when none occurs earlier. ``context``: token ids < 2**32."""
    L = len(context)
    if k <= 0 or L < 2:
        return []
    buf = array("I", context).tobytes()  # 4 bytes per token: bytes.rfind searches in C
    for n in range(min(max_ngram, L - 1), 0, -1):
        pattern = buf[4 * (L - n):]
        end = 4 * (L - 1)  # the occurrence must end before the last token: a continuation exists
        while (at := buf.rfind(pattern, 0, end)) >= 0:
            if at % 4 == 0:
                start = at // 4 + n
                return list(context[start: start + k])
            end = at + len(pattern) - 1  # a match across token boundaries: look further left
    return []


def add_lookup(tree: Tree, contexts: Sequence[Sequence[int]], k: int) -> Tree:
    """``tree`` with each row's lookup chain (:func:`continuation` of ``contexts[b]``, up to ``k``
    tokens) merged in; ``contexts[b]`` ends with row b's root token.

    Every row gets the same number E of new nodes (ids N .. N+E-1, after the tree's): the longest
    remainder of a chain that the tree did not already hold. A row whose remainder is shorter pads
    with children of the root that repeat the root's token (proposals like any other: verification
    accepts one only where the target agrees). Returns ``tree`` itself when no row adds a node.
    The merge runs on the host: on a GPU, reading the tree back is one more sync per round.
    """
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    N = len(tokens[0])
    merged = []  # per row: (node the remainder hangs below, the remainder)
    for b, ctx in enumerate(contexts):
        chain = continuation(ctx, k)
        node, i = 0, 0
        while i < len(chain):
            child = next((c for c in range(node + 1, N) if parents[b][c] == node and tokens[b][c] == chain[i]), None)
            if child is None:
                break
            node, i = child, i + 1
        merged.append((node, chain[i:]))
    E = max(len(rest) for _, rest in merged)
    if E == 0:
        return tree
    new_tok, new_par, new_dep = [], [], []
    for b, (node, rest) in enumerate(merged):
        t, p, d = [], [], []
        for e in range(E):
            if e < len(rest):
                t.append(rest[e])
                p.append(node if e == 0 else N + e - 1)
                d.append(depth[b][node] + 1 + e)
            else:
                t.append(tokens[b][0])
                p.append(0)
                d.append(1)
        new_tok.append(t)
        new_par.append(p)
        new_dep.append(d)
    dev = tree.tokens.device

    def cat(old, new, dtype):
        return torch.cat([old, torch.tensor(new, dtype=dtype, device=dev)], 1)

    return Tree(cat(tree.tokens, new_tok, torch.int64), cat(tree.parents, new_par, torch.int32),
                cat(tree.depth, new_dep, torch.int32))
