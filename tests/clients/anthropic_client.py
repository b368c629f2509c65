"""Exercise corrald's Anthropic-compatible API with the official `anthropic` Python client.

Usage: python anthropic_client.py BASE_URL     (the server root; the client adds /v1/messages)

The store holds `chat` (a tiny llama, which generates exactly `max_tokens` tokens)
and `embed` (a tiny bert).  Any mismatch raises; one line per check.
"""

import sys

import anthropic


def check(cond, what, detail=None):
    if not cond:
        raise AssertionError(f"{what}: {detail!r}")
    print(f"ok: {what}", flush=True)


def main(base):
    client = anthropic.Anthropic(base_url=base.rstrip("/"), api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "hello"}]

    m = client.messages.create(model="chat", max_tokens=8, system="be brief", messages=messages)
    check(m.content and m.content[0].type == "text" and m.content[0].text, "message has text", m)
    check(m.usage.output_tokens == 8, "message usage.output_tokens is max_tokens", m.usage)
    check(m.stop_reason == "max_tokens", "message stop_reason is max_tokens", m.stop_reason)
    check(m.model.startswith("chat"), "message names the model", m.model)

    with client.messages.stream(model="chat", max_tokens=8, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(text, "message stream collects text", text)
    check(final.content[0].text == text, "the final message is the streamed text", final)
    check(final.usage.output_tokens == 8, "message stream reports usage", final.usage)

    counted = client.messages.count_tokens(model="chat", messages=messages)
    check(counted.input_tokens > 0, "count_tokens counts the input", counted)

    try:
        client.messages.create(model="nope", max_tokens=8, messages=messages)
    except anthropic.NotFoundError as e:
        check(e.status_code == 404, "unknown model is NotFoundError", e)
        check(e.body["error"]["type"] == "not_found_error", "its error is in Anthropic's shape", e.body)
    else:
        raise AssertionError("a message to an unknown model did not raise")

    try:
        client.messages.create(model="embed", max_tokens=8, messages=messages)
    except anthropic.BadRequestError as e:
        check("does not support generate" in e.message, "an embedding model is BadRequestError", e)
    else:
        raise AssertionError("a message to an embedding model did not raise")

    print("all anthropic checks passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
