"""Exercise corrald's OpenAI-compatible API with the official `openai` Python client.

Usage: python openai_client.py BASE_URL     (the server root; /v1 is appended)

The store holds `chat` (a tiny llama, which generates exactly `max_tokens` tokens)
and `embed` (a tiny bert, 64-dim embeddings).  Any mismatch raises; one line per check.
"""

import sys

import openai


def check(cond, what, detail=None):
    if not cond:
        raise AssertionError(f"{what}: {detail!r}")
    print(f"ok: {what}", flush=True)


def main(base):
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "hello"}]

    r = client.chat.completions.create(model="chat", messages=messages, max_tokens=8)
    check(r.choices and r.choices[0].message.content, "chat completion has content", r)
    check(r.usage.completion_tokens == 8, "chat usage.completion_tokens is max_tokens", r.usage)
    check(r.choices[0].finish_reason == "length", "chat finish_reason is length", r.choices[0].finish_reason)
    check(r.model.startswith("chat"), "chat completion names the model", r.model)

    stream = client.chat.completions.create(
        model="chat", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(len(chunks) >= 2 and text, "chat stream collects text", len(chunks))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(finish == ["length"], "chat stream finishes with length", finish)
    usage = [c.usage for c in chunks if c.usage]
    check(usage and usage[-1].completion_tokens == 8, "chat stream reports usage", usage)

    r = client.completions.create(model="chat", prompt="hello", max_tokens=8)
    check(r.choices and r.choices[0].text, "completion has text", r)
    check(r.usage.completion_tokens == 8, "completion usage.completion_tokens is max_tokens", r.usage)
    chunks = list(client.completions.create(model="chat", prompt="hello", max_tokens=8, stream=True))
    check("".join(c.choices[0].text for c in chunks if c.choices), "completion stream collects text", len(chunks))

    r = client.embeddings.create(model="embed", input=["hello world", "goodbye"])
    check(len(r.data) == 2, "embeddings returns one vector per input", len(r.data))
    check(all(len(d.embedding) == 64 for d in r.data), "embeddings have 64 dims", [len(d.embedding) for d in r.data])
    r = client.embeddings.create(model="embed", input="hello")
    check(len(r.data) == 1 and len(r.data[0].embedding) == 64, "embeddings take a string", r.data)

    r = client.responses.create(model="chat", input="hello", max_output_tokens=8)
    check(r.output_text, "response has output_text", r)
    check(r.usage.output_tokens == 8, "response usage.output_tokens is max_output_tokens", r.usage)
    check(r.model.startswith("chat"), "response names the model", r.model)
    events = list(client.responses.create(model="chat", input="hello", max_output_tokens=8, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text, "response stream collects text", [e.type for e in events])
    check(events[-1].type == "response.completed", "response stream ends completed", events[-1].type)
    check(events[-1].response.output_text == text, "response stream's completed text is its deltas", events[-1])

    ids = [m.id for m in client.models.list()]
    check("chat:latest" in ids and "embed:latest" in ids, "models.list contains both models", ids)
    m = client.models.retrieve("chat:latest")
    check(m.id == "chat:latest", "models.retrieve", m)

    try:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=8)
    except openai.NotFoundError as e:
        check(e.status_code == 404, "unknown model is NotFoundError", e)
    else:
        raise AssertionError("chat with an unknown model did not raise")

    print("all openai checks passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
