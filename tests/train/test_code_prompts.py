"""The coder's training prompts: coding requests only, and no evaluation problem among them."""

import json

import pytest

from poss.data import load_eval_set
from poss.train.code_prompts import EvalOverlap, code_prompt_filter, is_code_request
from poss.train.distill import select_prompts


@pytest.fixture(scope="module")
def overlap():
    return EvalOverlap.default(gsm8k_full=False)


def test_humaneval164_is_the_whole_set():
    recs = load_eval_set("humaneval164")
    assert len(recs) == 164
    assert len({r["task_id"] for r in recs}) == 164
    # The shipped 80-question subset is drawn from the same problems.
    full = {r["turns"][0].split("\n", 1)[1].strip() for r in recs}
    sub = [r["turns"][0].split("\n", 1)[1].strip() for r in load_eval_set("humaneval")]
    assert sum(s in full for s in sub) >= 60


@pytest.mark.parametrize("text", [
    "Write a Python function that reverses a linked list.",
    "Why does this crash?\n```js\nconst x = foo();\n```",
    "def f(x):\n    return x + 1\nwhat does this do",
    "How do I implement a binary search algorithm recursively on an array?",
    "SELECT name FROM users WHERE id = 3; is slow, how can I index it?",
])
def test_coding_requests_are_kept(text):
    assert is_code_request(text)


@pytest.mark.parametrize("text", [
    "Write a poem about the sea in the style of Emily Dickinson.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a vegan chocolate cake.",
])
def test_other_requests_are_not(text):
    assert not is_code_request(text)


def test_every_eval_problem_is_excluded(overlap):
    for rec in load_eval_set("humaneval164"):
        assert overlap.hits(rec["turns"][0]), rec["task_id"]
    for rec in load_eval_set("gsm8k"):
        assert overlap.hits(rec["turns"][0])


def test_an_eval_problem_inside_a_longer_request_is_excluded(overlap):
    he = load_eval_set("humaneval164")[17]
    body = he["turns"][0].split("\n", 1)[1]
    assert overlap.hits("Hi! Could you help me with my homework?\n\n" + body + "\nThanks a lot")
    # Only the docstring's prose, reworded layout (one line, extra spaces): still one shared 8-gram.
    prose = " ".join(body.split('"""')[1].split()) if '"""' in body else " ".join(body.split())
    assert overlap.hits("please   solve:  " + prose)
    # Defining a HumanEval function under its own name, without its docstring.
    assert overlap.hits(f"def {he['entry_point']}(x):\n    pass\nfinish this")
    gsm = load_eval_set("gsm8k")[3]["turns"][0]
    assert overlap.hits("Solve this step by step in Python: " + gsm)


def test_ordinary_code_prompts_pass(overlap):
    keep = code_prompt_filter(overlap)
    assert keep("Write a Python function to parse a CSV file of orders and sum the totals per customer.")
    assert not keep("Write a haiku about autumn leaves falling in the park.")


def test_selection_takes_only_kept_prompts(overlap):
    he = load_eval_set("humaneval164")[5]["turns"][0]
    convs = [[{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}] for t in [
        "Write a Python function to merge two sorted lists into one sorted list.",
        he,
        "Tell me a bedtime story about a brave little fox and the moon.",
        "Fix this bug please:\n```python\nfor i in range(10) print(i)\n```",
        "How do I write a SQL query that joins orders and customers by id?",
    ]]
    val, train = select_prompts(convs, lambda t: list(t.encode()), n_train=10, n_val=1, seed=0,
                                max_prompt_tokens=10_000, accept=code_prompt_filter(overlap))
    picked = {i for i, _ in val + train}
    assert picked == {0, 3, 4}


@pytest.mark.slow
def test_shipped_coder_data_holds_no_eval_problem():
    """The prompts behind the shipped coder records (ShareGPT by source index) share nothing with
    HumanEval or the whole GSM8K test split, and every one is a coding request."""
    import lzma
    from pathlib import Path

    from poss.train.data import load_sharegpt

    path = Path(__file__).resolve().parents[2] / "data" / "distill-qwen2.5-coder-0.5b" / "records.jsonl.xz"
    if not path.exists():
        pytest.skip("no shipped coder data")
    convs = load_sharegpt().messages
    full = EvalOverlap.default(gsm8k_full=True)
    with lzma.open(path, "rt") as f:
        sources = {json.loads(line)["source_index"] for line in f if line.strip()}
    assert sources
    for i in sources:
        first = next(m["content"] for m in convs[i] if m["role"] == "user")
        assert is_code_request(first) and not full.hits(first), i
