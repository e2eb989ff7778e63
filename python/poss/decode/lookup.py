"""Prompt lookup in the draft tree: a chain of tokens copied from the request's own context.

Answers quote their prompts, and a small model's answers repeat themselves. The tokens that followed
the latest earlier occurrence of the context's last n tokens (n = 3, then 2, then 1) are a free guess
at what comes next (prompt lookup decoding; ``transformers``' ``prompt_lookup_num_tokens``). Here
the guess joins the drafted tree as a trie: it follows the tree's nodes while their tokens agree and
hangs its remainder below the last of them as a chain. Verification does not change, so the output
is still exactly the target's; a wrong guess costs only its rows in the verify forward.

The rows a chain leaves unused go to the draft's next-best first-level tokens (:attr:`Tree.spare`):
on a CPU a verify of 8 rows costs little more than one of 4-6, and the chain often stops short (no
match, or one the tree already holds). On 16 MT-Bench prompts x 256 tokens, PosS-2's 3/1 tree with
5 tokens, filled (8 rows every round), had tau 2.49 and ran 2.02-2.05x our AR loop; unfilled, 3/1+6
had tau 2.44 and ran 1.97-1.99x, 4/1+5 tau 2.44 and 1.92-1.93x (three alternating repeats in one
process while the fill could still be switched off, AVX512-BF16 EPYC, one thread; the filled trees'
sweep is in docs/benchmarks.md). Filled to 9 rows, 3/1+6 lost: its verify cost 0.9 ms more.

Tried and not kept (AVX512-BF16 EPYC, one thread, 2026-12-04): the continuations of the 2 or 3 latest
distinct occurrences as one trie. With PosS-2's 4/1 tree and 4 tokens on 8 MT-Bench prompts, tau went
from 2.30 to 2.37-2.38, but the extra rows cost 0.6-1.2 ms a verify, so it ran no faster (three
alternating repeats).

Where the context holds no match, a :class:`~poss.decode.datastore.Datastore` of the target's own
answers to other prompts can supply the chain instead (:mod:`poss.decode.datastore`).
"""

from array import array
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from poss.decode.draft_tree import Tree
from poss_ext.limits import PAD

if TYPE_CHECKING:
    from poss.decode.datastore import Datastore

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


def add_lookup(tree: Tree, contexts: Sequence[Sequence[int]], k: int, datastore: Optional["Datastore"] = None) -> Tree:
    """``tree`` with each row's lookup chain (:func:`continuation` of ``contexts[b]``, up to ``k``
    tokens; where the context holds none, ``datastore``'s :meth:`~poss.decode.datastore.Datastore.continuation`)
    merged in; ``contexts[b]`` ends with row b's root token.

    Every row gets the same number E of new nodes, right after its real nodes (ids n_b .. n_b+E-1,
    where row b holds n_b real nodes; its padding moves behind them, as the tree encoding requires): the longest
    remainder of a chain that the tree did not already hold, or ``k`` when the tree carries spare
    tokens (:attr:`Tree.spare`). A row whose remainder is shorter fills the rows left with its spare
    tokens as children of the root, best first, then with children of the root that repeat the root's
    token (proposals like any other: verification accepts one only where the target agrees). Returns
    ``tree`` itself when no row adds a node. The merge runs on the host: on a GPU, reading the tree
    back is one more sync per round.
    """
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    spare = tree.spare.tolist() if tree.spare is not None else [[] for _ in tokens]
    N = len(tokens[0])
    real = [next((i for i in range(N) if parents[b][i] == PAD), N) for b in range(len(tokens))]
    merged = []  # per row: (node the remainder hangs below, the remainder)
    for b, ctx in enumerate(contexts):
        chain = continuation(ctx, k)
        if not chain and datastore is not None:
            chain = datastore.continuation(ctx, k)
        node, i = 0, 0
        while i < len(chain):
            child = next((c for c in range(node + 1, N) if parents[b][c] == node and tokens[b][c] == chain[i]), None)
            if child is None:
                break
            node, i = child, i + 1
        merged.append((node, chain[i:]))
    E = k if tree.spare is not None else max(len(rest) for _, rest in merged)
    if E == 0:
        return tree
    new_tok, new_par, new_dep = [], [], []
    for b, (node, rest) in enumerate(merged):
        n = real[b]
        # the remainder hangs below `node` as a chain (its e-th node's parent is n + e - 1)
        p = [node if e == 0 else n + e - 1 for e in range(len(rest))]
        d = [depth[b][node] + 1 + e for e in range(len(rest))]
        # then root children: spare tokens (one equal to a chain's first node would be its twin), repeats
        fill = [x for x in spare[b] if not (node == 0 and rest and x == rest[0])][:E - len(rest)]
        fill += [tokens[b][0]] * (E - len(rest) - len(fill))
        # the row's padding (a tree narrower than num_nodes) stays last
        new_tok.append(tokens[b][:n] + list(rest) + fill + tokens[b][n:])
        new_par.append(parents[b][:n] + p + [0] * len(fill) + parents[b][n:])
        new_dep.append(depth[b][:n] + d + [1] * len(fill) + depth[b][n:])
    dev = tree.tokens.device
    return Tree(torch.tensor(new_tok, dtype=torch.int64, device=dev),
                torch.tensor(new_par, dtype=torch.int32, device=dev),
                torch.tensor(new_dep, dtype=torch.int32, device=dev))
