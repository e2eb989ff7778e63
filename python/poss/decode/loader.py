"""``poss.load``: a target (registry name, HF folder or .gguf) plus an optional draft -> a Generator."""

from pathlib import Path
from typing import Optional, Union

import torch

from poss.decode.generator import Generator
from poss.decode.params import TreeParams


def load(target: Union[str, Path] = "smollm2-135m", draft: Optional[Union[str, Path]] = None,
         dtype: Union[str, torch.dtype] = "auto", device="cpu", context_limit: Optional[int] = None,
         tree: Union[TreeParams, str] = "auto", compile: bool = False,
         speculate_max_batch: Union[int, str, None] = "auto", retune: bool = False,
         datastore: Union[str, Path, None] = "auto", draft_vocab: str = "trained",
         threads: Union[int, str, None] = "auto") -> Generator:
    """Load the target offline and, when ``draft`` is a PosS draft folder, attach it.

    With ``draft=None`` the generator decodes autoregressively on the same runner (the baseline);
    :func:`poss.models.registry.shipped_draft` names the draft shipped for a registry target.
    ``dtype``: ``"auto"`` (the default) runs in bf16 on CUDA and on CPUs with hardware bf16 (AMX /
    AVX512-BF16) or AVX2 + FMA (``poss.linear``'s AVX2 bf16 kernel), else fp32
    (:func:`poss.hardware.resolve_dtype`), except on a CPU for a target whose GGUF file holds blocks
    poss runs: then the fastest of that float dtype, fp32 and ``"gguf"`` by a short timing of the
    target's weight shapes on this CPU and thread count (once, cached; ``retune`` times again;
    :func:`poss.decode.dtype_choice.choose_dtype`), recorded in the generator's ``dtype_choice``;
    a name (``"bf16"``) or a torch dtype is used as given, and nothing is timed; ``"gguf"`` (CPU
    only, a registry target or a .gguf file) runs the file's own Q8_0 /
    Q4_0 / Q4_1 blocks through :func:`poss_ext.ops.qlinear`, with the activations, the cache and any
    weight in another format in ``"auto"``'s float dtype (:meth:`TargetRunner.weight_formats` says which).
    ``tree``: the generator's ``default_tree``: ``"auto"`` (the default) is the tree
    with the most expected tokens/s by this machine's timing when :func:`poss.decode.autotune.tune`
    (``poss tune``) made one, else the draft's tree shipped for this CPU class and dtype (nothing is
    timed unasked; :meth:`Generator.auto_tree`), or a fixed :class:`TreeParams`.
    ``speculate_max_batch``: the generator's :attr:`~Generator.speculate_max_batch`: calls with more
    live requests decode plainly; ``"auto"`` (the default) is this machine's timing or the shipped
    default likewise, None always speculates. ``retune``: time this machine now (``tune``, about a
    minute; refused with a warning while other work holds the cores; with ``dtype="auto"`` the dtype
    choice too). ``threads``: torch's CPU threads:
    ``"auto"`` (the default) at most the usable cores other work leaves free
    (:func:`poss.hardware.default_threads`; a lower count already set stays), an int, or None to leave
    torch's setting. ``compile``:
    :func:`compile_steps` (off by default: on the development CPU it bought 2-8 % for ~30 s of
    compilation, see docs/benchmarks.md). Raises ``ValueError`` when the draft
    was trained for a different target. ``datastore``: the :class:`~poss.decode.datastore.Datastore`
    whose text fills a round's lookup chain where the context holds none: ``"auto"`` (the default) the
    one shipped for a registry target (:func:`~poss.decode.datastore.shipped_datastore_path`) when
    it was made by these weights, else none; a ``.npz`` path; or None for none. Raises
    ``ValueError`` when a given datastore records another target. ``draft_vocab``: the rows of the
    target's lm_head the draft scores: ``"trained"`` (the default), its own K, or ``"full"``, all of them
    (:meth:`PosSDraft.load`: more tokens per round, a slower draft head).
    """
    from poss.hardware import resolve_dtype
    from poss.models.draft import PosSDraft
    from poss.models.registry import load_model, resolve
    from poss.models.target import TargetRunner

    set_threads(threads, device)
    if not (isinstance(dtype, str) and dtype in ("auto", "gguf")):
        resolve_dtype(dtype, device)  # a bad dtype is refused before anything loads
    path = resolve(target)  # fetches and converts a registry target's file first
    choice = None
    if dtype == "auto":
        from poss.decode.dtype_choice import choose_dtype

        # A fixed tree verifies its own rows (num_nodes + lookup); "auto" trees, the shipped CPU trees'.
        rows = {} if not isinstance(tree, TreeParams) or tree.num_nodes + tree.lookup < 2 else {
            "verify_rows": tree.num_nodes + tree.lookup}
        choice = choose_dtype(local_gguf(target), draft is not None, retune=retune, device=device, **rows)
        dtype = choice.dtype
    blocks = None
    if dtype == "gguf":
        blocks = gguf_blocks(target, device)
        dtype = "auto"
    dtype = resolve_dtype(dtype, device)
    # An fp16 runner converts from fp32 weights, whose fingerprint matches the drafts' (TargetRunner).
    tokenizer, model = load_model(path, dtype=torch.float32 if dtype == torch.float16 else dtype, device=device)
    # Small initial caches: the generator grows them to each call's batch and length.
    runner = TargetRunner(model, max_batch=1, max_seq=256, dtype=dtype,
                          quantized=None if blocks is None else blocks(model.config))
    d = None
    if draft is not None:
        d = PosSDraft.load(draft, dtype=dtype, device=device, vocab=draft_vocab)
        # An EAGLE-3 draft reads several target layers: the runner returns them in the same pass.
        runner.set_feature_layers(d.feature_layers_for(len(runner.layers)))
        d.attach(runner, max_batch=1, max_seq=256)
    gen = Generator(runner, tokenizer=tokenizer, draft=d, context_limit=context_limit, target_path=path,
                    generation_config=getattr(model, "generation_config", None),
                    datastore=load_datastore(datastore, target, runner))
    gen.draft_dir = Path(draft) if draft is not None else None
    gen.dtype_choice = choice
    gen.default_tree = tree
    gen.speculate_max_batch = speculate_max_batch
    if compile:
        compile_steps(gen)  # before timing: compiled steps cost differently
    if retune:
        import warnings

        from poss.decode.autotune import MachineBusy, tune

        try:
            tune(gen)
        except MachineBusy as e:
            warnings.warn(f"retune: {e}", RuntimeWarning, stacklevel=2)
    return gen


def set_threads(threads: Union[int, str, None], device="cpu") -> None:
    """Set torch's CPU threads as ``poss.load``'s ``threads`` says (on a CPU device only); ``ValueError``
    for anything but an int >= 1, ``"auto"`` or None."""
    from poss.hardware import default_threads

    if not (threads is None or threads == "auto"
            or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1)):
        raise ValueError(f"threads must be an int >= 1, 'auto' or None, got {threads!r}")
    if threads is None or torch.device(device).type != "cpu":
        return
    # "auto" only lowers: a count the caller (or OMP_NUM_THREADS) set lower stays.
    torch.set_num_threads(min(torch.get_num_threads(), default_threads()) if threads == "auto" else threads)


def local_gguf(target: Union[str, Path]) -> Optional[Path]:
    """The GGUF file behind ``target`` when it is on this machine (a registry target's fetched file, a
    .gguf path), else None: ``dtype="auto"`` never downloads a file to time it."""
    from poss.models.registry import REGISTRY, gguf_path

    if isinstance(target, str) and target in REGISTRY:
        path = gguf_path(target)
        return path if path.is_file() else None
    path = Path(target).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def gguf_blocks(target: Union[str, Path], device):
    """For ``dtype="gguf"``: a function of the HF config -> the target file's linear weights in blocks
    (:func:`poss.models.gguf_weights.read_gguf_linears`). Raises ``ValueError`` for a target without a
    GGUF file or a device other than the CPU."""
    from poss.models.gguf_weights import read_gguf_linears
    from poss.models.registry import gguf_file

    if torch.device(device).type != "cpu":
        raise ValueError(f"dtype 'gguf' runs on the CPU only (poss_ext.ops.qlinear), got device {device!r}")
    path = gguf_file(target)
    if path is None:
        raise ValueError(f"dtype 'gguf' needs a GGUF target (a registry name or a .gguf file), got {target!r}")
    return lambda config: read_gguf_linears(path, config.num_attention_heads, config.num_key_value_heads).blocks


def load_datastore(datastore: Union[str, Path, None], target: Union[str, Path], runner):
    """The :class:`~poss.decode.datastore.Datastore` that ``poss.load``'s ``datastore`` names for
    ``target`` (see there), or None."""
    from poss.decode.datastore import Datastore, shipped_datastore_path

    if datastore is None:
        return None
    auto = datastore == "auto"
    path = shipped_datastore_path(str(target)) if auto else Path(datastore)
    if path is None:
        return None
    if not auto and not path.is_file():
        raise ValueError(f"datastore: no file at {path} (expected a .npz from `poss datastore build`, "
                         "'auto' or None)")
    store = Datastore.load(path)
    made_by = store.meta.get("target_fingerprint")
    if made_by is not None and made_by != runner.fingerprint():
        if auto:
            return None  # a registry name bound to other weights: no shipped text for them
        raise ValueError(f"datastore {path} was made by target weights {made_by}, this target is "
                         f"{runner.fingerprint()}")
    return store


def compile_steps(gen: Generator) -> Generator:
    """``torch.compile`` the target forward and the draft step of ``gen`` (in place; returns it).

    Inductor writes C++ around the fused ``poss::decoder_layer`` / ``specialist_forward`` ops on a
    CPU (they stay extern calls, through their fake kernels) and Triton kernels plus CUDA graphs
    (``mode="reduce-overhead"``) on a GPU. Shapes are left to Dynamo's automatic dynamic marking (a
    dimension that changes becomes symbolic at its first recompile): with ``dynamic=True`` the second
    and later prompts diverged from eager decoding at their second token (tests/decode/test_loop_greedy.py
    ``test_compiled_steps_stay_lossless`` catches it), with the automatic marking they match. The
    first calls compile (about a minute on a small CPU).
    """
    cuda = gen.runner.device.type == "cuda"
    mode = "reduce-overhead" if cuda else None
    if cuda:
        # A CUDA graph copies each input that is not at a fixed address into its own buffer at every
        # replay. The runner's weights and the tensors a draft borrows from it are plain tensors (not
        # nn.Parameters, which Dynamo takes as fixed), so unmarked, every decode step copied all of a
        # Llama-3-8B's 15 GB (H200, 2026-12-04: 18.5 ms a step against 10.2 ms eager).
        from torch._dynamo import mark_static_address

        borrowed = [] if gen.draft is None else list(gen.draft.target)
        for t in gen.runner.weights() + borrowed:
            mark_static_address(t)
    gen.runner.forward = torch.compile(gen.runner.forward, dynamic=None, mode=mode)
    if gen.draft is not None:
        # One graph per specialist index j (an int that picks a module), each also seen at a few
        # tree widths: the default limit of 8 sent the 60/6 draft back to eager on the H200 run.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   4 * gen.draft.config.n_specialists + 8)
        gen.draft.step = torch.compile(gen.draft.step, dynamic=None, mode=mode)
    gen.compiled = True
    return gen
