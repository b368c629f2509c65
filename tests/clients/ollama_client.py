"""Exercise corrald with the official `ollama` Python client, as people use it.

Usage: python ollama_client.py BASE_URL

The store holds `chat` (a tiny llama, which generates exactly `num_predict` tokens)
and `embed` (a tiny bert, 64-dim embeddings).  Any mismatch raises; one line per check.
"""

import sys

import ollama


def check(cond, what, detail=None):
    if not cond:
        raise AssertionError(f"{what}: {detail!r}")
    print(f"ok: {what}", flush=True)


def main(base):
    client = ollama.Client(host=base)
    opts = {"num_predict": 8}
    messages = [{"role": "user", "content": "hello"}]

    r = client.chat(model="chat", messages=messages, options=opts)
    check(r.message.role == "assistant" and r.message.content, "chat returns content", r)
    check(r.done and r.done_reason == "length", "chat done_reason is length", r)
    check(r.eval_count == 8, "chat eval_count is num_predict", r.eval_count)

    chunks = list(client.chat(model="chat", messages=messages, options=opts, stream=True))
    check(len(chunks) >= 2, "chat stream yields chunks", len(chunks))
    check(all(not c.done for c in chunks[:-1]) and chunks[-1].done, "chat stream ends with one done", chunks[-1])
    check(chunks[-1].done_reason == "length", "chat stream done_reason is length", chunks[-1])
    check("".join(c.message.content or "" for c in chunks), "chat stream collects text")

    r = client.generate(model="chat", prompt="hello", options=opts)
    check(r.response and r.done and r.done_reason == "length", "generate returns a response", r)
    chunks = list(client.generate(model="chat", prompt="hello", options=opts, stream=True))
    check(len(chunks) >= 2 and chunks[-1].done, "generate stream ends with done", chunks[-1])
    check("".join(c.response or "" for c in chunks), "generate stream collects text")

    r = client.chat(model="chat", messages=messages, options=opts, logprobs=True, top_logprobs=2)
    check(r.logprobs and len(r.logprobs) == 8, "chat gives a logprob a token", r.logprobs)
    check(all(len(p.top_logprobs) == 2 for p in r.logprobs), "chat gives the top 2 of each", r.logprobs[0])
    try:
        client.generate(model="chat", prompt="hello", suffix="the end", options=opts)
    except ollama.ResponseError as e:
        check(e.status_code == 400 and "does not support insert" in e.error, "a suffix needs the tokens for it", e)
    else:
        raise AssertionError("a suffix on a model without fill-in-the-middle tokens did not raise")

    r = client.embed(model="embed", input=["hello world", "goodbye"])
    check(len(r.embeddings) == 2, "embed returns one vector per input", len(r.embeddings))
    check(all(len(v) == 64 for v in r.embeddings), "embed vectors have 64 dims", [len(v) for v in r.embeddings])
    r = client.embed(model="embed", input="hello")
    check(len(r.embeddings) == 1 and len(r.embeddings[0]) == 64, "embed takes a string", r)
    r = client.embed(model="embed", input="hello", dimensions=16)
    check(len(r.embeddings[0]) == 16, "embed keeps the dimensions asked for", len(r.embeddings[0]))
    norm = sum(x * x for x in r.embeddings[0]) ** 0.5
    check(abs(norm - 1.0) < 1e-6, "embed normalizes the kept dimensions", norm)
    r = client.embed(model="embed", input="hello world " * 400)
    check(len(r.embeddings[0]) == 64, "embed cuts an input longer than the context", r.prompt_eval_count)
    try:
        client.embed(model="embed", input="hello world " * 400, truncate=False)
    except ollama.ResponseError as e:
        check(e.status_code == 400 and "context length" in e.error, "embed without truncate refuses", e)
    else:
        raise AssertionError("embed of a long input with truncate=False did not raise")
    r = client.embeddings(model="embed", prompt="hello")
    check(len(r.embedding) == 64, "legacy embeddings", len(r.embedding))

    names = [m.model for m in client.list().models]
    check({"chat:latest", "embed:latest"} <= set(names), "list shows both models", names)
    loaded = [m.model for m in client.ps().models]
    check("chat:latest" in loaded or "embed:latest" in loaded, "ps shows a loaded model", loaded)
    check("embed:latest" in loaded, "ps shows embed (the last used)", loaded)

    r = client.show("chat")
    check(r.details is not None and r.modelfile, "show returns details and a modelfile", r)
    check("completion" in (r.capabilities or []), "show lists completion", r.capabilities)

    statuses = [p.status for p in client.create(model="pirate", from_="chat", system="You are a pirate.", stream=True)]
    check(statuses and statuses[-1] == "success", "create (streamed) ends in success", statuses)
    r = client.create(model="pirate2", from_="chat", system="Arr.", parameters={"num_predict": 4})
    check(r.status == "success", "create (not streamed) succeeds", r)
    r = client.show("pirate")
    check("You are a pirate." in (r.modelfile or ""), "show has the SYSTEM in the modelfile", r.modelfile)
    r = client.generate(model="pirate2", prompt="hi")
    check(r.eval_count == 4 and r.done_reason == "length", "created parameters apply", r)

    r = client.copy("pirate", "pirate-copy")
    check(r.status == "success", "copy succeeds", r)
    names = [m.model for m in client.list().models]
    check("pirate-copy:latest" in names, "list shows the copy", names)
    for name in ("pirate", "pirate2", "pirate-copy"):
        r = client.delete(name)
        check(r.status == "success", f"delete {name}", r)
    names = [m.model for m in client.list().models]
    check(not any(n.startswith("pirate") for n in names), "deleted models are gone", names)

    try:
        client.chat(model="nope", messages=messages)
    except ollama.ResponseError as e:
        check(e.status_code == 404 and "not found" in e.error, "unknown model is ResponseError 404", (e.status_code, e.error))
    else:
        raise AssertionError("chat with an unknown model did not raise")

    print("all ollama checks passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
