"""The arguments the ``poss`` commands share, declared once, and their checks, without importing torch.

The model flags (:func:`add_target`, :func:`add_draft`, :func:`add_dtype`, :func:`add_threads`,
:func:`add_device`), the draft tree flags (:func:`add_tree`) and the sampling flags
(:func:`add_sampling`) are each declared here once, so every command spells, checks and explains them
the same way. Every bad input becomes a :class:`UsageError` (or an argparse error, which :class:`Parser`
turns into one) whose message names the ``--flag`` and what was expected; :func:`poss.cli.main` prints it
as one line ``poss <cmd>: <message>`` and exits 2. The checks here run before any model or data is loaded.
"""

import argparse
import ast
import json
import math
import struct
import sys
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Tuple


def _op_limits():
    """``poss_ext/limits.py`` (plain constants) read without importing ``poss_ext``, whose ``__init__``
    loads torch and the kernels: building the parser must stay fast for ``poss --help``."""
    import importlib.util

    package = importlib.util.find_spec("poss_ext")  # finds the package without running it
    path = Path(list(package.submodule_search_locations)[0]) / "limits.py"
    spec = importlib.util.spec_from_file_location("poss_ext_limits_for_the_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAX_TREE_NODES = _op_limits().MAX_TREE_NODES


class UsageError(Exception):
    """A bad command-line input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``UsageError``), not usage + exit."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` for every option, unless it is unset by default or its help says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, []) or action.default is argparse.SUPPRESS or "default" in text:
            return action.help  # nothing to show, or the help already says it
        return super()._get_help_string(action)


# -- value types for add_argument(type=...): argparse names the flag in the message ---------------

def position_counts(text: str) -> List[int]:
    """``"1,5"`` -> ``[1, 5]``: positive integers, comma-separated (a specialist schedule)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,5, got {text!r}")
    return values


position_counts.__name__ = "list of positions"


def layer_indices(text: str) -> List[int]:
    """``"2,15,27"`` -> ``[2, 15, 27]``: non-negative integers, comma-separated (target hidden-state indices)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,15,27, got {text!r}")
    return values


layer_indices.__name__ = "list of layer indices"


def int_at_least(low: int, high: Optional[int] = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            want = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def int_or_auto(low: int, high: Optional[int] = None, words: Tuple[str, ...] = ("auto",)):
    """An ``int_at_least(low, high)`` that also takes the word ``auto`` (or any of ``words``; kept as
    the string)."""
    number = int_at_least(low, high)

    want = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    want += "".join(f" or {w!r}" for w in words)

    def parse(text: str):
        if text in words:
            return text
        try:
            return number(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None

    parse.__name__ = "int or auto"
    return parse


_LOOKUP = ("prompt lookup: merge up to this many tokens, copied from the context after the latest earlier match of "
           "its last 1-3 tokens, into every round's tree")
LOOKUP_HELP = _LOOKUP + (" (0: off; auto: timed with the tree when the tree is auto, else 0; output unchanged, "
                         "only speed)")
LOOKUP_HELP_FIXED = _LOOKUP + " (0: off; output unchanged, only speed)"  # where the tree is fixed: no auto


def float_in(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        if not ok:
            lo = f"{'(' if low_open else '['}{low:g}"
            want = f"a number > {low:g}" if low_open else f"a number >= {low:g}"
            if high != math.inf:
                want = f"a number in {lo}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


# -- models and folders ------------------------------------------------------------------------

@lru_cache(maxsize=None)
def registry_names() -> Tuple[str, ...]:
    """The registry's target names, read from ``poss/models/registry.py`` without importing it (it
    imports torch, and ``poss --help`` must stay fast)."""
    source = (Path(__file__).resolve().parents[1] / "models" / "registry.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REGISTRY" for t in node.targets):
            return tuple(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return ()


def check_safetensors(path: Path) -> None:
    """Raise ``UsageError`` naming ``path`` when it is not a complete safetensors file (header only)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UsageError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise UsageError(f"{path} is truncated: its header needs {8 + n} bytes, the file has {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"{path} is not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path} is not a safetensors file (bad header)")
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2]
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise UsageError(f"{path} is truncated: {need} bytes expected, the file has {size}")


def check_draft(value: Optional[str], flag: str = "--draft") -> None:
    """A draft folder holds config.json and its weights: ``model.safetensors`` (a poss draft), or a published
    draft's ``model.safetensors`` / ``pytorch_model.bin``, whole or sharded (with its index)."""
    if value is None:
        return
    path = Path(value).expanduser()
    want = "a draft folder with config.json and model.safetensors (or a published draft's pytorch_model.bin)"
    if not path.exists():
        raise UsageError(f"{flag}: {value!r} does not exist (expected {want})")
    if not path.is_dir():
        raise UsageError(f"{flag}: {value!r} is a file (expected {want})")
    if not (path / "config.json").is_file():
        raise UsageError(f"{flag}: {value!r} has no config.json (expected {want})")
    weights = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")
    if not any((path / name).is_file() for name in weights):
        raise UsageError(f"{flag}: {value!r} has no model.safetensors (expected {want})")
    if (path / "model.safetensors").is_file():
        check_safetensors(path / "model.safetensors")


def check_target(value: str, flag: str = "--target") -> None:
    """A registry name, an HF folder with config.json (its safetensors complete), or a .gguf file."""
    if value in registry_names():
        return
    path = Path(value).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir() and (path / "config.json").is_file():
        for weights in sorted(path.glob("*.safetensors")):
            check_safetensors(weights)
        return
    raise UsageError(f"{flag}: {value!r} is neither a registry name ({', '.join(registry_names())}), "
                     "an HF model folder with config.json, nor a .gguf file")


DATASTORE_HELP = ("where a lookup chain comes from when the context holds no match: auto (the datastore shipped "
                  "for a registry target, if any), none, or a .npz from `poss datastore build`")


def datastore_arg(value: str):
    """``--datastore``: ``"auto"``, None for ``"none"``, else the path as given (checked on load)."""
    return None if value == "none" else value


DRAFT_VOCAB_HELP = ("the rows of the target's lm_head a reduced-vocabulary draft scores: trained (its own K "
                    "tokens) or full (all: 3-4 %% more tokens per round for the round-8 PosS-2, a draft head "
                    "6x larger; worth it where the head is cheap beside a verify, as on a GPU)")


RETUNE_HELP = ("time tree sizes on this machine now (about a minute, as `poss tune`; refused while other work "
               "holds the cores) and use the result; with --dtype auto, time the dtype choice again too")


def target_help() -> str:
    return f"registry name ({', '.join(registry_names())}), HF model folder or .gguf file"


def one_line(exc: BaseException) -> str:
    """An exception as one line of text (library messages may span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (FileNotFoundError, PermissionError)) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def chosen_draft(args, prog: str):
    """The draft a command runs with: ``--draft``, else the target's shipped draft, or None with
    ``--no-draft`` (a notice says so when the target has no shipped draft)."""
    if args.no_draft:
        return None
    from poss.models.registry import shipped_draft

    draft = args.draft or shipped_draft(args.target)
    if draft is None:
        print(f"{prog}: no trained draft exists for target {args.target!r} (none in drafts/); running without "
              "one. Pass --draft DIR, or --no-draft to silence this.", file=sys.stderr)
    return draft


def nonempty_text(text: str) -> str:
    """A ``--prompt``: text with something in it besides whitespace."""
    if not text.strip():
        got = "an empty one" if not text else "only whitespace"
        raise argparse.ArgumentTypeError(f"expected a non-empty message, got {got}")
    return text


nonempty_text.__name__ = "text"


def device_arg(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (checked here; whether CUDA is there is found out when loading)."""
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


device_arg.__name__ = "device"


# -- argument groups: each flag is declared here once -------------------------------------------------

DEFAULT_TARGET = "smollm2-135m"

# --dtype has one choice list per meaning: choices, default, help.
DTYPES = {
    # The models' dtype at inference (poss.hardware.resolve_dtype).
    "run": (("auto", "float32", "bfloat16", "float16", "gguf"), "auto",
            "the models' weights and activations; auto: bfloat16 on CUDA or a CPU with AMX, AVX512-BF16 or "
            "AVX2+FMA, else float32, except for a GGUF target with Q8_0/Q4_0/Q4_1 blocks on a CPU: the fastest "
            "of those, float32 and gguf, timed once per machine and threads (a second or two; --retune times "
            "again); gguf: the GGUF file's own Q8_0/Q4_0/Q4_1 blocks (CPU), other weights as auto's float dtype"),
    # Training runs torch's own GEMMs (bf16 fast only with hardware bf16) and has no fp16 loss scaling.
    "train": (("auto", "float32", "bfloat16"), "auto",
              "target features and mixed precision; auto: bfloat16 on CUDA or a CPU with AMX/AVX512-BF16, "
              "else float32"),
    # A data set records the dtype its answers were made in: a concrete one, never auto.
    "data": (("float32", "bfloat16"), None,
             "the dtype the target runs in at inference (default: float32; with --rebuild-features, the dtype "
             "the data set's features were made in, from its meta.json)"),
}


def add_datastore(p) -> None:
    p.add_argument("--datastore", type=datastore_arg, default="auto", help=DATASTORE_HELP)


def add_draft_vocab(p, extra_help: str = "") -> None:
    p.add_argument("--draft-vocab", choices=draft_vocabs(), default="trained", help=DRAFT_VOCAB_HELP + extra_help)


def add_target(p, default: Optional[str] = DEFAULT_TARGET, required: bool = False, what: str = "") -> None:
    p.add_argument("--target", default=None if required else default, required=required,
                   help=what + target_help())


def add_draft(p) -> None:
    """``--draft DIR`` and ``--no-draft`` (see :func:`chosen_draft`)."""
    p.add_argument("--draft", default=None,
                   help="PosS draft folder (config.json + model.safetensors); default: the one shipped for the target")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the baseline)")


def add_dtype(p, meaning: str = "run", extra_help: str = "") -> None:
    choices, default, text = DTYPES[meaning]
    p.add_argument("--dtype", default=default, choices=choices, help=text + extra_help)


def add_threads(p) -> None:
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: the cores other work leaves free, by the load average; more "
                        "threads than free cores thrash: 2.3 against 33.6 tokens/s on a busy 2-core machine)")


def add_device(p, default: Optional[str], extra_help: str = "") -> None:
    p.add_argument("--device", type=device_arg, default=default, help="cpu, cuda or cuda:N" + extra_help)


def add_speculate_max_batch(p, what: str) -> None:
    p.add_argument("--speculate-max-batch", type=int_or_auto(1, words=("auto", "off")), default="auto",
                   help=f"speculate only while at most this many {what} are live; larger batches decode plainly "
                        "(auto: measured once on this machine; off: always speculate)")


TREE_FLAGS = {"num_nodes": "--num-nodes", "depth": "--depth", "beam_width": "--beam-width", "lookup": "--lookup"}


def tree_from_args(args):
    """The ``TreeParams`` (or ``"auto"``) of :func:`add_tree`'s flags; a tree over the kernel's limits is a
    ``UsageError`` naming the flags (imports torch: call it once the cheap checks have passed)."""
    import re

    from poss.decode.params import tree_from_flags

    try:
        return tree_from_flags(args.num_nodes, args.depth, args.beam_width, args.lookup)
    except ValueError as e:
        raise UsageError(re.sub(r"\b(num_nodes|depth|beam_width|lookup)\b", lambda m: TREE_FLAGS[m.group(1)],
                                str(e))) from None


def add_beam_width(p) -> None:
    p.add_argument("--beam-width", "--top-k-draft", dest="beam_width", type=int_at_least(1), default=10,
                   help="children kept per frontier node and frontier size per level (EAGLE's top-k)")


def add_tree(p, auto: bool = True, vocab_help: str = ""):
    """The draft tree flags. ``auto``: each size may be ``auto`` (timed on this machine), and the lookup
    datastore and ``--retune`` come with them; else fixed sizes (the paper's comparison runs fixed trees)."""
    if auto:
        t = p.add_argument_group(
            "draft tree (auto: the size with the most expected tokens/s on this machine, timed once per machine, "
            "dtype and draft, then cached; a size given alone takes 60 / 6 for the other)")
        t.add_argument("--num-nodes", type=int_or_auto(1, MAX_TREE_NODES), default="auto",
                       help="nodes verified per round, root included")
        t.add_argument("--depth", type=int_or_auto(0), default="auto", help="draft positions below the root")
    else:
        t = p.add_argument_group("draft tree (fixed sizes)")
        t.add_argument("--num-nodes", type=int_at_least(2, MAX_TREE_NODES), default=60,
                       help="nodes verified per round, root included")
        t.add_argument("--depth", type=int_at_least(1), default=6, help="draft positions below the root")
    add_beam_width(t)
    if auto:
        t.add_argument("--lookup", type=int_or_auto(0), default="auto", help=LOOKUP_HELP)
        add_datastore(t)
    else:
        t.add_argument("--lookup", type=int_at_least(0), default=0, help=LOOKUP_HELP_FIXED)
    add_draft_vocab(t, vocab_help)
    if auto:
        t.add_argument("--retune", action="store_true", help=RETUNE_HELP)
    return t


def add_sampling(p, filters: bool = True, seed_default: Optional[int] = None):
    """``--temperature`` and ``--seed``, and with ``filters`` top-k / top-p / min-p."""
    s = p.add_argument_group("sampling (per request; temperature 0 is greedy and the filters need > 0)" if filters
                             else "sampling")
    s.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy; > 0: sample")
    if filters:
        s.add_argument("--top-k", type=int_at_least(0), default=0, help="keep the k most likely tokens (0: off)")
        s.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0,
                       help="nucleus mass to keep (1: off)")
        s.add_argument("--min-p", type=float_in(0, 1), default=0.0,
                       help="keep tokens at least this fraction as likely as the most likely one (0: off)")
    s.add_argument("--seed", type=int, default=seed_default,
                   help="makes sampling reproducible" + (" (default: a fresh seed)" if seed_default is None else ""))
    return s


def draft_vocabs() -> Tuple[str, ...]:
    from poss.models.draft_config import DRAFT_VOCABS  # imports no torch

    return DRAFT_VOCABS


def model_dtype(args, device: str = "cpu"):
    """``--dtype`` as ``poss.load`` takes it: ``"gguf"`` (the file's blocks) and ``"auto"`` (poss.load picks,
    timing a GGUF target's formats on a CPU) as given, else a torch dtype."""
    from poss.hardware import resolve_dtype

    return args.dtype if args.dtype in ("gguf", "auto") else resolve_dtype(args.dtype, device)


def set_threads(args) -> None:
    """``--threads``, applied (imports torch: call it once the checks have passed)."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def check_model(args) -> None:
    """The checks of :func:`add_target` and :func:`add_draft`'s flags (no model is loaded)."""
    if getattr(args, "draft", None) is not None and getattr(args, "no_draft", False):
        raise UsageError("--draft and --no-draft exclude each other")
    check_target(args.target)
    check_draft(getattr(args, "draft", None))
