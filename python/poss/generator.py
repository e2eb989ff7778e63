"""The generation loop: prefill, then rounds of draft -> build tree -> verify -> commit.

Reads like the algorithm (PosS §3): :meth:`Generator.round` is the whole speculative step. The
device work of a round never waits on the host; the host reads back, once per round, a small
tensor with the accept lengths and the new tokens, and only then applies the stop rules and
drops finished requests from the batch. With no draft, every round verifies a root-only tree: plain
autoregressive decoding on the same runner, the baseline of every speed claim.
"""

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch

import poss_ext
from poss.draft_tree import draft_tree, root_only_tree
from poss.models.kv_cache import StaticKVCache
from poss.models.target import chain_parents
from poss.forward import specialist_step
from poss.sequences import Request, Sequences
from poss.stopping import Stopper, end_token_ids, first_stop, safe_text
from poss.verify import commit, verify

Prompt = Union[str, List[dict], List[int]]


@dataclass
class Stats:
    """Per prompt: generated ``tokens`` (end token included), verify ``rounds``, ``tau`` = mean tokens
    per round (accepted draft tokens + 1), ``accept_hist[k]`` = rounds that accepted k draft tokens,
    ``seconds`` from the call's start to this request's end."""

    tokens: int
    rounds: int
    tau: float
    accept_hist: List[int]
    seconds: float
    finish_reason: str


@dataclass
class Result:
    """``features[i]`` (only with ``Generator.keep_features``): the target's final-norm features
    ``[P + n - 1, H]`` of prompt i's tokens followed by its n generated tokens, the last one excluded
    (its feature would only be computed by the next round)."""

    texts: List[str]
    stats: List[Stats]
    token_ids: List[List[int]]
    features: Optional[List[torch.Tensor]] = None


def _per_request(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


def check_tree_params(num_nodes: int, depth: int, top_k_draft: int, vocab: int) -> None:
    """Clear errors for tree shapes the kernels do not take (tree attention: <= 256 real nodes;
    build_tree on CUDA: <= 2048 candidates)."""
    if num_nodes < 1 or num_nodes > 256:
        raise ValueError(f"num_nodes must be in [1, 256], got {num_nodes}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if not 1 <= top_k_draft <= vocab:
        raise ValueError(f"top_k_draft must be in [1, vocab={vocab}], got {top_k_draft}")
    if depth and depth + 1 + top_k_draft * (depth - 1) > 256:
        raise ValueError(f"depth={depth} with top_k_draft={top_k_draft} drafts more than 256 nodes per round")
    if depth and top_k_draft + (depth - 1) * top_k_draft ** 2 > 2048:
        raise ValueError(f"depth={depth} with top_k_draft={top_k_draft} gives more than 2048 tree candidates")


class Generator:
    """Lossless speculative generation with a PosS draft on a :class:`TargetRunner`.

    Args:
        runner: the target runner (its cache is resized as needed).
        tokenizer: an HF tokenizer, or None (prompts must then be token-id lists; texts are empty).
        draft: an attached :class:`PosSDraft`, or None for plain autoregressive generation.
        context_limit: longest sequence (prompt + generated); defaults to the model's
            ``max_position_embeddings``.
        end_ids: token ids that end a request; defaults to EOS + the template's end-of-turn token.
        target_path: the HF folder of the target (informational).
    """

    def __init__(self, runner, tokenizer=None, draft=None, context_limit: Optional[int] = None,
                 end_ids=None, target_path=None, generation_config=None):
        self.runner, self.tokenizer, self.draft = runner, tokenizer, draft
        self.target_path = target_path
        self.context_limit = int(context_limit or getattr(runner.config, "max_position_embeddings", 4096))
        self.end_ids = set(end_token_ids(tokenizer, generation_config) if end_ids is None else end_ids)
        self.profile: Optional[Dict[str, List[float]]] = None  # phase -> seconds per round, when set
        # Keep every request's target features (prompt + answer) in the Result: on-policy draft
        # training data from the same run, with no second target pass.
        self.keep_features = False

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> List[int]:
        """Token ids of a prompt: ids as given, or text / chat messages through the chat template."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this generator has no tokenizer: pass prompts as lists of token ids")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer("".join(m["content"] for m in messages)).input_ids

    def decode(self, ids: List[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- public API ------------------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int, temperature=0.0,
                 top_k=0, top_p=1.0, num_nodes: int = 60, depth: int = 6, top_k_draft: int = 10,
                 seed: Optional[int] = None, stop: Sequence[str] = ()) -> Result:
        """Generate for every prompt (batched, ragged). Sampling parameters may be per-prompt lists."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)))
        reqs = self._requests([prompts] if single else list(prompts), max_new_tokens, temperature, top_k, top_p)
        for _ in self._run(reqs, num_nodes, depth, top_k_draft, seed, stop):
            pass
        return self._result(reqs, stop)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int, temperature=0.0, top_k=0,
               top_p=1.0, num_nodes: int = 60, depth: int = 6, top_k_draft: int = 10,
               seed: Optional[int] = None, stop: Sequence[str] = ()) -> Iterator:
        """Yield text as it is accepted: ``str`` pieces for one prompt, ``(index, str)`` for a list.

        ``self.last_result`` holds the full :class:`Result` once the iterator is exhausted.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)))
        reqs = self._requests([prompts] if single else list(prompts), max_new_tokens, temperature, top_k, top_p)
        shown = [0] * len(reqs)
        for _ in self._run(reqs, num_nodes, depth, top_k_draft, seed, stop):
            for r in reqs:
                text = self.decode(r.generated)[: r.text_end]
                visible = safe_text(text, stop, r.finished)
                if len(visible) > shown[r.index]:
                    piece, shown[r.index] = visible[shown[r.index]:], len(visible)
                    yield piece if single else (r.index, piece)
        self.last_result = self._result(reqs, stop)

    # -- the loop --------------------------------------------------------------------------------
    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p) -> List[Request]:
        n = len(prompts)
        if n == 0:
            raise ValueError("no prompts given")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        temps, ks, ps = (_per_request(v, n, name) for v, name in
                         ((temperature, "temperature"), (top_k, "top_k"), (top_p, "top_p")))
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p)
            if not ids:
                raise ValueError(f"prompt {i} is empty: there is no token to continue from")
            if len(ids) >= self.context_limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, at or over the context limit of "
                                 f"{self.context_limit}: no room to generate")
            reqs.append(Request(i, ids, max_new_tokens, float(temps[i]), int(ks[i]), float(ps[i])))
        return reqs

    def _result(self, reqs: List[Request], stop) -> Result:
        texts, stats = [], []
        for r in reqs:
            texts.append(self.decode(r.generated)[: r.text_end])
            rounds = sum(r.accept_hist)
            tau = sum((k + 1) * c for k, c in enumerate(r.accept_hist)) / rounds if rounds else 0.0
            stats.append(Stats(len(r.generated), rounds, tau, list(r.accept_hist), r.seconds, r.finish_reason or ""))
        feats = [r.features for r in reqs] if self.keep_features else None
        return Result(texts, stats, [list(r.generated) for r in reqs], feats)

    def _run(self, reqs: List[Request], num_nodes: int, depth: int, top_k_draft: int, seed, stop) -> Iterator[None]:
        start = time.perf_counter()
        check_tree_params(num_nodes, depth, top_k_draft, self.runner.lm_head.shape[0])
        if reqs[0].max_new_tokens == 0:
            for r in reqs:
                r.finished, r.finish_reason = True, "length"
            yield
            return
        speculate = self.draft is not None and depth >= 1 and num_nodes > 1
        depth = depth if speculate else 0
        for r in reqs:
            r.accept_hist = [0] * (depth + 1)
        stopper = Stopper(self.end_ids, stop, self.decode if self.tokenizer is not None else None)
        longest = max(len(r.prompt) for r in reqs)
        capacity = min(self.context_limit, longest + reqs[0].max_new_tokens) + num_nodes + top_k_draft * depth + depth + 8
        self._ensure_caches(len(reqs), capacity)
        seq = Sequences(reqs, self.runner.hidden_size, capacity, self.runner.dtype, self.runner.device,
                        speculate or self.keep_features)
        device = self.runner.device
        self.rng = torch.Generator(device=device).manual_seed(random.randrange(1 << 62) if seed is None else seed)
        caches = [self.runner.cache] + ([self.draft.caches] if speculate else [])
        self.state = seq  # the live batch state, for inspection (tests, debugging)

        first = self.prefill(seq, depth)
        for b, r in enumerate(seq.requests):
            stopper.append(r, [first[b]], self.context_limit - len(r.prompt))
        self._finish_times(seq.requests, start)
        yield
        self._keep_features(seq)
        seq.drop_finished(caches)
        while seq.batch:
            rows = self.round(seq, num_nodes, depth, top_k_draft)
            t = time.perf_counter()
            for b, row in enumerate(rows):
                a, r = row[0], seq.requests[b]
                r.accept_hist[a] += 1
                seq.length[b] += a + 1
                stopper.append(r, row[1:a + 2], self.context_limit - len(r.prompt))
            self._finish_times(seq.requests, start)
            yield
            self._keep_features(seq)
            seq.drop_finished(caches)
            self._record("host", t)

    @torch.inference_mode()
    def prefill(self, seq: Sequences, depth: int) -> List[int]:
        """Target over the prompts, the first token from its last logits, then every used specialist
        over the prompt's pairs ``t < P - 1`` (the last pair waits for round 1's catch-up)."""
        runner, B, dev = self.runner, seq.batch, self.runner.device
        prompts = [r.prompt for r in seq.requests]
        P = [len(p) for p in prompts]
        last_logits, feats = runner.prefill(prompts)
        for b, p in enumerate(prompts):
            seq.ids[b, : len(p)] = torch.as_tensor(p, device=dev)
        seq.length = list(P)
        seq.length_dev.copy_(torch.tensor(P, dtype=torch.int32))
        last_tok = seq.ids.gather(1, (seq.length_dev.long() - 1).unsqueeze(1))
        tree = root_only_tree(last_tok.view(B))
        uniforms = self._uniforms(B, 1) if seq.temperature is not None else None
        _, _, first = poss_ext.ops.tree_verify(tree.parents, tree.tokens, last_logits.unsqueeze(1), seq.temperature,
                                               seq.top_k, seq.top_p, uniforms)
        seq.ids.scatter_(1, seq.length_dev.long().unsqueeze(1), first.unsqueeze(1))
        if seq.feats is not None:
            seq.feats[:, : feats.shape[1]] = feats.to(seq.feats.dtype)
        if seq.feats is not None and depth:
            W = max(max(P) - 1, 1)
            parents = chain_parents([max(p - 1, 1) for p in P], W, dev)
            pos = torch.arange(W, device=dev).expand(B, W).contiguous()
            zero = torch.zeros(B, dtype=torch.int32, device=dev)
            for j in sorted({self.draft.specialist_for(p) for p in range(1, depth + 1)}):
                specialist_step(self.draft, j, seq.ids[:, 1: W + 1].contiguous(), seq.feats[:, :W].contiguous(),
                                pos, parents, zero)
            seq.draft_len = [p - 1 for p in P]
            seq.draft_len_dev.copy_(seq.length_dev - 1)
        return first.tolist()

    @torch.inference_mode()
    def round(self, seq: Sequences, num_nodes: int, depth: int, top_k_draft: int) -> List[List[int]]:
        """One speculative round for every active row; returns per row (accept_len, new tokens...)."""
        t = time.perf_counter()
        if depth:
            tree = draft_tree(self.draft, seq, depth, top_k_draft, num_nodes)
        else:
            tree = root_only_tree(seq.root_tokens())
        t = self._record("draft", t)
        N = tree.tokens.shape[1]
        uniforms = self._uniforms(seq.batch, N) if seq.temperature is not None else None
        nodes, acc, nxt, features = verify(self.runner, seq, tree, uniforms)
        t = self._record("verify", t)
        packed = commit(self.runner, seq, tree, nodes, acc, nxt, features, max_accept=depth)
        rows = packed.tolist()  # the round's one host sync
        self._record("commit", t)
        return rows

    # -- helpers ---------------------------------------------------------------------------------
    def _uniforms(self, B: int, N: int):
        return torch.rand(B, N + 1, generator=self.rng, device=self.runner.device)

    def _record(self, phase: str, since: float) -> float:
        if self.profile is None:
            return since
        if self.runner.device.type == "cuda":  # profiling only: make the phase's device work count
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.profile.setdefault(phase, []).append(now - since)
        return now

    def _keep_features(self, seq: Sequences) -> None:
        if not self.keep_features:
            return
        for b, r in enumerate(seq.requests):
            if r.finished and r.features is None:
                n = len(r.prompt) + len(r.generated) - 1  # features exist for t < committed length
                r.features = seq.feats[b, :n].clone()

    @staticmethod
    def _finish_times(requests, start):
        now = time.perf_counter()
        for r in requests:
            if r.finished and not r.seconds:
                r.seconds = now - start

    def _ensure_caches(self, batch: int, seq_len: int) -> None:
        c = self.runner.cache
        if c.batch < batch or c.max_seq < seq_len:
            self.runner.cache = StaticKVCache(c.k.shape[0], max(batch, c.batch), c.k.shape[2], max(seq_len, c.max_seq),
                                              c.k.shape[4], c.k.dtype, c.k.device)
        if self.draft is not None:
            d = self.draft.caches
            if d is None or d.batch < batch or d.max_seq < seq_len:
                cfg, p = self.draft.config, next(self.draft.parameters())
                self.draft.caches = StaticKVCache(cfg.n_specialists, max(batch, d.batch if d else 0), cfg.kv_heads,
                                                  max(seq_len, d.max_seq if d else 0), cfg.head_dim, p.dtype, p.device)
