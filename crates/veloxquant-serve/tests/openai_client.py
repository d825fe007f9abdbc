"""The official `openai` Python client against a running `veloxquant serve`.

Usage: python3 openai_client.py BASE_URL MODEL API_KEY
Prints one line per check and a closing 'N passed, N failed'; exits non-zero on failure.
"""

import sys

import openai

BASE, MODEL, KEY = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
PROMPT = "The lighthouse keeper had lived alone on the island for twenty years. One stormy night,"
results = []


def check(name):
    def wrap(fn):
        try:
            fn()
            results.append((name, None))
            print(f"ok   {name}")
        except Exception as e:  # report every failure, then the summary
            results.append((name, e))
            print(f"FAIL {name}: {type(e).__name__}: {e}")
        return fn

    return wrap


@check("models list")
def _():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids


@check("completion, greedy, usage")
def _():
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length", r
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert len(r.choices[0].text) > 0


@check("completion streaming equals non-streaming")
def _():
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    parts = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    text, finish = "", None
    for chunk in parts:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    assert finish == "length"


@check("chat, greedy, and streaming with usage")
def _():
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant", r
    content = r.choices[0].message.content
    assert content and r.usage.completion_tokens <= 8
    s = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    for chunk in s:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == content, (text, content)
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens


@check("stop sequence cuts the text")
def _():
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), repr(stop)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert r.choices[0].text == full[: full.index(stop)], (r.choices[0].text, full, stop)


@check("same seed, same text; other seed, other text")
def _():
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=11, **kw).choices[0].text
    b = client.completions.create(seed=11, **kw).choices[0].text
    c = client.completions.create(seed=12, **kw).choices[0].text
    assert a == b, (a, b)
    assert a != c, (a, c)


def expect(exc, fn):
    try:
        fn()
    except exc as e:
        return e
    raise AssertionError(f"expected {exc.__name__}")


@check("unknown model -> NotFoundError")
def _():
    e = expect(openai.NotFoundError, lambda: client.completions.create(model="gpt-9", prompt="x", max_tokens=1))
    assert e.status_code == 404


@check("bad parameters -> BadRequestError")
def _():
    expect(openai.BadRequestError, lambda: client.completions.create(model=MODEL, prompt="x", n=2))
    expect(openai.BadRequestError, lambda: client.completions.create(model=MODEL, prompt="x", temperature=5))
    long = "word " * 9000
    e = expect(openai.BadRequestError, lambda: client.completions.create(model=MODEL, prompt=long, max_tokens=1))
    assert e.code == "context_length_exceeded", e.code


@check("wrong API key -> AuthenticationError")
def _():
    bad = openai.OpenAI(base_url=BASE, api_key="not-the-key", max_retries=0)
    expect(openai.AuthenticationError, lambda: bad.completions.create(model=MODEL, prompt="x", max_tokens=1))


failed = [n for n, e in results if e is not None]
print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
