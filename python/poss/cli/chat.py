"""``poss chat``: an interactive multi-turn conversation in the terminal."""

import sys

from poss.cli.args import Formatter, UsageError
from poss.cli.generate import add_model_and_decoding, check_context, load, options, speed_line


def add_parser(sub):
    p = sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=Formatter)
    add_model_and_decoding(p)
    return p


def chat_loop(gen, opts, read=None, out=None, err=None, speed=None) -> int:
    """The chat session: one answer per line read until an empty line, Ctrl-D or Ctrl-C at the prompt
    (all exit 0). Ctrl-C during an answer stops that answer (what was shown stays in the conversation)
    and returns to the prompt; a message over the context is reported and dropped. ``speed``: the
    stats line after each answer (default :func:`speed_line`)."""
    read = read or input  # looked up per call, so a patched ``input`` is honoured
    out = out or sys.stdout
    err = err or sys.stderr
    speed = speed or speed_line
    messages = []
    print("poss chat: empty line or Ctrl-D to quit, Ctrl-C to stop an answer, /reset to start over.", file=err)
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=out, flush=True)
            return 0
        if not line:
            return 0
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        try:
            check_context(gen, [messages], "your message")
        except UsageError as e:
            messages.pop()
            print(f"poss chat: {e}", file=err)
            continue
        print("assistant> ", end="", flush=True, file=out)
        shown = []
        stream = gen.stream(messages, **opts)
        try:
            for piece in stream:
                shown.append(piece)
                print(piece, end="", flush=True, file=out)
        except KeyboardInterrupt:
            stream.close()
            print(file=out, flush=True)
            print("[answer stopped]", file=err)
            if shown:
                messages.append({"role": "assistant", "content": "".join(shown)})
            else:
                messages.pop()
            continue
        print(file=out)
        messages.append({"role": "assistant", "content": gen.last_result.texts[0]})
        print(speed(gen.last_result, gen), file=err)


def run(args) -> int:
    opts = options(args)
    return chat_loop(load(args), opts)
