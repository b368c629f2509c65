#!/usr/bin/env python3
"""Writes the committed seed corpus, fuzz/seeds/<target>/<name>: a handful of small real
and hostile inputs per target.  Rerun after changing it; scripts/fuzz.sh copies the seeds
into the (ignored) corpus directory before each run."""

import json
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
LOGS = HERE.parent / "tests" / "data" / "logs"
D = "sha256:" + "ab" * 32


def gguf(kvs, tensors=0, version=3):
    def s(text):
        b = text.encode()
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", version, tensors, len(kvs))
    for key, kind, value in kvs:
        out += s(key) + struct.pack("<I", kind)
        if kind == 8:
            out += s(value)
        elif kind == 4:
            out += struct.pack("<I", value)
        elif kind == 9:  # an array of strings
            out += struct.pack("<IQ", 8, len(value)) + b"".join(s(v) for v in value)
    return out


def manifest(layers, schema=2, media="application/vnd.docker.distribution.manifest.v2+json"):
    return json.dumps({
        "schemaVersion": schema, "mediaType": media,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": D, "size": 2},
        "layers": layers,
    })


def layer(media, size=1, digest=D):
    return {"mediaType": "application/vnd.ollama.image." + media, "digest": digest, "size": size}


def saved_listing(models, store="/var/lib/corral/models"):
    """corrald's listing.json for the fuzz target's store."""
    return json.dumps({"store": store, "models": models})


def saved_model(name, modified=(1764000000, 5), size=100):
    return {
        "name": name, "file": [1234, 512, list(modified)], "digest": D, "modified": list(modified),
        "config_layer": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": D, "size": 2},
        "layers": [{**layer("model", size), "from": "/tmp/tiny.gguf"}, layer("template", 20)],
        "config": {"model_format": "gguf", "model_family": "llama", "model_type": "1M", "file_type": "F16",
                   "rootfs": {"type": "layers", "diff_ids": [D]}},
    }


def sse(*events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


# The first byte of a stream target's input chooses how the rest is cut into pieces.
SEED = {
    "gguf_metadata": {
        "llama.gguf": gguf([("general.architecture", 8, "llama"), ("llama.context_length", 4, 2048),
                            ("llama.block_count", 4, 2), ("tokenizer.ggml.tokens", 9, ["a", "b"])]),
        "huge-counts.gguf": b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62),
        "huge-string.gguf": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**63) + b"x",
        "version-1.gguf": b"GGUF" + struct.pack("<I", 1),
    },
    "modelfile": {
        "full": 'FROM ./m.gguf\nPARAMETER temperature 0.7\nPARAMETER stop "<|end|>"\nPARAMETER stop x\n'
                'TEMPLATE """{{ .System }}\n{{ .Prompt }}"""\nSYSTEM You are terse.\nADAPTER ./lora.gguf\n'
                'LICENSE """MIT"""\nMESSAGE user hi\nMESSAGE assistant """hello\nthere"""\n# comment\n',
        "from-model": "from llama3.2:3b\nparameter num_ctx 4096\n",
        "unclosed": 'FROM x\nSYSTEM """never closed\n',
        "two-froms": "FROM a\nFROM b\n",
        "bad-param": "FROM a\nPARAMETER num_ctx lots\nPARAMETER nope 1\n",
        "shadow": 'FROM x\nSYSTEM """a"""\nFROM /etc/shadow\n"""\n',
    },
    "model_name": {n: n for n in [
        "llama3.2", "me/tiny:v1", "localhost:5000/me/tiny:q8", "hf.co/Org_x/Model-GGUF:Q4_K_M",
        "../etc/passwd", "ns/..", "a/b/c/d", "model:tag/x", "m\0x", "mödel:1", "x" * 100,
    ]},
    "digest": {
        "colon": D, "dash": D.replace(":", "-"), "upper": "sha256:" + "AB" * 32,
        "json": json.dumps(D), "json-dash": json.dumps(D.replace(":", "-")), "traversal": "sha256:../../etc/passwd",
        "short": "sha256:abc", "long": D + "0",
    },
    "registry_manifest": {
        "ok": manifest([layer("model", 100), layer("template", 10), layer("params", 20)]),
        "no-model": manifest([layer("template")]),
        "v1": manifest([layer("model")], schema=1),
        "oci": manifest([layer("model")], media="application/vnd.oci.image.manifest.v1+json"),
        "bad-digest": manifest([layer("model", digest="sha256:../../x")]),
        "huge-size": manifest([layer("model", 2**64 - 1), layer("model", 2**64 - 1)]),
        "config": json.dumps({"model_format": "gguf", "model_family": "llama", "model_type": "3.2B",
                              "file_type": "Q4_K_M", "rootfs": {"type": "layers", "diff_ids": [D]}}),
    },
    "saved_listing": {
        "two-models": saved_listing([saved_model("registry.ollama.ai/library/tiny:latest"),
                                     saved_model("host.example:5000/team/model:v1")]),
        "another-store": saved_listing([saved_model("tiny")], store="/elsewhere"),
        "hostile": saved_listing([saved_model("../../etc:x"), saved_model("far", modified=[2**64 - 1, 0]),
                                  saved_model("huge", size=2**64 - 1), {**saved_model("none"), "layers": []}]),
    },
    "registry_headers": {
        "challenge": 'Bearer realm="https://auth.example/token",service="registry.example",'
                     'scope="repository:library/m:pull"',
        "loose": 'bearer  scope="a:b:pull,push", realm=http://h/t , x="q\\"uote"',
        "unterminated": 'Bearer realm="unterminated',
        "basic": 'Basic realm="x"',
        "range": "bytes 0-99/1000",
        "range-star": "bytes 5-9/*",
        "range-backwards": "bytes 9-5/10",
        "range-past-end": "bytes 0-10/10",
        "range-huge": "bytes 0-18446744073709551615/18446744073709551615",
        "head": "HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nContent-Range: bytes 0-9/20\r\n\r\nbody",
        "head-chunked": "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    },
    "llama_log": {
        name: b"\x07" + (LOGS / name).read_bytes()[:6000]
        for name in ["cpu-ngl0.log", "rpc-ngl2.log", "ctx-too-big-ulimit.log", "bind-port-in-use.log",
                     "random-bytes.log", "truncated.log"]
    } | {
        "buffers": b"\x30load_tensors:   CUDA0 model buffer size = 17592186044415.00 MiB\n"
                   b"load_tensors:   CUDA1 model buffer size = 17592186044415.00 MiB\n",
        "long-line": b"\x05E " + "é".encode() * 400 + b"\r\n\x1b[31mE error: bad\x1b[0m\n",
    },
    "sse_stream": {
        "chat": b"\x11" + sse(
            {"choices": [{"delta": {"role": "assistant", "content": None}}]},
            {"choices": [{"delta": {"reasoning_content": "hm", "content": "Hel"}}]},
            {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{\"a\""}}]}}]},
            {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}],
             "timings": {"prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 2.0}},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}).encode(),
        "completion": b"\x40" + sse({"content": "a"}, {"content": "b", "stop": True, "stop_type": "limit",
                                                       "tokens_evaluated": 5, "tokens_predicted": 2}).encode(),
        "error": b"\x03" + sse({"error": {"message": "boom"}}).encode(),
        "json": b"\x22" + json.dumps({"choices": [{"text": "\"usage\":"}],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode(),
        "no-newline": b"\x01data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}",
    },
    "worker_listing": {
        # Real llama-server b11434 answers: one worker, two, none, a GPU build's own GPU.
        "one": "Available devices:\n  RPC0: 127.0.0.1:50061 (24105 MiB, 24105 MiB free)\n",
        "two": "Available devices:\n  RPC0: 10.0.0.2:50052 (24105 MiB, 20000 MiB free)\n"
               "  RPC1: 10.0.0.3:50052 (81920 MiB, 81000 MiB free)\n",
        "none": "Available devices:\n  (none)\n",
        "gpu-build": "Available devices:\n  CUDA0: NVIDIA H200 (143000 MiB, 140000 MiB free)\n"
                     "  RPC0: 10.0.0.2:50052 (24105 MiB, 24105 MiB free)\n",
        "free-above-total": "Available devices:\n  RPC0: x:1 (1 MiB, 2 MiB free)\n",
        "huge": "Available devices:\n  RPC0: x:1 (99999999999999999999 MiB, 1 MiB free)\n",
        "repeated": "Available devices:\n  RPC0: a:1 (1 MiB, 1 MiB free)\n  RPC0: a:1 (1 MiB, 1 MiB free)\n",
        "no-header": "  RPC0: a:1 (1 MiB, 1 MiB free)\n",
    },
    "dry_run_output": {
        # Real llama-server b11434 lines (-lv 5) of a dry run: the rig's partial offload over two workers.
        "rig-partial": (
            "0.00.037.479 I sched_reserve: RPC0[a:1] compute buffer size =    16.01 MiB\n"
            "0.00.037.480 I sched_reserve:        CPU compute buffer size =    19.02 MiB\n"
            "0.00.038.276 I common_memory_breakdown_print: | memory breakdown [MiB]     | total    free    self   model"
            "   context   compute    unaccounted |\n"
            "0.00.038.298 I common_memory_breakdown_print: |   - RPC0 (a:1) | 24105 = 24105 + (  35 =    15 +       4 +"
            "      16) +         -35 |\n"
            "0.00.038.298 I common_memory_breakdown_print: |   - RPC1 (b:1) | 24105 = 24105 + (  16 =     8 +       2 +"
            "       6) +         -16 |\n"
            "0.00.038.298 I common_memory_breakdown_print: |   - Host       |                   143 =    98 +      26 +"
            "      19                |\n"),
        "cuda": ("I sched_reserve:      CUDA0 compute buffer size =   898.03 MiB\n"
                 "I common_memory_breakdown_print: |   - CUDA0 (H200) | 143000 = 120000 + (19187 = 17904 + 384 + 898)"
                 " + 3945 |\n"
                 "I common_memory_breakdown_print: |   - Host | 58271 = 58259 + 0 + 12 |\n"),
        "huge": "I common_memory_breakdown_print: |   - CUDA0 (x) | 1 = 1 + ( 1 = 99999999999999999999 + 0 + 0 ) + 0 |\n",
        "no-host": "I common_memory_breakdown_print: |   - CUDA0 (x) | 1 = 1 + ( 1 = 1 + 0 + 0 ) + 0 |\n",
        "dup": ("I common_memory_breakdown_print: | - RPC0 (a) | 1 = 1 + ( 1 = 1 + 0 + 0 ) + 0 |\n"
                "I common_memory_breakdown_print: | - RPC0 (a) | 1 = 1 + ( 1 = 1 + 0 + 0 ) + 0 |\n"),
    },
    "fit_projection": {
        # Real llama-fit-params b11434 output: the CPU alone, two rpc-servers.
        "cpu": "Host 0 1 3 \n",
        "rpc": "RPC0 0 0 10 \nRPC1 0 0 10 \nHost 0 0 9 \n",
        "cuda": "CUDA0 15360 2048 512 \nCUDA1 14000 2048 512 \nHost 300 0 40 \n",
        "fitted-args": "-c 4096 -ngl 99 -ts 1,1\n",
        "huge": "CUDA0 99999999999999999999 0 0\nHost 1073741825 0 0\n",
        "dup": "RPC0 0 0 1\nRPC0 0 0 1\nHost 0 0 1\n",
        "after-host": "Host 0 0 1\nRPC0 0 0 1\n",
        "json": json.dumps({"devices": [{"name": "RPC0", "usage": {"model": 1048576, "context": 0, "compute": 3}}],
                            "host": {"model": 0, "context": 0, "compute": 0}}),
    },
    "keep_alive": {n: n for n in ["5m", "1h30m", "-1m", "0", "300", "1.5h", "300ms", "2562047h47m16.854775807s",
                                  "99999999999h", "1.2.3s", "5 minutes", "-1", "1e300", "null", "[1]",
                                  "\"10s\"", "3.5"]},
    "api_bodies": {
        "chat": json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}],
                            "stream": False, "format": "json", "think": True, "keep_alive": "5m",
                            "options": {"temperature": 0.5, "stop": ["x"], "num_predict": 10, "seed": 1},
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        "chat-schema": json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "format": {"type": "object", "properties": {"a": {"type": "string"}}}}),
        "chat-tool-result": json.dumps({"model": "m", "messages": [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "42"}]}),
        "generate": json.dumps({"model": "m", "prompt": "hi", "system": "s", "raw": True, "images": [],
                                "keep_alive": -1, "options": {"top_k": 4}}),
        "embed": json.dumps({"model": "m", "input": ["a", "b"], "keep_alive": 0}),
        "create": json.dumps({"model": "me/new:1", "from": "llama3.2", "files": {"m.gguf": D},
                              "adapters": {"a.gguf": D}, "template": "{{ .Prompt }}", "system": "s",
                              "license": ["MIT"], "parameters": {"num_ctx": 4096},
                              "messages": [{"role": "user", "content": "hi"}]}),
        "pull": json.dumps({"model": "localhost:5000/me/tiny", "insecure": True, "stream": False}),
        "copy": json.dumps({"source": "a", "destination": "b:2"}),
        "delete": json.dumps({"name": "a"}),
        "traversal": json.dumps({"model": "../../etc/passwd", "source": "x/../../y", "files": {"a": "sha256:../x"}}),
        "wrong-types": json.dumps({"model": 1, "messages": "x", "options": [], "stream": "yes", "keep_alive": {}}),
        "nested": "[" * 200 + "]" * 200,
        "not-json": "model=m&prompt=hi",
    },
}


def main():
    for target, seeds in SEED.items():
        out = SEEDS / target
        out.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:40] or "empty"
            (out / safe).write_bytes(data if isinstance(data, bytes) else data.encode())
        print(f"{target}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
