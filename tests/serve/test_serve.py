"""``poss serve`` against a live server on 127.0.0.1 (a child process with a tiny random model saved
as a folder), through the official ``openai`` client and raw HTTP: streamed = non-streamed =
``poss.load(...).generate`` for greedy requests, usage and the ``poss`` object, 16 concurrent streams
against ``--max-batch 8``, one test per bad input, client disconnects, metrics, Ctrl-C."""

import asyncio
import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from helpers.serve import running_server  # noqa: E402

TREE = dict(num_nodes=10, depth=3, beam_width=3)
MODEL = "tiny"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama + ChatML byte tokenizer saved as an HF folder, and a random PosS draft."""
    from helpers.targets import tiny_chat_folder

    torch.set_num_threads(1)
    return tiny_chat_folder(tmp_path_factory.mktemp("serve"), [("draft", 3, 0)])


@pytest.fixture(scope="module")
def reference(folder):
    """The same model through ``poss.load`` in this process: what the server must answer."""
    import poss

    torch.set_num_threads(1)
    return poss.load(folder / "target", draft=folder / "draft")  # dtype "auto", as the server's default


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    args = ["--target", folder / "target", "--draft", folder / "draft", "--served-model-name", MODEL,
            "--max-batch", 8, "--max-queue", 32, "--num-nodes", TREE["num_nodes"], "--depth", TREE["depth"],
            "--beam-width", TREE["beam_width"], "--default-max-tokens", 32]
    with running_server(args, log) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def expect(reference, prompt, max_tokens, **kw):
    """``generate`` for one prompt (messages list, or token ids for a raw completion)."""
    res = reference.generate([prompt], max_tokens, temperature=0.0, **TREE, **kw)
    return res.texts[0], res.stats[0], res.token_ids[0]


def raw_ids(reference, text):
    return list(reference.tokenizer(text).input_ids)


# -- the happy paths --------------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert server.health()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["poss"]["context_limit"] == 256


def test_chat_streamed_equals_non_streamed_equals_generate(server, client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about llamas."}]
    want, stats, ids = expect(reference, messages, 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if stats.finish_reason == "length" else "stop")
    prompt_tokens = len(reference.encode(messages))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, len(ids))
    assert r.usage.total_tokens == prompt_tokens + len(ids)
    poss = r.model_extra["poss"]
    assert poss["accept_hist"] == stats.accept_hist and poss["tau"] == pytest.approx(stats.tau)
    assert poss["tau"] >= 1.0 and sum(poss["accept_hist"]) == poss["rounds"] == stats.rounds

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert finals[0].model_extra["poss"]["accept_hist"] == stats.accept_hist
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_streamed_equals_non_streamed_equals_generate(client, reference):
    prompt = "The capital of France is"
    want, stats, ids = expect(reference, raw_ids(reference, prompt), 16)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(raw_ids(reference, prompt)) and r.usage.completion_tokens == len(ids)
    assert r.model_extra["poss"]["accept_hist"] == stats.accept_hist
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # a prompt given as token ids is taken as is
    r2 = client.completions.create(model=MODEL, prompt=raw_ids(reference, prompt), max_tokens=16, temperature=0)
    assert r2.choices[0].text == want


def test_stop_strings_cut_the_text(client, reference):
    prompt = "Once upon a time"
    ids = raw_ids(reference, prompt)
    full, _, _ = expect(reference, ids, 24)
    # a stop string from the middle of the greedy answer (printable, so it survives JSON and decoding)
    cut = next((i for i in range(2, len(full) - 1) if full[i].isprintable() and full[i] != "\ufffd"), None)
    assert cut is not None, full
    stop = full[cut]
    want, stats, _ = expect(reference, ids, 24, stop=[stop])
    assert stats.finish_reason == "stop" and want == full[: full.index(stop)]
    for stop_arg in (stop, [stop, "never-appears"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop_arg)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_default_max_tokens_and_sampling_with_a_seed(client):
    r = client.completions.create(model=MODEL, prompt="abc", temperature=0)
    assert r.usage.completion_tokens <= 32  # --default-max-tokens 32
    kw = dict(model=MODEL, prompt="Write a poem", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    a = client.completions.create(**kw, extra_body={"top_k": 50})
    b = client.completions.create(**kw, extra_body={"top_k": 50})
    assert a.choices[0].text == b.choices[0].text  # same seed, same answer


def test_sixteen_concurrent_streams_against_max_batch_8(server, reference):
    prompts = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(16)]
    lengths = [12 if i % 4 else 20 for i in range(16)]  # two groups of requests
    want = [expect(reference, [{"role": "user", "content": p}], n)[0] for p, n in zip(prompts, lengths)]

    async def one(c, p, n):
        stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                 max_tokens=n, temperature=0, stream=True)
        text, reasons = [], []
        async for chunk in stream:
            text.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        return "".join(text), [x for x in reasons if x]

    async def run():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 120)
        finally:
            await c.close()

    def steps_above(n):  # engine steps that decoded more than n requests together
        text = httpx.get(server.url + "/metrics", timeout=10).text
        count = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("poss_batch_size_bucket")}
        return count["+Inf"] - count[f"{float(n)}"]

    before = steps_above(4), steps_above(8)
    got = asyncio.run(run())
    assert [g[0] for g in got] == want
    assert steps_above(4) > before[0] and steps_above(8) == before[1]  # batches of up to 8, never more
    assert all(len(g[1]) == 1 for g in got)  # each ended exactly once
    h = server.wait_idle()
    assert (h["status"], h["open_requests"], h["active"], h["queue_depth"]) == ("ok", 0, 0, 0)


def test_a_request_arriving_mid_batch_joins_it_and_finishes_first(server, reference):
    """Continuous batching: a short request sent while a long one decodes is admitted into the running
    batch and ends long before it (it does not wait for the batch); both answers stay exact."""
    long_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    short_body = {"model": MODEL, "prompt": "fresh", "max_tokens": 6, "temperature": 0}
    want_long, long_stats, _ = expect(reference, raw_ids(reference, long_body["prompt"]), 200)
    want_short, _, _ = expect(reference, raw_ids(reference, short_body["prompt"]), 6)
    assert long_stats.tokens > 60  # long enough to still be decoding when the short one is done

    async def run():
        started, order = asyncio.Event(), []
        async with httpx.AsyncClient(timeout=120) as c:
            async def long():
                text = []
                async with c.stream("POST", server.base_url + "/completions", json=dict(long_body, stream=True)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            started.set()
                order.append("long")
                return "".join(text)

            async def short():
                await started.wait()  # the long request is decoding now
                r = await c.post(server.base_url + "/completions", json=short_body)
                order.append("short")
                return r.json()["choices"][0]["text"]

            long_text, short_text = await asyncio.wait_for(asyncio.gather(long(), short()), 120)
        return order, long_text, short_text

    order, long_text, short_text = asyncio.run(run())
    assert order == ["short", "long"]
    assert short_text == want_short and long_text == want_long
    h = server.wait_idle()
    assert (h["open_requests"], h["active"], h["queue_depth"]) == (0, 0, 0)


# -- bad input: one case each -------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def with_(body, **kw):
    out = dict(body)
    for k, v in kw.items():
        if v is ...:
            out.pop(k, None)
        else:
            out[k] = v
    return out


BAD = {
    "malformed_json": ("chat", b'{"model": "tiny", "messages": [', 400, None),
    "not_an_object": ("chat", b'[1, 2]', 400, None),
    "missing_model": ("chat", with_(CHAT, model=...), 400, "model"),
    "missing_messages": ("chat", with_(CHAT, messages=...), 400, "messages"),
    "missing_prompt": ("completions", with_(COMP, prompt=...), 400, "prompt"),
    "missing_role": ("chat", with_(CHAT, messages=[{"content": "hi"}]), 400, "messages[0].role"),
    "messages_wrong_type": ("chat", with_(CHAT, messages="hi"), 400, "messages"),
    "max_tokens_wrong_type": ("chat", with_(CHAT, max_tokens="4"), 400, "max_tokens"),
    "temperature_wrong_type": ("completions", with_(COMP, temperature="hot"), 400, "temperature"),
    "stop_wrong_type": ("completions", with_(COMP, stop=5), 400, "stop"),
    "stream_wrong_type": ("chat", with_(CHAT, stream="yes"), 400, "stream"),
    "max_tokens_negative": ("chat", with_(CHAT, max_tokens=-5), 400, "max_tokens"),
    "max_tokens_zero": ("completions", with_(COMP, max_tokens=0), 400, "max_tokens"),
    "max_completion_tokens_negative": ("chat", with_(CHAT, max_completion_tokens=-1), 400, "max_completion_tokens"),
    "temperature_negative": ("chat", with_(CHAT, temperature=-0.5), 400, "temperature"),
    "top_p_zero": ("chat", with_(CHAT, top_p=0), 400, "top_p"),
    "top_p_over_one": ("completions", with_(COMP, top_p=1.5), 400, "top_p"),
    "top_k_negative": ("chat", with_(CHAT, top_k=-1), 400, "top_k"),
    # valid JSON numbers that would overflow the float32 / int32 sampler or the 64-bit seed in the batch
    "temperature_tiny": ("chat", with_(CHAT, temperature=1e-39), 400, "temperature"),
    "top_k_over_int32": ("chat", with_(CHAT, top_k=2 ** 40, temperature=1), 400, "top_k"),
    "top_p_rounds_to_zero": ("completions", with_(COMP, top_p=1e-50, temperature=1), 400, "top_p"),
    "seed_over_64_bits": ("completions", with_(COMP, seed=2 ** 64, temperature=1), 400, "seed"),
    "n_two": ("chat", with_(CHAT, n=2), 400, "n"),
    "prompt_longer_than_context": ("completions", with_(COMP, prompt="word " * 300), 400, "prompt"),
    "chat_longer_than_context": ("chat", with_(CHAT, messages=[{"role": "user", "content": "x" * 400}]), 400,
                                 "messages"),
    "unknown_model": ("chat", with_(CHAT, model="gpt-17"), 404, "model"),
    "oversized_body": ("completions", with_(COMP, prompt="x" * (2 << 20)), 413, None),
    "unsupported_logprobs": ("chat", with_(CHAT, logprobs=True), 400, "logprobs"),
    "stream_options_without_stream": ("chat", with_(CHAT, stream_options={"include_usage": True}), 400,
                                      "stream_options"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_an_openai_error_and_the_server_stays_up(server, case):
    endpoint, body, status, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.base_url}/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                   content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if case.endswith("context"):
        assert err["code"] == "context_length_exceeded"
    assert server.health()["status"] == "ok"


def test_bad_input_through_the_client_raises_its_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_unknown_route_and_method_are_openai_errors(server):
    r = httpx.get("/".join((server.base_url, "chat", "completions")), timeout=10)  # GET on a POST route
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(server.url + "/v2/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# -- disconnects ------------------------------------------------------------------------------------
def _stream_then_drop(server, body, chunks=2):
    """Open a stream, read ``chunks`` SSE events, drop the connection."""
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.base_url + "/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= chunks:
                        break
    return seen


def test_disconnect_mid_stream_then_a_fresh_request_is_served(server, client, reference):
    long_body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 220, "temperature": 0}
    assert _stream_then_drop(server, long_body) == 2
    h = server.wait_idle(timeout=30)
    assert (h["open_requests"], h["active"], h["queue_depth"]) == (0, 0, 0)  # no ghost row, nothing leaked
    want, _, _ = expect(reference, raw_ids(reference, "fresh"), 12)
    r = client.completions.create(model=MODEL, prompt="fresh", max_tokens=12, temperature=0)
    assert r.choices[0].text == want


def test_disconnect_of_one_stream_leaves_its_batch_mates_intact(server, reference):
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0}
    want, _, _ = expect(reference, raw_ids(reference, "keep me"), 40)

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            async def keep():
                r = await c.post(server.base_url + "/completions", json=dict(body, prompt="keep me"))
                return r.json()["choices"][0]["text"]

            async def drop():
                async with c.stream("POST", server.base_url + "/completions",
                                    json=dict(body, prompt="drop me", stream=True)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return True

            return await asyncio.gather(keep(), drop())

    kept, dropped = asyncio.run(run())
    assert kept == want and dropped
    h = server.wait_idle()
    assert (h["open_requests"], h["active"]) == (0, 0)


# -- metrics and shutdown -----------------------------------------------------------------------------
def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    assert httpx.post(server.base_url + "/completions", json={"model": MODEL}, timeout=10).status_code == 400
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("poss_requests_total", "poss_generation_tokens_total", "poss_prompt_tokens_total", "poss_tau_bucket",
                 "poss_request_seconds_bucket", "poss_round_seconds_bucket", "poss_queue_depth", "poss_active_batch",
                 "poss_time_to_first_token_seconds_bucket"):
        assert name in text, name
    ok = [line for line in text.splitlines() if line.startswith('poss_requests_total{endpoint="completions",outcome=')]
    assert ok and sum(float(line.split()[-1]) for line in ok) >= 1
    rejected = [line for line in text.splitlines() if 'outcome="rejected"' in line]
    assert rejected  # the bad request was counted


def test_ctrl_c_stops_the_server_cleanly(folder, tmp_path):
    log = tmp_path / "server.log"
    with running_server(["--target", folder / "target", "--no-draft", "--served-model-name", MODEL], log) as s:
        assert "poss serve: tiny at http://127.0.0.1:" in s.log()
        code = s.stop()
    assert code == 0, s.log()
    assert "Traceback" not in s.log() and "poss serve: stopped" in s.log()


# -- the real model -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_smollm2_chat_through_the_client(tmp_path):
    import poss
    from poss.decode.params import TreeParams

    draft = poss.shipped_draft("smollm2-135m")
    if draft is None:
        pytest.skip("no shipped draft for smollm2-135m")
    args = ["--target", "smollm2-135m", "--draft", draft, "--max-batch", 4, "--num-nodes", 60, "--depth", 6,
            "--dtype", "float32"]  # fp32: the bit-exact setting, so the text must equal poss.load's
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    with running_server(args, tmp_path / "server.log", threads=2) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=600)
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48, temperature=0)
        chunks = list(c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48,
                                                temperature=0, stream=True))
    text = r.choices[0].message.content
    assert "Paris" in text
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert r.model_extra["poss"]["tau"] > 1.0  # the shipped draft is accepted
    gen = poss.load("smollm2-135m", draft=draft, dtype=torch.float32, tree=TreeParams())
    assert gen.generate([messages], 48, temperature=0.0).texts[0] == text
