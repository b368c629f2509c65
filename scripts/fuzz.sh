#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ (each [[bin]] of fuzz/Cargo.toml) for a bounded
# time on a copy of its committed seeds (fuzz/seeds/<target>/), after one build of the
# fuzz package.  Exits non-zero, naming the input that did it, on any crash, timeout or
# memory beyond the limit.  On the stable toolchain: no sanitizer (`-s none`; safe Rust
# needs no ASan), coverage-guided all the same.
#
#   scripts/fuzz.sh                      every target, CORRAL_FUZZ_SECONDS each (20)
#   scripts/fuzz.sh modelfile llama_log  only these
#   CORRAL_FUZZ_SECONDS=600 scripts/fuzz.sh   longer, by hand
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${CORRAL_FUZZ_SECONDS:-20}
rss_limit_mb=${CORRAL_FUZZ_RSS_MB:-2048}
# Seconds one input may take before it counts as a hang.
timeout=${CORRAL_FUZZ_TIMEOUT:-10}

bin=$(scripts/setup-fuzz.sh)
export PATH="$bin:$PATH"
cd fuzz

# The lock file must not need changes (the same rule as --locked for the main package):
# a dependency added to corral needs fuzz/Cargo.lock updated too.
if ! cargo fetch --locked --quiet --target x86_64-unknown-linux-gnu; then
    echo "fuzz: fuzz/Cargo.lock is out of date with Cargo.toml; update it with" \
        "(cd fuzz && cargo fetch) and commit it" >&2
    exit 1
fi

mapfile -t all < <(cargo fuzz list)
targets=("${@:-${all[@]}}")
for t in "${targets[@]}"; do
    printf '%s\n' "${all[@]}" | grep -qx -- "$t" || { echo "fuzz: no target $t (have: ${all[*]})" >&2; exit 2; }
done

# The build goes to the development cache outside the checkout (as llama-server's does),
# so that a fresh checkout (CI) rebuilds only what changed, not every dependency.
target_dir=${CORRAL_DEV_CACHE:-/var/cache/corral-dev}/fuzz-target
mkdir -p "$target_dir"
build=(-s none --codegen-units 16 --target-dir "$target_dir")
echo "fuzz: building ${#all[@]} targets into $target_dir" >&2
cargo fuzz build "${build[@]}" >&2
bindir=$target_dir/x86_64-unknown-linux-gnu/release

# Inputs longer than this are cut: a GGUF header needs room, text parsers do not.
max_len() {
    case $1 in
        gguf_metadata) echo 65536 ;;
        llama_log | sse_stream) echo 16384 ;;
        *) echo 8192 ;;
    esac
}

failed=()
for t in "${targets[@]}"; do
    corpus=corpus/$t
    artifacts=artifacts/$t
    rm -rf "$corpus" "$artifacts"
    mkdir -p "$corpus" "$artifacts"
    [[ -d seeds/$t ]] && cp seeds/"$t"/* "$corpus"/
    log=$artifacts/fuzz.log
    status=0
    "$bindir/$t" "$corpus" -max_total_time="$seconds" -max_len="$(max_len "$t")" \
        -rss_limit_mb="$rss_limit_mb" -malloc_limit_mb="$rss_limit_mb" -timeout="$timeout" \
        -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1 || status=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    if ((status == 0)); then
        echo "fuzz: $t: ok, ${runs:-?} inputs in ${seconds} s" >&2
        continue
    fi
    failed+=("$t")
    echo "fuzz: $t FAILED (exit $status) after ${runs:-?} inputs; the end of its log ($PWD/$log):" >&2
    # The panic's message, then the end of the log (libFuzzer's summary and the input).
    grep -m1 -A2 'panicked at' "$log" >&2 || true
    grep -v '^#[0-9]' "$log" | tail -n 12 >&2
    for input in "$artifacts"/crash-* "$artifacts"/timeout-* "$artifacts"/oom-* "$artifacts"/leak-*; do
        [[ -e $input ]] || continue
        echo "fuzz: $t: the input: $PWD/$input" >&2
        echo "fuzz: replay it with: (cd fuzz && PATH=$bin:\$PATH cargo fuzz run ${build[*]} $t $input)" >&2
    done
done

if ((${#failed[@]})); then
    echo "fuzz: failed: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${seconds} s each without a failure" >&2
