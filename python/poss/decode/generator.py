"""The generation loop: prefill, then rounds of draft -> build tree -> verify -> commit.

Reads like the algorithm (PosS §3): :meth:`Generator.round` is the whole speculative step. The
device work of a round never waits on the host; the host reads back, once per round, a small
tensor with the accept lengths and the new tokens, and only then applies the stop rules and
drops finished requests from the batch. With no draft, every round verifies a root-only tree: plain
autoregressive decoding on the same runner, the baseline of every speed claim.
"""

import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch

from poss.decode import autotune
from poss.decode.batch import BatchState, Request
from poss.decode.draft_tree import draft_tree, root_only_tree, warm_up
from poss.decode.lookup import add_lookup
from poss.decode.params import SamplingParams, TreeParams, batch_seed
from poss.decode.stopping import Stopper, end_token_ids, safe_text
from poss.decode.verify import commit, tree_verify, verify
from poss.models.target import sliding_window

Prompt = Union[str, List[dict], List[int]]


@dataclass
class Stats:
    """Per prompt: generated ``tokens`` (end token included), verify ``rounds``, ``tau`` = mean tokens
    per round (accepted draft tokens + 1), ``accept_hist[k]`` = rounds that accepted k draft tokens,
    ``seconds`` from the call's start to this request's end, ``draft_tokens`` = tree nodes proposed
    past the root over all rounds (so ``1 + draft_tokens / rounds`` rows were verified per round)."""

    tokens: int
    rounds: int
    tau: float
    accept_hist: List[int]
    seconds: float
    finish_reason: str
    draft_tokens: int = 0


@dataclass
class Result:
    """``features[i]`` (only with ``Generator.keep_features``): the target's final-norm features
    ``[P + n - 1, H]`` of prompt i's tokens followed by its n generated tokens, the last one excluded
    (its feature would only be computed by the next round)."""

    texts: List[str]
    stats: List[Stats]
    token_ids: List[List[int]]
    features: Optional[List[torch.Tensor]] = None


def request_stats(r: Request) -> Stats:
    """The :class:`Stats` of a request so far."""
    rounds = sum(r.accept_hist)
    tau = sum((k + 1) * c for k, c in enumerate(r.accept_hist)) / rounds if rounds else 0.0
    return Stats(len(r.generated), rounds, tau, list(r.accept_hist), r.seconds, r.finish_reason or "",
                 r.draft_tokens)


def check_speculate_max_batch(limit):
    """``limit`` if it is a valid speculation limit (an int >= 1, ``"auto"`` or None), else
    ``ValueError``.
    """
    if not (limit is None or limit == "auto"
            or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1)):
        raise ValueError(f"speculate_max_batch must be an int >= 1, 'auto' or None, got {limit!r}")
    return limit


class Generator:
    """Lossless speculative generation with a PosS draft on a :class:`TargetRunner`.

    Args:
        runner: the target runner (its cache is resized as needed).
        tokenizer: an HF tokenizer, or None (prompts must then be token-id lists; texts are empty).
        draft: an attached :class:`PosSDraft`, or None for plain autoregressive generation.
        context_limit: longest sequence (prompt + generated); defaults to the model's
            ``max_position_embeddings`` (at most its sliding window, if it has one).
        end_ids: token ids that end a request; defaults to EOS + the template's end-of-turn token.
        target_path: the HF folder of the target (informational).
        datastore: a :class:`~poss.decode.datastore.Datastore` of the target's own text that supplies a
            round's lookup chain where the context holds none (trees with ``lookup > 0`` only), or None.
    """

    def __init__(self, runner, tokenizer=None, draft=None, context_limit: Optional[int] = None,
                 end_ids=None, target_path=None, generation_config=None, datastore=None):
        self.runner, self.tokenizer, self.draft = runner, tokenizer, draft
        self.datastore = datastore
        self.target_path = target_path
        self.context_limit = int(context_limit or getattr(runner.config, "max_position_embeddings", 4096))
        window = sliding_window(runner.config)
        if window is not None:
            # The runner attends to the whole context: within the window that is the model's own
            # attention, past it a silently different one.
            if context_limit is not None and context_limit > window:
                raise ValueError(f"context_limit={context_limit} exceeds the model's sliding window {window}, "
                                 "which poss does not implement")
            self.context_limit = min(self.context_limit, window)
        self.end_ids = set(end_token_ids(tokenizer, generation_config) if end_ids is None else end_ids)
        self.profile: Optional[Dict[str, List[float]]] = None  # phase -> seconds per round, when set
        # Keep every request's target features (prompt + answer) in the Result: on-policy draft
        # training data from the same run, with no second target pass.
        self.keep_features = False
        # The tree of calls that pass none: a TreeParams, or "auto" (poss.load's default), resolved on
        # first use by timing this machine (autotune; cached on disk) and then kept per beam width.
        self.default_tree: Union[TreeParams, str] = TreeParams()
        self._auto_trees: Dict[tuple, TreeParams] = {}
        self.speculate_max_batch = None
        self._limits: Dict[tuple, Optional[int]] = {}
        # Set by poss.decode.loader.compile_steps: compiled steps cost differently, so autotune keeps
        # their timings apart from eager ones.
        self.compiled = False

    @property
    def speculate_max_batch(self) -> Union[int, str, None]:
        """Speculate only while at most this many requests of a call are live; larger batches decode
        plainly (on a CPU a tree round's cost grows with batch x nodes, a decode step's barely).
        An int >= 1, ``"auto"`` (poss.load's default: measured once per machine, draft and tree,
        cached on disk; :func:`poss.decode.autotune.speculation_limit`) or None (always speculate)."""
        return self._speculate_max_batch

    @speculate_max_batch.setter
    def speculate_max_batch(self, limit: Union[int, str, None]) -> None:
        self._speculate_max_batch = check_speculate_max_batch(limit)

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
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int,
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 tree: Optional[TreeParams] = None, stop: Sequence[str] = (), **options) -> Result:
        """Generate for every prompt (batched, ragged).

        ``sampling``: one :class:`SamplingParams` for all prompts or one per prompt (default greedy);
        ``tree``: the draft tree, a :class:`TreeParams` or ``"auto"`` (default: :attr:`default_tree`). For
        convenience ``options`` may name their fields directly (``temperature=0.7, top_p=[0.9, 1.0], seed=1,
        depth=4, beam_width=8``);
        a sampling field takes one value or one per prompt and overrides ``sampling``.
        """
        single, reqs, tree = self._prepare(prompts, max_new_tokens, sampling, tree, options)
        for _ in self._run(reqs, tree, stop):
            pass
        return self._result(reqs)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int,
               sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               tree: Optional[TreeParams] = None, stop: Sequence[str] = (), **options) -> Iterator:
        """Yield text as it is accepted: ``str`` pieces for one prompt, ``(index, str)`` for a list.

        Arguments as in :meth:`generate`. ``self.last_result`` holds the full :class:`Result` once the
        iterator is exhausted.
        """
        single, reqs, tree = self._prepare(prompts, max_new_tokens, sampling, tree, options)
        shown = [0] * len(reqs)
        for _ in self._run(reqs, tree, stop):
            for r in reqs:
                text = self.decode(r.generated)[: r.text_end]
                visible = safe_text(text, stop, r.finished)
                if len(visible) > shown[r.index]:
                    piece, shown[r.index] = visible[shown[r.index]:], len(visible)
                    yield piece if single else (r.index, piece)
        self.last_result = self._result(reqs)

    # -- the loop --------------------------------------------------------------------------------
    def _prepare(self, prompts, max_new_tokens, sampling, tree, options):
        """Validate everything before any model work: ``(single, requests, tree params)``."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], (int, dict)))
        prompts = [prompts] if single else list(prompts)
        if not prompts:  # before resolve_tree, whose "auto" may time the machine first
            raise ValueError("no prompts given")
        tree = self.resolve_tree(tree, **{k: options.pop(k) for k in ("num_nodes", "depth", "beam_width", "lookup")
                                          if k in options})
        params = SamplingParams.per_request(sampling, len(prompts), **options)
        return single, self._requests(prompts, max_new_tokens, params), tree

    def resolve_tree(self, tree: Union[TreeParams, str, None] = None, **fields) -> TreeParams:
        """The tree of a call: ``tree`` (None: :attr:`default_tree`; ``"auto"``: sized by measurement, see
        :meth:`auto_tree`) with ``fields`` (``num_nodes``, ``depth``, ``beam_width``) overriding.
        Naming a size overrides ``auto`` with the fixed defaults for the other."""
        tree = self.default_tree if tree is None else tree
        if isinstance(tree, str):
            if tree != "auto":
                raise ValueError(f"tree must be a TreeParams or 'auto', got {tree!r}")
            if "num_nodes" in fields or "depth" in fields:
                tree = TreeParams()
            else:
                tree = self.auto_tree(fields.pop("beam_width", TreeParams.beam_width))
        elif not isinstance(tree, TreeParams):
            raise TypeError(f"tree must be a TreeParams or 'auto', got {type(tree).__name__}")
        tree = TreeParams(**{**vars(tree), **fields})
        tree.check_vocab(self.runner.lm_head.shape[0])
        return tree

    def auto_tree(self, beam_width: int = TreeParams.beam_width) -> TreeParams:
        """The tree that maximises expected tokens/s for this generator on this machine and dtype
        (:func:`poss.decode.autotune.auto_tree`: verify and draft costs timed once and cached on disk, and
        the draft's acceptance profile; root-only when plain decoding is faster), kept for the
        generator's lifetime."""
        key = (beam_width, id(self.datastore))  # a datastore changes what the lookup chains are worth
        if key not in self._auto_trees:
            self._auto_trees[key] = autotune.auto_tree(self, beam_width=beam_width)
        return self._auto_trees[key]

    def speculation_limit(self, tree: TreeParams) -> Optional[int]:
        """The batch size above which a call's rounds do not speculate (None: no limit), from
        :attr:`speculate_max_batch`; ``"auto"`` is measured on first use and kept per draft and tree."""
        limit = self.speculate_max_batch
        if limit != "auto":
            return limit
        if self.draft is None:
            return None
        key = (id(self.draft), tree.num_nodes, tree.depth, tree.beam_width, tree.lookup)
        if key not in self._limits:

            self._limits[key] = autotune.speculation_limit(self, tree)
        return self._limits[key]

    def _requests(self, prompts, max_new_tokens: int, sampling: Sequence[SamplingParams]) -> List[Request]:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling parameters for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling)):
            ids = self.encode(p)
            if not ids:
                raise ValueError(f"prompt {i} is empty: there is no token to continue from")
            vocab = self.runner.embed.shape[0]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {i} has token id {bad}, outside the vocabulary [0, {vocab})")
            if len(ids) >= self.context_limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, at or over the context limit of "
                                 f"{self.context_limit}: no room to generate")
            reqs.append(Request(i, ids, max_new_tokens, sp))
        return reqs

    def _result(self, reqs: List[Request]) -> Result:
        texts = [self.decode(r.generated)[: r.text_end] for r in reqs]
        stats = [request_stats(r) for r in reqs]
        feats = [r.features for r in reqs] if self.keep_features else None
        return Result(texts, stats, [list(r.generated) for r in reqs], feats)

    def _run(self, reqs: List[Request], tree: TreeParams, stop) -> Iterator[None]:
        """The call as a generator: yields after the prefill and after every round (tests step it)."""
        start = time.perf_counter()
        if reqs[0].max_new_tokens == 0:
            for r in reqs:
                r.finished, r.finish_reason = True, "length"
            yield
            return
        speculate = self.draft is not None and tree.depth >= 1 and tree.num_nodes > 1
        depth = tree.depth if speculate else 0
        limit = self.speculation_limit(tree) if speculate and len(reqs) > 1 else None
        for r in reqs:
            r.accept_hist = [0] * (depth + tree.lookup + 1)
        stopper = Stopper(self.end_ids, stop, self.decode if self.tokenizer is not None else None)
        longest = max(len(r.prompt) for r in reqs)
        # Every slot the call can touch, so no forward needs a capacity check (a host sync):
        # the text, one round's tree and the draft's catch-up tree.
        capacity = (min(self.context_limit, longest + reqs[0].max_new_tokens) + tree.num_nodes
                    + tree.beam_width * depth + depth + 2 * tree.lookup + 8)
        self.runner.cache = self.runner.cache.grown(len(reqs), capacity)
        if speculate:
            self.draft.ensure_caches(len(reqs), capacity)
        batch = BatchState(reqs, self.runner.hidden_size, capacity, self.runner.dtype, self.runner.device,
                           speculate or self.keep_features)
        self.rng = torch.Generator(device=self.runner.device).manual_seed(batch_seed([r.sampling for r in reqs]))
        caches = [self.runner.cache] + ([self.draft.caches] if speculate else [])
        self.state = batch  # the live batch state, for inspection (tests, debugging)

        first = self.prefill(batch, depth)
        for b, r in enumerate(batch.requests):
            stopper.append(r, [first[b]], self.context_limit - len(r.prompt))
        self._finish_times(batch.requests, start)
        yield
        self._keep_features(batch)
        batch.drop_finished(caches)
        while batch.size:
            # A plain round leaves the draft behind; its next tree round catches up on the pairs it missed.
            spec = limit is None or batch.size <= limit
            rows = self.round(batch, tree.num_nodes if spec else 1, depth if spec else 0, tree.beam_width,
                              lookup=tree.lookup if spec else 0)
            t = time.perf_counter()
            self.apply_round(batch, rows, lambda r: stopper)
            self._finish_times(batch.requests, start)
            yield
            self._keep_features(batch)
            batch.drop_finished(caches)
            self._record("host", t)

    @torch.inference_mode()
    def prefill(self, batch: BatchState, depth: int, uniforms=None) -> List[int]:
        """Target over the prompts, the first token from its last logits, then the draft's warm-up.

        ``uniforms(B, N)``: the ``[B, N + 1]`` random numbers of a sampled verify (default: drawn from
        the call's generator ``self.rng``)."""
        runner, B, dev = self.runner, batch.size, self.runner.device
        prompts = [r.prompt for r in batch.requests]
        P = [len(p) for p in prompts]
        last_logits, feats = runner.prefill(prompts)
        for b, p in enumerate(prompts):
            batch.ids[b, : len(p)] = torch.as_tensor(p, device=dev)
        batch.length = list(P)
        batch.length_dev.copy_(torch.tensor(P, dtype=torch.int32))
        last_tok = batch.ids.gather(1, (batch.length_dev.long() - 1).unsqueeze(1))
        uniforms = (uniforms or self._uniforms)(B, 1) if batch.sampling is not None else None
        _, _, first = tree_verify(root_only_tree(last_tok.view(B)), last_logits.unsqueeze(1), batch.sampling, uniforms)
        batch.ids.scatter_(1, batch.length_dev.long().unsqueeze(1), first.unsqueeze(1))
        if batch.feats is not None:
            batch.feats[:, : feats.shape[1]] = feats.to(batch.feats.dtype)
            if depth:
                warm_up(self.draft, batch, P, depth)
        return first.tolist()

    @torch.inference_mode()
    def round(self, batch: BatchState, num_nodes: int, depth: int, beam_width: int,
              uniforms=None, lookup: int = 0) -> List[List[int]]:
        """One speculative round for every active row; returns per row (accept_len, new tokens...).

        ``uniforms`` as in :meth:`prefill`; ``lookup``: as :attr:`TreeParams.lookup`."""
        t = time.perf_counter()
        if depth:
            tree = draft_tree(self.draft, batch, depth, beam_width, num_nodes, spare=lookup)
        else:
            tree = root_only_tree(batch.root_tokens())
        if lookup:
            tree = add_lookup(tree, [r.prompt + r.generated for r in batch.requests], lookup, self.datastore)
        t = self._record("draft", t)
        N = tree.tokens.shape[1]
        for r in batch.requests:
            r.draft_tokens += N - 1
        uniforms = (uniforms or self._uniforms)(batch.size, N) if batch.sampling is not None else None
        nodes, acc, nxt, features = verify(self.runner, batch, tree, uniforms)
        t = self._record("verify", t)
        packed = commit(self.runner, batch, tree, nodes, acc, nxt, features, max_accept=depth + lookup)
        rows = packed.tolist()  # the round's one host sync
        self._record("commit", t)
        return rows

    def apply_round(self, batch: BatchState, rows: List[List[int]], stopper_of) -> None:
        """Book a round's ``rows`` (from :meth:`round`) on the host: accept histograms, committed
        lengths, and each request's new tokens through its stop rules (``stopper_of(request)``)."""
        for b, row in enumerate(rows):
            a, r = row[0], batch.requests[b]
            r.accept_hist[a] += 1
            batch.length[b] += a + 1
            stopper_of(r).append(r, row[1:a + 2], self.context_limit - len(r.prompt))

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

    def _keep_features(self, batch: BatchState) -> None:
        if not self.keep_features:
            return
        for b, r in enumerate(batch.requests):
            if r.finished and r.features is None:
                n = len(r.prompt) + len(r.generated) - 1  # features exist for t < committed length
                r.features = batch.feats[b, :n].clone()

    @staticmethod
    def _finish_times(requests, start):
        now = time.perf_counter()
        for r in requests:
            if r.finished and not r.seconds:
                r.seconds = now - start
