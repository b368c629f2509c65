#!/usr/bin/env bash
# Install the Debian packages corral's build and test rig need (only those missing),
# and make sure the machine has what journald and systemd-in-namespaces require.
# Run as root on Debian 12 (CI, or a fresh development machine).
set -euo pipefail

packages=(
    # the real systemd pieces the tests start
    systemd dbus dbus-daemon dbus-bin libglib2.0-bin util-linux bsdutils passwd
    # clients the tests drive them with
    curl python3 python3-gi python3-venv procps
    # a real terminal for corralctl's top, progress and run (send keys, read the screen)
    tmux
    # the shells whose completions the tests check (bash is always there)
    zsh
    # a real OCI registry for pull and push
    docker-registry
    # checking the man pages
    groff-base
    # building and checking the packages (scripts/build-packages.sh)
    lintian rpm
    # building llama-server from source
    cmake ninja-build g++ python3-pip ca-certificates
)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || { echo "setup-system: missing packages ${missing[*]}; run as root" >&2; exit 1; }
    echo "setup-system: apt-get install ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Naming only the missing packages: naming an installed one would upgrade it.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
# journald refuses to start without a machine id.
[[ -s /etc/machine-id ]] || systemd-machine-id-setup >&2

if ! command -v cargo-nextest >/dev/null; then
    echo "setup-system: cargo install cargo-nextest" >&2
    cargo install --locked cargo-nextest >&2
fi
