#!/usr/bin/env bash
# Build corral's packages from this checkout and check them:
#
#   scripts/build-packages.sh          the .debs (cargo-deb), checked with lintian
#   scripts/build-packages.sh rpm      the .rpms (rpmbuild with packaging/rpm/corral.spec)
#   scripts/build-packages.sh all      both
#
# Each kind is two packages: corral (the head: corrald, corralctl, their units) and
# corral-worker (corral-rpc@.service for a machine that lends its GPUs to a head).
# It prints the path of each package it built, one a line, corral's first.  The release
# build in target/release is shared and incremental, so a second run is quick.  Needs scripts/setup-system.sh
# (lintian, rpm) and installs cargo-deb with scripts/setup-packaging.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-deb}
case $what in deb | rpm | all) ;; *) echo "usage: $0 [deb|rpm|all]" >&2; exit 2 ;; esac

cargo build --release --locked --bin corrald --bin corralctl >&2
# Shell completions come from the binary itself, so they always match its command line.
# (cargo-deb reads them from target/completions in the checkout, as Cargo.toml names them.)
ctl=${CARGO_TARGET_DIR:-target}/release/corralctl
mkdir -p target/completions
"$ctl" completions bash >target/completions/corralctl
"$ctl" completions zsh >target/completions/_corralctl
"$ctl" completions fish >target/completions/corralctl.fish

if [[ $what == deb || $what == all ]]; then
    bin=$(scripts/setup-packaging.sh)
    deb=$("$bin/cargo-deb" --no-build --locked --quiet --strip)
    # The worker's package: Cargo.toml's [package.metadata.deb.variants.worker].
    worker=$("$bin/cargo-deb" --no-build --locked --quiet --variant worker)
    # Tags that do not apply: corral is not in Debian (no ITP bug to close), and its
    # maintainer address is a placeholder until it has a real one.
    lintian --fail-on warning --suppress-tags initial-upload-closes-no-bugs,bogus-mail-host "$deb" "$worker" >&2
    echo "$deb"
    echo "$worker"
fi

if [[ $what == rpm || $what == all ]]; then
    top=$PWD/target/rpmbuild
    mkdir -p "$top"
    args=(-bb --define "_topdir $top" --define "corral_srcdir $PWD" --define "_build_id_links none")
    # Hosts without Fedora's systemd-rpm-macros (Debian CI) get equivalent definitions,
    # and their build dependencies are not in an rpm database to be checked.
    rpm --eval '%{?systemd_post:yes}' | grep -q yes || args+=(--nodeps --load packaging/rpm/macros.systemd-compat)
    rpmbuild "${args[@]}" packaging/rpm/corral.spec >&2
    ls "$top"/RPMS/*/corral-[0-9]*.rpm | grep -v debug | head -n 1
    ls "$top"/RPMS/noarch/corral-worker-[0-9]*.rpm | head -n 1
fi
