"""When a request stops, and what text it may show so far.

A request stops at an end token (EOS or the chat template's end-of-turn token, kept in the token
list like ``transformers`` does), at ``max_new_tokens``, at the context limit, or at a user stop
string (the text is cut right before it). Streaming never shows text that a stop string could
still take back, nor half a UTF-8 character.
"""

from typing import Iterable, List, Optional, Sequence, Set

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def end_token_ids(tokenizer, generation_config=None) -> Set[int]:
    """EOS ids of the tokenizer and generation config, plus known end-of-turn tokens in the vocab."""
    ids: Set[int] = set()

    def add(x):
        if x is None:
            return
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            ids.add(int(i))

    if generation_config is not None:
        add(getattr(generation_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        for name in END_OF_TURN_TOKENS:
            if name in vocab and (name != "<|endoftext|>" or tokenizer.eos_token == name):
                ids.add(vocab[name])
    return ids


class Stopper:
    """Applies the stop rules to one request's growing token list."""

    def __init__(self, end_ids: Iterable[int], stop_strings: Sequence[str], decode):
        self.end_ids = set(end_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.decode = decode

    def append(self, req, tokens: List[int], context_left: int) -> None:
        """Append ``tokens`` to ``req.generated`` up to the first stop; mark ``req`` finished."""
        start = len(req.generated)
        for tok in tokens:
            req.generated.append(tok)
            reason = ("eos" if tok in self.end_ids else
                      "length" if len(req.generated) >= req.max_new_tokens else
                      "context" if len(req.generated) >= context_left else None)
            if reason is not None:
                req.finished, req.finish_reason = True, reason
                break
        if self.stop_strings and self.decode is not None:
            self._check_strings(req, start)

    def _check_strings(self, req, start: int) -> None:
        # A stop string can end in any of the new tokens: find the first token that completes one.
        for k in range(start + 1, len(req.generated) + 1):
            cut = first_stop(self.decode(req.generated[:k]), self.stop_strings)
            if cut is not None:
                del req.generated[k:]
                req.text_end = cut
                req.finished, req.finish_reason = True, "stop"
                return


def first_stop(text: str, stop_strings: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def safe_text(text: str, stop_strings: Sequence[str], finished: bool) -> str:
    """The part of ``text`` that can be shown now (all of it once the request finished)."""
    if finished:
        return text
    if text.endswith("\ufffd"):  # a multi-byte character not yet complete
        text = text.rstrip("\ufffd")
    hold = 0
    for s in stop_strings:  # a suffix that may still grow into a stop string
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold]
