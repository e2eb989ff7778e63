"""Step 1 of a round: draft an EAGLE-2 dynamic tree with the position specialists (PosS §3.3).

Draft position p (1-based depth below the root) is drafted by specialist ``min((p-1)//n, N-1)``
(n positions per specialist, N specialists). Each specialist keeps its own KV cache over the verified
context: :func:`warm_up` fills it with the prompt after the prefill, and from then on, the first time
a specialist runs in a round it catches up in ONE forward over a small tree:

    [new verified pairs (target features)] [fillers] [level 1 (K)] ... [level p-1 (K)]

The verified pairs form a chain at their committed slots; the tree levels hang below the last
pair, each node below its beam parent, so every node attends to exactly its context and ancestors.
Requests verified different numbers of tokens last round; shorter chains are padded with
"fillers" (copies of their last pair continuing the chain) so that the whole batch shares one
shape: fillers are leaves, nobody attends to them, and their slots lie past the committed length.
Later positions of the same specialist query only the newest level (``Nq = K``).

Candidates follow EAGLE-2 with beam width K: the root's top-K, then per level the top-K children of
each of the K frontier nodes scored by cumulative log-prob; the global top-K of those K*K become the
next frontier. ``poss::build_tree`` keeps the best ``num_nodes - 1`` candidates, so K is at most
``num_nodes - 1`` (a wider beam would give the same tree).

Every specialist step here skips the draft's own capacity check (a host sync): the generator sized
the caches for the whole call.

The verified pairs carry the target's features as the runner returned them; :meth:`PosSDraft.draft_input`
turns them into what the draft reads (an EAGLE-3 draft's ``fc`` over the target layers). The tree
levels carry the draft's own outputs, which every draft reads as they are.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

import poss_ext
from poss.decode.batch import BatchState
from poss.models.tree import chain_parents
from poss_ext.limits import ROOT


@dataclass
class Tree:
    """The tree verified this round (shared encoding of ``poss_ext.ops``), node 0 = the root ``x_L``."""

    tokens: Tensor  # [B, N] int64
    parents: Tensor  # [B, N] int32
    depth: Tensor  # [B, N] int32
    # [B, S] int64: the draft's next-best first-level tokens, best first, none of them in the tree
    # (what :func:`poss.decode.lookup.add_lookup` fills unused rows with); None when not drafted
    spare: Optional[Tensor] = None


def root_only_tree(root: Tensor) -> Tree:
    """The empty draft: verifying it is one autoregressive step (``root [B] int64``)."""
    B = root.shape[0]
    return Tree(root.view(B, 1), torch.full((B, 1), ROOT, dtype=torch.int32, device=root.device),
                torch.zeros(B, 1, dtype=torch.int32, device=root.device))


@torch.inference_mode()
def warm_up(draft, batch: BatchState, prompt_lens: List[int], depth: int) -> None:
    """After the target's prefill: every specialist used up to ``depth`` over the prompt's pairs.

    Pairs ``(x_{t+1}, f_t)`` for ``t < P - 1`` go into each used specialist's cache; the last pair
    waits for round 1's catch-up (it is the chain that predicts the root's children).
    """
    B, dev = batch.size, batch.ids.device
    P = prompt_lens
    W = max(max(P) - 1, 1)
    parents = chain_parents([max(p - 1, 1) for p in P], W, dev)
    pos = torch.arange(W, device=dev).expand(B, W).contiguous()
    zero = torch.zeros(B, dtype=torch.int32, device=dev)
    for j in sorted({draft.specialist_for(p) for p in range(1, depth + 1)}):
        draft.step(j, batch.ids[:, 1: W + 1].contiguous(), draft.draft_input(batch.feats[:, :W]).contiguous(), pos,
                   parents, zero, check_capacity=False)
    batch.draft_len = [p - 1 for p in P]
    batch.draft_len_dev.copy_(batch.length_dev - 1)


@torch.inference_mode()
def draft_tree(draft, batch: BatchState, depth: int, beam_width: int, num_nodes: int, spare: int = 0) -> Tree:
    """Draft ``depth`` positions for every row of ``batch`` and assemble the top ``num_nodes`` tree,
    with the ``spare`` next-best first-level tokens (:attr:`Tree.spare`).

    Catches every used specialist up to the target's committed length (``batch.draft_len``).
    """
    # A beam wider than the tree it feeds changes nothing but the cost: build_tree keeps the best
    # num_nodes - 1 candidates, closed under ancestors, so every node it keeps is among the best
    # num_nodes - 1 of its level and of its siblings, and a beam of that width still proposes it
    # (the same tree, up to the order of exactly tied scores). Small trees draft a narrow beam.
    B, K, dev = batch.size, max(1, min(beam_width, num_nodes - 1)), batch.ids.device
    Hf = batch.feats.shape[-1]  # the target's feature width (H, or more for an EAGLE-3 draft)
    # -- the newly verified pairs (x_{t+1}, f_t), t in [draft_len, L), as a padded chain
    T = max(L - d for L, d in zip(batch.length, batch.draft_len))
    last = (batch.length_dev - batch.draft_len_dev - 1).long()  # chain node of each row's last real pair
    t = batch.draft_len_dev.long().unsqueeze(1) + torch.minimum(torch.arange(T, device=dev).unsqueeze(0),
                                                              last.unsqueeze(1))
    chain = (batch.ids.gather(1, t + 1), draft.draft_input(batch.feats.gather(1, t.unsqueeze(-1).expand(B, T, Hf))), t,
             (torch.arange(T, dtype=torch.int32, device=dev) - 1).expand(B, T))
    prefix = batch.draft_len_dev
    levels = [chain]  # (tokens, features, positions, parents) per block of the round's draft tree

    def forward(j: int, catch_up: bool) -> Tensor:
        parents = torch.cat([lv[3] for lv in levels], 1).contiguous()
        blocks = levels if catch_up else levels[-1:]
        tok, feat, pos = (torch.cat([lv[i] for lv in blocks], 1).contiguous() for i in range(3))
        return draft.step(j, tok, feat, pos, parents, prefix, check_capacity=False)

    # -- position 1: specialist 0 on the chain; the last real pair predicts the root's children
    out = forward(draft.specialist_for(1), catch_up=True)
    H = out.shape[-1]  # the draft's hidden size
    ran = {draft.specialist_for(1)}
    root_out = out.gather(1, last.view(B, 1, 1).expand(B, 1, H))
    logp = draft.log_probs(root_out)  # [B, 1, V]
    S = min(spare, logp.shape[-1] - K)
    score, token = logp.topk(K + S, dim=-1)  # [B, 1, K + S]
    score, token = score.view(B, K + S), draft.full_ids(token.view(B, K + S))
    score, token, spare_tokens = score[:, :K], token[:, :K].contiguous(), token[:, K:]
    cand_tokens, cand_scores = [token], [score]
    cand_parents = [torch.full((B, K), -1, dtype=torch.int32, device=dev)]
    frontier_idx = torch.arange(K, device=dev).expand(B, K)  # candidate index of each frontier node
    frontier_feat = root_out.expand(B, K, H)
    frontier_parent = last.view(B, 1).expand(B, K)  # draft-tree node of each frontier node's parent

    # -- positions 2..depth: forward the frontier (level p-1), expand it to level p
    for p in range(2, depth + 1):
        position = batch.length_dev.long().unsqueeze(1) + (p - 2)  # level p-1 holds x_{L+p-1}, input position L+p-2
        levels.append((token, frontier_feat, position.expand(B, K), frontier_parent.to(torch.int32)))
        j = draft.specialist_for(p)
        out = forward(j, catch_up=j not in ran)[:, -K:]
        ran.add(j)
        child_score, child_token = draft.log_probs(out).topk(K, dim=-1)  # [B, K, K]
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

    batch.draft_len = list(batch.length)
    batch.draft_len_dev.copy_(batch.length_dev)
    tokens, parents, tree_depth = poss_ext.ops.build_tree(
        torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1).contiguous(),
        batch.root_tokens(), num_nodes)
    return Tree(tokens, parents, tree_depth, spare_tokens if S else None)
