"""Load a running ``poss serve``: streaming chat requests at several concurrency levels, a bounded
number per level; prints requests/s and tokens/s as a Markdown table.

    poss serve --target smollm2-135m --max-batch 16 &
    python bench/bench_serve_load.py --url http://127.0.0.1:8000 --concurrency 1 4 16 --requests 32
    PYTHONPATH=.:python pytest bench/bench_serve_load.py --benchmark-disable -q
        (the same client against the app in-process on a tiny random model, seconds)

Each level sends ``--requests`` requests through ``--concurrency`` client tasks (each task sends its
next request when the previous one ends), greedy, ``--max-tokens`` each. Tokens are the server's
``usage.completion_tokens``. A level stops after ``--timeout`` seconds in all.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
import pytest

PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about the sea.", "What is the capital of Japan?",
    "Give three tips for learning to cook.", "Summarise the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?", "List four prime numbers and explain why they are prime.",
    "Describe a sunrise in the mountains.", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
    "Why is the sky blue?", "Write a haiku about autumn.", "How do vaccines work?",
    "Translate 'good morning' into French and Spanish.", "What does a compiler do?", "Name the planets in order.",
]


async def one(client, model, prompt, max_tokens):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens, tau = None, 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - start
            if chunk.get("poss"):
                tau = chunk["poss"]["tau"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - start, first or 0.0, tokens, tau


async def level(url, model, concurrency, requests, max_tokens, timeout, transport=None):
    """``requests`` streamed requests through ``concurrency`` client tasks: ``(results, errors, seconds)``,
    a result ``(latency s, time to first token s, completion tokens, tau)`` per finished request.
    ``transport``: an httpx transport instead of the network (the smoke test's in-process app)."""
    todo = list(range(requests))
    results, errors = [], []

    async def worker(client):
        while todo:
            i = todo.pop(0)
            try:
                results.append(await one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens))
            except Exception as exc:  # counted, reported
                errors.append(str(exc))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport) as client:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), timeout)
        except asyncio.TimeoutError:
            errors.append(f"level timed out after {timeout} s")
        wall = time.perf_counter() - start
    return results, errors, wall


def row(concurrency, results, errors, wall):
    """One table row: concurrency, done, errors, seconds, requests/s, tokens/s, mean latency, median TTFT, tau."""
    tokens = sum(r[2] for r in results)
    taus = [r[3] for r in results if r[3] is not None]
    return (concurrency, len(results), len(errors), wall, len(results) / wall, tokens / wall,
            statistics.mean(r[0] for r in results) if results else 0.0,
            statistics.median(r[1] for r in results) if results else 0.0,
            statistics.mean(taus) if taus else 0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's only model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per level, at most")
    args = p.parse_args(argv)
    model = args.model or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    for c in args.concurrency:
        results, errors, wall = asyncio.run(level(args.url, model, c, args.requests, args.max_tokens, args.timeout))
        rows.append(row(c, results, errors, wall))
        for e in errors[:3]:
            print(f"concurrency {c}: error: {e}", file=sys.stderr)
    print(f"model `{model}`, {args.requests} streaming chat requests per level, max_tokens {args.max_tokens}, greedy\n")
    print("| concurrency | done | errors | seconds | requests/s | tokens/s | mean latency (s) | "
          "median TTFT (s) | tau |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, done, err, wall, rps, tps, lat, ttft, tau in rows:
        print(f"| {c} | {done} | {err} | {wall:.1f} | {rps:.2f} | {tps:.1f} | {lat:.2f} | {ttft:.2f} | {tau:.2f} |")
    return 0 if all(r[2] == 0 for r in rows) else 1


# -- smoke (pytest): the client against the app in-process, on a tiny random model and draft ------------
class _ByteTokenizer:
    """Text as its UTF-8 bytes folded into the tiny model's vocabulary (no chat template: the messages'
    contents are joined)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self):
        return self.vocab

    def __call__(self, text, add_special_tokens=True):
        return type("Encoding", (), {"input_ids": [b % self.vocab for b in text.encode()][:40]})()

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 128 for i in ids).decode("ascii", errors="replace")


@pytest.mark.parametrize("concurrency", [1, 3])
def test_load_tiny_in_process(benchmark, bench_threads, concurrency):
    pytest.importorskip("fastapi")
    from poss.decode.params import TreeParams
    from poss.serve.app import create_app
    from poss.serve.backend import ContinuousBackend
    from poss.serve.engine import Engine
    from poss.testing import make_generator, tiny_target

    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    gen.tokenizer, gen.end_ids = _ByteTokenizer(300), set()
    engine = Engine(ContinuousBackend(gen, max_batch=2, tree=TreeParams(num_nodes=6, depth=2)))
    app = create_app(engine, "tiny")

    async def run():
        async with app.router.lifespan_context(app):
            return await level("http://tiny", "tiny", concurrency, 4, 6, 120, transport=httpx.ASGITransport(app))

    results, errors, wall = benchmark.pedantic(lambda: asyncio.run(run()), rounds=1, iterations=1)
    assert errors == [] and len(results) == 4
    assert all(r[2] == 6 and r[0] > 0 and r[3] >= 1 for r in results)  # max_tokens each, the draft's tau
    c, done, err, _, rps, tps, *_ = row(concurrency, results, errors, wall)
    assert (c, done, err) == (concurrency, 4, 0) and tps == pytest.approx(6 * rps)


if __name__ == "__main__":
    sys.exit(main())
