"""Step 1 of a round: draft an EAGLE-2 dynamic tree with the position specialists (PosS §3.3).

Draft position p (1-based depth below the root) is drafted by specialist ``min((p-1)//ppl, N-1)``.
Each specialist keeps its own KV cache over the verified context. The first time a specialist runs
in a round it catches up in ONE forward over a small tree:

    [new verified pairs (target features)] [fillers] [level 1 (K)] ... [level p-1 (K)]

The verified pairs form a chain at their committed slots; the tree levels hang below the last
pair, each node below its beam parent, so every node attends to exactly its context and ancestors.
Requests verified different numbers of tokens last round; shorter chains are padded with
"fillers" (copies of their last pair continuing the chain) so that the whole batch shares one
shape: fillers are leaves, nobody attends to them, and their slots lie past the committed length.
Later positions of the same specialist query only the newest level (``Nq = K``).

Candidates follow EAGLE-2: the root's top-K, then per level the top-K children of each of the K
frontier nodes scored by cumulative log-prob; the global top-K of those K*K become the next
frontier. ``poss::build_tree`` keeps the best ``num_nodes - 1`` candidates.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

import poss_ext
from poss.forward import draft_log_probs, specialist_step


@dataclass
class Tree:
    """The tree verified this round (shared encoding of ``poss_ext.ops``), node 0 = the root ``x_L``."""

    tokens: Tensor  # [B, N] int64
    parents: Tensor  # [B, N] int32
    depth: Tensor  # [B, N] int32


def root_only_tree(root: Tensor) -> Tree:
    """The empty draft: verifying it is one autoregressive step (``root [B] int64``)."""
    B = root.shape[0]
    return Tree(root.view(B, 1), torch.full((B, 1), -1, dtype=torch.int32, device=root.device),
                torch.zeros(B, 1, dtype=torch.int32, device=root.device))


@torch.inference_mode()
def draft_tree(draft, seq, depth: int, top_k: int, num_nodes: int) -> Tree:
    """Draft ``depth`` positions for every row of ``seq`` and assemble the top ``num_nodes`` tree.

    Advances every used specialist's committed length to the target's (``seq.draft_len``).
    """
    B, K, dev = seq.batch, top_k, seq.ids.device
    H = seq.feats.shape[-1]
    # -- the newly verified pairs (x_{t+1}, f_t), t in [draft_len, L), as a padded chain
    T = max(L - d for L, d in zip(seq.length, seq.draft_len))
    last = (seq.length_dev - seq.draft_len_dev - 1).long()  # chain node of each row's last real pair
    t = seq.draft_len_dev.long().unsqueeze(1) + torch.minimum(torch.arange(T, device=dev).unsqueeze(0),
                                                              last.unsqueeze(1))
    chain = (seq.ids.gather(1, t + 1), seq.feats.gather(1, t.unsqueeze(-1).expand(B, T, H)), t,
             (torch.arange(T, dtype=torch.int32, device=dev) - 1).expand(B, T))
    prefix = seq.draft_len_dev
    levels = [chain]  # (tokens, features, positions, parents) per block of the round's draft tree

    def forward(j: int, catch_up: bool) -> Tensor:
        parents = torch.cat([lv[3] for lv in levels], 1).contiguous()
        blocks = levels if catch_up else levels[-1:]
        tok, feat, pos = (torch.cat([lv[i] for lv in blocks], 1).contiguous() for i in range(3))
        return specialist_step(draft, j, tok, feat, pos, parents, prefix)

    # -- position 1: specialist 0 on the chain; the last real pair predicts the root's children
    out = forward(draft.specialist_for(1), catch_up=True)
    ran = {draft.specialist_for(1)}
    root_out = out.gather(1, last.view(B, 1, 1).expand(B, 1, H))
    score, token = draft_log_probs(draft, root_out).topk(K, dim=-1)  # [B, 1, K]
    score, token = score.view(B, K), draft.full_ids(token.view(B, K))
    cand_tokens, cand_scores = [token], [score]
    cand_parents = [torch.full((B, K), -1, dtype=torch.int32, device=dev)]
    frontier_idx = torch.arange(K, device=dev).expand(B, K)  # candidate index of each frontier node
    frontier_feat = root_out.expand(B, K, H)
    frontier_parent = last.view(B, 1).expand(B, K)  # draft-tree node of each frontier node's parent

    # -- positions 2..depth: forward the frontier (level p-1), expand it to level p
    for p in range(2, depth + 1):
        position = seq.length_dev.long().unsqueeze(1) + (p - 2)  # level p-1 holds x_{L+p-1}, input position L+p-2
        levels.append((token, frontier_feat, position.expand(B, K), frontier_parent.to(torch.int32)))
        j = draft.specialist_for(p)
        out = forward(j, catch_up=j not in ran)[:, -K:]
        ran.add(j)
        child_score, child_token = draft_log_probs(draft, out).topk(K, dim=-1)  # [B, K, K]
        cum = (child_score + score.unsqueeze(-1)).flatten(1)
        child_token = draft.full_ids(child_token.flatten(1))
        cand_tokens.append(child_token)
        cand_scores.append(cum)
        cand_parents.append(frontier_idx.to(torch.int32).repeat_interleave(K, dim=1))
        if p < depth:
            score, sel = cum.topk(K, dim=-1)
            src = sel // K
            token = child_token.gather(1, sel)
            frontier_idx = sum(c.shape[1] for c in cand_tokens[:-1]) + sel
            frontier_feat = out.gather(1, src.unsqueeze(-1).expand(B, K, H))
            frontier_parent = (T + K * (p - 2)) + src

    seq.draft_len = list(seq.length)
    seq.draft_len_dev.copy_(seq.length_dev)
    tokens, parents, tree_depth = poss_ext.ops.build_tree(
        torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1).contiguous(),
        seq.root_tokens(), num_nodes)
    return Tree(tokens, parents, tree_depth)
