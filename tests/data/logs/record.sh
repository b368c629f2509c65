#!/usr/bin/env bash
# Re-records the golden llama-server transcripts in this directory (see README.md).
#
# Usage: tests/data/logs/record.sh BIN_DIR
#   BIN_DIR    the directory scripts/setup-llama-server.sh prints (llama-server, rpc-server)
# The tiny models must already be at $W/tiny-llama.gguf and $W/tiny-bert.gguf (written by
# corral::demo_model::write_tiny_llama / write_tiny_bert).  $W is a fixed path so that the
# paths inside the transcripts do not change between recordings.
set -euo pipefail
BIN=${1:?usage: record.sh BIN_DIR}
W=/tmp/corral-logparse
OUT=$(cd "$(dirname "$0")" && pwd)
RPC_PORT=50152
LLAMA=$W/tiny-llama.gguf
cd "$W"

# wait_health SOCK PID: poll /health on the unix socket until 200 (or the child died)
wait_health() {
    for _ in $(seq 1 600); do
        kill -0 "$2" 2>/dev/null || return 1
        [[ $(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$1" http://x/health) == 200 ]] && return 0
        sleep 0.05
    done
    return 1
}
# serve NAME ARGS...: start llama-server on $W/NAME.sock, run two requests (unless
# REQUESTS=0), SIGTERM it
serve() {
    local name=$1; shift
    local sock=$W/$name.sock
    rm -f "$sock"
    "$BIN/llama-server" --host "$sock" "$@" 2>"$OUT/$name.log" >"$W/$name.stdout" &
    local pid=$!
    wait_health "$sock" "$pid"
    if [[ ${REQUESTS:-1} == 1 ]]; then
    curl -s --unix-socket "$sock" http://x/completion \
        -d '{"prompt":"hello world","n_predict":4,"seed":1}' >/dev/null
    curl -s --unix-socket "$sock" http://x/v1/chat/completions \
        -d '{"messages":[{"role":"user","content":"hello"}],"max_tokens":4,"seed":1}' >/dev/null
    fi
    kill -TERM "$pid"
    wait "$pid" || true
    rm -f "$sock"
}
# fail NAME ARGS...: run llama-server (expected to exit by itself), keep its stderr
fail() {
    local name=$1; shift
    rm -f "$W/$name.sock"
    "$BIN/llama-server" --host "$W/$name.sock" "$@" 2>"$OUT/$name.log" >"$W/$name.stdout" || true
    rm -f "$W/$name.sock"
}

"$BIN/llama-server" --version 2>"$OUT/version.txt"

# 1. CPU only, -lv 4, -ngl 0 (the RPC build still prints `offloaded 0/5 layers`)
serve cpu-ngl0 -m "$LLAMA" -lv 4 -ngl 0 -a tiny-llama

# 2. RPC offload to a local rpc-server: everything, then 2 of 5 layers
"$BIN/rpc-server" -H 127.0.0.1 -p $RPC_PORT 2>"$W/rpc-server.log" >&2 &
RPC_PID=$!
for _ in $(seq 1 100); do (echo >/dev/tcp/127.0.0.1/$RPC_PORT) 2>/dev/null && break; sleep 0.05; done
serve rpc-ngl99 -m "$LLAMA" -lv 4 --rpc 127.0.0.1:$RPC_PORT -ngl 99 -a tiny-llama
serve rpc-ngl2 -m "$LLAMA" -lv 4 --rpc 127.0.0.1:$RPC_PORT -ngl 2 -a tiny-llama
kill -TERM $RPC_PID; wait $RPC_PID || true

# 3. the fit dry run at -lv 5 prints zero-size buffers before the real ones
REQUESTS=0 serve cpu-lv5 -m "$LLAMA" -lv 5 -ngl 0 -a tiny-llama

# 4. the bert embedding model
serve bert-embeddings -m "$W/tiny-bert.gguf" -lv 4 -ngl 0 --embeddings

# 5. failures (the missing file's name has a byte that is not UTF-8, 0xFF)
fail nonexistent -m "$W/does-not-exist-"$'\xff'".gguf" -lv 4 -ngl 0
head -c 200000 "$LLAMA" >"$W/truncated.gguf"
fail truncated -m "$W/truncated.gguf" -lv 4 -ngl 0
python3 -c 'import random, sys; r = random.Random(1); sys.stdout.buffer.write(bytes(r.randrange(256) for _ in range(4096)))' >"$W/random.gguf"
fail random-bytes -m "$W/random.gguf" -lv 4 -ngl 0
fail unknown-flag -m "$LLAMA" -lv 4 --no-mmap
fail bad-value -m "$LLAMA" -lv 4 -c abc
"$BIN/llama-server" -m "$LLAMA" -lv 4 -ngl 0 --host "$W/no-such-dir/x.sock" 2>"$OUT/bind-missing-dir.log" >/dev/null || true
python3 -c 'import socket, time; s = socket.socket(); s.bind(("127.0.0.1", 50153)); s.listen(); time.sleep(30)' &
HOLD=$!
sleep 0.5
"$BIN/llama-server" -m "$LLAMA" -lv 4 -ngl 0 --host 127.0.0.1 --port 50153 2>"$OUT/bind-port-in-use.log" >/dev/null || true
kill $HOLD; wait $HOLD 2>/dev/null || true
(ulimit -v 2000000; fail ctx-too-big-ulimit -m "$LLAMA" -lv 4 -ngl 0 -c 50000000)
