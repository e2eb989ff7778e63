"""The generator: prompts in, texts out; prefill, then rounds of draft -> build tree -> verify -> commit.

Reads like the algorithm (PosS §3): :meth:`Generator.round` is the whole speculative step. The
device work of a round never waits on the host; the host reads back, once per round, a small
tensor with the accept lengths and the new tokens, and only then applies the stop rules. The loop
that drives prefills and rounds over a changing batch is :class:`poss.decode.engine.DecodeEngine`:
:meth:`Generator.generate` / :meth:`~Generator.stream` add their prompts to one and step it until
all are done, as ``poss serve`` does with its requests. With no draft, every round verifies a
root-only tree: plain autoregressive decoding on the same runner, the baseline of every speed claim.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

from poss.decode import autotune
from poss.decode.batch import BatchState, Request, check_request
from poss.decode.draft_tree import draft_tree, root_only_tree, warm_up
from poss.decode.engine import (
    DecodeEngine,
    Stats,
    check_speculate_max_batch,
    record_phase,
    request_stats,
    speculates,
)
from poss.decode.lookup import add_lookup
from poss.decode.params import SamplingParams, TreeParams
from poss.decode.stopping import end_token_ids, safe_text
from poss.decode.verify import commit, tree_verify, verify
from poss.models.target import sliding_window

Prompt = Union[str, List[dict], List[int]]


@dataclass
class Result:
    """``features[i]`` (only with ``Generator.keep_features``): the target's final-norm features
    ``[P + n - 1, H]`` of prompt i's tokens followed by its n generated tokens, the last one excluded
    (its feature would only be computed by the next round). ``tree``: the tree the call ran (what
    ``"auto"`` resolved to)."""

    texts: List[str]
    stats: List[Stats]
    token_ids: List[List[int]]
    features: Optional[List[torch.Tensor]] = None
    tree: Optional[TreeParams] = None


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
        self.state: Optional[BatchState] = None  # the running engine's live batch, for inspection
        # Keep every request's target features (prompt + answer) in the Result: on-policy draft
        # training data from the same run, with no second target pass.
        self.keep_features = False
        # The tree of calls that pass none: a TreeParams, or "auto" (poss.load's default), resolved on
        # first use (autotune.auto_tree: this machine's cached timing, else the draft's shipped tree)
        # and then kept per beam width.
        self.default_tree: Union[TreeParams, str] = TreeParams()
        self._auto_trees: Dict[tuple, autotune.AutoTree] = {}
        self.auto_choice: Optional[autotune.AutoTree] = None  # what "auto" last resolved to, and why
        # What poss.load's dtype="auto" resolved to, and why (poss.decode.dtype_choice); None: given
        self.dtype_choice = None
        self.draft_dir: Optional[Path] = None  # the draft's folder (poss.load sets it): its shipped trees
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
        a sampling field takes one value or one per prompt and overrides ``sampling``. Each sampled request
        draws from its own generator seeded by its ``seed``: pass one seed per prompt (``seed=[1, 2]``)
        for different samples of one prompt; a shared seed samples copies of a prompt alike.
        """
        single, reqs, tree = self._prepare(prompts, max_new_tokens, sampling, tree, options)
        for _ in self._steps(reqs, tree, stop):
            pass
        return self._result(reqs, tree)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int,
               sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               tree: Optional[TreeParams] = None, stop: Sequence[str] = (), **options) -> Iterator:
        """Yield text as it is accepted: ``str`` pieces for one prompt, ``(index, str)`` for a list.

        Arguments as in :meth:`generate`. ``self.last_result`` holds the full :class:`Result` once the
        iterator is exhausted.
        """
        single, reqs, tree = self._prepare(prompts, max_new_tokens, sampling, tree, options)
        shown = [0] * len(reqs)
        for _ in self._steps(reqs, tree, stop):
            for r in reqs:
                text = self.decode(r.generated)[: r.text_end]
                visible = safe_text(text, stop, r.finished)
                if len(visible) > shown[r.index]:
                    piece, shown[r.index] = visible[shown[r.index]:], len(visible)
                    yield piece if single else (r.index, piece)
        self.last_result = self._result(reqs, tree)

    # -- the loop --------------------------------------------------------------------------------
    def _prepare(self, prompts, max_new_tokens, sampling, tree, options):
        """Validate everything before any model work: ``(single, requests, tree params)``."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], (int, dict)))
        prompts = [prompts] if single else list(prompts)
        if not prompts:  # before resolve_tree, which may read the timing cache
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
        """The tree ``"auto"`` stands for (:func:`poss.decode.autotune.auto_tree`: the one with the
        most expected tokens/s by this machine's cached timing, else the draft's tree shipped for this
        CPU class and dtype; root-only without a draft; nothing is timed here, see
        :func:`poss.decode.autotune.tune`), kept for the generator's lifetime; :attr:`auto_choice`
        says where it came from."""
        key = (beam_width, id(self.datastore))  # a datastore changes what the lookup chains are worth
        if key not in self._auto_trees:
            self._auto_trees[key] = autotune.auto_tree(self, beam_width=beam_width)
        self.auto_choice = self._auto_trees[key]
        return self.auto_choice.tree

    def forget_tuning(self) -> None:
        """Drop what ``"auto"`` resolved to in this generator (after :func:`poss.decode.autotune.tune`)."""
        self._auto_trees.clear()
        self._limits.clear()
        self.auto_choice = None

    def speculation_limit(self, tree: TreeParams, max_batch: Optional[int] = None) -> Optional[int]:
        """The batch size above which rounds of ``tree`` do not speculate (None: no limit), from
        :attr:`speculate_max_batch`; ``"auto"`` is looked up once per draft, tree and ``max_batch``
        (:func:`poss.decode.autotune.speculation_limit`: this machine's timing when one was made,
        else the draft's shipped default; nothing is timed here)."""
        limit = self.speculate_max_batch
        if limit != "auto":
            return limit
        if not speculates(self.draft, tree) or max_batch == 1:
            return None
        key = (id(self.draft), tree.num_nodes, tree.depth, tree.beam_width, tree.lookup, max_batch)
        if key not in self._limits:
            self._limits[key] = autotune.speculation_limit(self, tree, max_batch)
        return self._limits[key]

    def _requests(self, prompts, max_new_tokens: int, sampling: Sequence[SamplingParams]) -> List[Request]:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling parameters for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling)):
            ids = self.encode(p)
            check_request(ids, max_new_tokens, self.runner.embed.shape[0], self.context_limit, f"prompt {i}")
            reqs.append(Request(i, ids, max_new_tokens, sp))
        return reqs

    def _result(self, reqs: List[Request], tree: TreeParams) -> Result:
        texts = [self.decode(r.generated)[: r.text_end] for r in reqs]
        stats = [request_stats(r) for r in reqs]
        feats = [r.features for r in reqs] if self.keep_features else None
        return Result(texts, stats, [list(r.generated) for r in reqs], feats, tree)

    def _steps(self, reqs: List[Request], tree: TreeParams, stop) -> Iterator[None]:
        """The call on a fresh :class:`DecodeEngine`: all requests join at once, then one step at a
        time until every one is done (yields after each step)."""
        limit = self.speculate_max_batch if len(reqs) > 1 else None  # one request: nothing to measure
        engine = DecodeEngine(self, tree, speculate_max_batch=limit)
        for r in reqs:
            engine.submit(r, stop)
        while engine.has_work():
            engine.step()
            yield

    @torch.inference_mode()
    def prefill(self, batch: BatchState, depth: int, uniforms: Callable[[int, int], torch.Tensor]) -> List[int]:
        """Target over the prompts, the first token from its last logits, then the draft's warm-up.

        ``uniforms(B, N)``: the ``[B, N + 1] float32`` random numbers of a sampled verify (called only
        when some row samples; :class:`~poss.decode.engine.DecodeEngine` draws each row from its
        request's own generator)."""
        runner, B, dev = self.runner, batch.size, self.runner.device
        prompts = [r.prompt for r in batch.requests]
        P = [len(p) for p in prompts]
        last_logits, feats = runner.prefill(prompts)
        for b, p in enumerate(prompts):
            batch.ids[b, : len(p)] = torch.as_tensor(p, device=dev)
        batch.length = list(P)
        batch.length_dev.copy_(torch.tensor(P, dtype=torch.int32))
        last_tok = batch.ids.gather(1, (batch.length_dev.long() - 1).unsqueeze(1))
        u = uniforms(B, 1) if batch.sampling is not None else None
        _, _, first = tree_verify(root_only_tree(last_tok.view(B)), last_logits.unsqueeze(1), batch.sampling, u)
        batch.ids.scatter_(1, batch.length_dev.long().unsqueeze(1), first.unsqueeze(1))
        if batch.feats is not None:
            batch.feats[:, : feats.shape[1]] = feats.to(batch.feats.dtype)
            if depth:
                warm_up(self.draft, batch, P, depth)
        return first.tolist()

    @torch.inference_mode()
    def round(self, batch: BatchState, num_nodes: int, depth: int, beam_width: int,
              uniforms: Callable[[int, int], torch.Tensor], lookup: int = 0,
              profile: Optional[Dict[str, List[float]]] = None) -> List[List[int]]:
        """One speculative round for every active row; returns per row (accept_len, new tokens...).

        ``uniforms`` as in :meth:`prefill`; ``lookup``: as :attr:`TreeParams.lookup`; ``profile``: where
        the phases' seconds go (``draft``, ``verify``, ``commit``), or None."""
        dev = self.runner.device
        t = time.perf_counter()
        if depth:
            tree = draft_tree(self.draft, batch, depth, beam_width, num_nodes, spare=lookup)
        else:
            tree = root_only_tree(batch.root_tokens())
        if lookup:
            tree = add_lookup(tree, [r.prompt + r.generated for r in batch.requests], lookup, self.datastore)
        t = record_phase(profile, "draft", t, dev)
        N = tree.tokens.shape[1]
        for r in batch.requests:
            r.draft_tokens += N - 1
        u = uniforms(batch.size, N) if batch.sampling is not None else None
        verdict = verify(self.runner, batch, tree, u)
        t = record_phase(profile, "verify", t, dev)
        packed = commit(self.runner, batch, tree, verdict, max_accept=depth + lookup)
        rows = packed.tolist()  # the round's one host sync
        record_phase(profile, "commit", t, dev)
        return rows

    def apply_round(self, batch: BatchState, rows: List[List[int]], stopper_of) -> None:
        """Book a round's ``rows`` (from :meth:`round`) on the host: accept histograms, committed
        lengths, and each request's new tokens through its stop rules (``stopper_of(request)``)."""
        for b, row in enumerate(rows):
            a, r = row[0], batch.requests[b]
            r.accept_hist[a] += 1
            batch.length[b] += a + 1
            stopper_of(r).append(r, row[1:a + 2], self.context_limit - len(r.prompt))
