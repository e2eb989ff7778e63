"""Argument checking shared by the ``poss`` commands, without importing torch.

Every bad input becomes a :class:`UsageError` (or an argparse error, which :class:`Parser` turns into
one) whose message names the ``--flag`` and what was expected; ``poss.cli.main`` prints it as one line
``poss <cmd>: <message>`` and exits 2. The checks here run before any model or data is loaded.
"""

import argparse
import ast
import json
import math
import struct
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple


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

    def parse(text: str):
        if text in words:
            return text
        try:
            return number(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} or {' or '.join(repr(w) for w in words)}") from None

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
    source = (Path(__file__).resolve().parent / "models" / "registry.py").read_text()
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
    """A draft folder holds config.json and a complete model.safetensors."""
    if value is None:
        return
    path = Path(value).expanduser()
    want = "a draft folder with config.json and model.safetensors"
    if not path.exists():
        raise UsageError(f"{flag}: {value!r} does not exist (expected {want})")
    if not path.is_dir():
        raise UsageError(f"{flag}: {value!r} is a file (expected {want})")
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise UsageError(f"{flag}: {value!r} has no {name} (expected {want})")
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
                  "for a registry target, if any), none, or a .npz from scripts/build_datastore.py")


def datastore_arg(value: str):
    """``--datastore``: ``"auto"``, None for ``"none"``, else the path as given (checked on load)."""
    return None if value == "none" else value


DRAFT_VOCAB_HELP = ("the rows of the target's lm_head a reduced-vocabulary draft scores: trained (its own K "
                    "tokens) or full (all: 3-4 %% more tokens per round for the round-8 PosS-2, a draft head "
                    "6x larger; worth it where the head is cheap beside a verify, as on a GPU)")


RETUNE_HELP = ("time tree sizes on this machine now (about a minute, as `poss tune`; refused while other work "
               "holds the cores) and use the result")


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
