#!/usr/bin/env bash
# Set everything up and run corral's whole test suite: the one command for CI and for
# a fresh machine (as root, Debian 12).  Later runs reuse the llama-server build cached
# in /var/cache/corral-dev.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-system.sh
scripts/setup-llama-server.sh >/dev/null
scripts/setup-python-clients.sh >/dev/null
scripts/setup-packaging.sh >/dev/null

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked --quiet
# The private items' docs too: their links are the codemap inside each module.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked --quiet --document-private-items
# Licences, bans and sources of the dependency graph (offline: no advisory database).
# cargo-deny reads the whole graph, every platform's crates included: fetched first, as a
# fresh machine's build fetches only this platform's.
cargo fetch --locked --quiet
"$(scripts/setup-deny.sh)/cargo-deny" --frozen check licenses bans sources
# The declared rust-version really builds (Debian's rustc of that release).
scripts/check-msrv.sh
cargo build --all-targets --locked
# Both packages, lintian included; the package tests (tests/it/packages.rs) reuse this build.
scripts/build-packages.sh all >/dev/null
cargo nextest run --profile ci --locked
# Every fuzz target for CORRAL_FUZZ_SECONDS (20) on its seeds; a crash fails the run.
scripts/fuzz.sh
