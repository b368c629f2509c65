#!/usr/bin/env bash
# journald-sandbox.sh: run a command next to a private, real systemd-journald, for tests.
#
#   journald-sandbox.sh DIR -- CMD [ARGS...]
#
# In a private mount namespace, tmpfs hides the host's /run/systemd, /run/log and
# /var/log/journal; DIR/journal is bound at /run/log/journal, a fresh machine id (DIR/machine-id)
# over /etc/machine-id, and DIR/journald.conf (Storage=volatile, no rate limit, no forwarding)
# is journald's only configuration.  journald then serves the standard sockets
# (/run/systemd/journal/{socket,stdout,dev-log}) in that namespace only, and CMD runs there,
# so anything that logs to "the journal" logs to this one.  The host's journal, /run and
# /var/log are never touched.
#
# When CMD exits, the journal is synced (`journalctl --sync`), journald is stopped, and the
# script exits with CMD's status.  Read the entries with:
#   journalctl --directory DIR/journal -o json -a --no-pager
# which also works while CMD is still running.
#
# Files in DIR: cmd.pid (CMD's PID, written before it starts), journald.pid, journald.log,
# journald.conf, machine-id, journal/<machine-id>/system.journal.
# SIGTERM/SIGINT/SIGHUP to this script stop CMD and journald.
# Needs root, util-linux (unshare) and systemd (systemd-journald, journalctl, systemd-id128).
set -euo pipefail

die() { echo "journald-sandbox: $*" >&2; exit 70; }

if [ $# -lt 3 ] || [ "$2" != -- ]; then
  echo "usage: journald-sandbox.sh DIR -- CMD [ARGS...]" >&2
  exit 2
fi
DIR=$1
shift 2

JOURNALD=
for candidate in /lib/systemd/systemd-journald /usr/lib/systemd/systemd-journald; do
  if [ -x "$candidate" ]; then JOURNALD=$candidate; break; fi
done

if [ -z "${JOURNALD_SANDBOX_NS:-}" ]; then
  [ "$(id -u)" = 0 ] || die "must run as root (it mounts in a private mount namespace)"
  [ -n "$JOURNALD" ] || die "systemd-journald not found (apt-get install systemd)"
  for tool in unshare journalctl systemd-id128; do
    command -v "$tool" >/dev/null || die "missing tool: $tool"
  done
  # The machine id is replaced inside, but the file must exist to be a mount point.
  [ -e /etc/machine-id ] || die "/etc/machine-id does not exist (run systemd-machine-id-setup)"
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  exec env JOURNALD_SANDBOX_NS=1 unshare --mount --propagation private -- bash "$0" "$DIR" -- "$@"
fi

# From here on: inside the private mount namespace.
mkdir -p /run/systemd /run/log
mount -t tmpfs -o mode=0755 sandbox-run-systemd /run/systemd
mount -t tmpfs -o mode=0755 sandbox-run-log /run/log
if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=0755 sandbox-var-log-journal /var/log/journal; fi
# Drop-ins would override our journald.conf: hide them.
for d in /etc/systemd/journald.conf.d /usr/lib/systemd/journald.conf.d /usr/local/lib/systemd/journald.conf.d; do
  if [ -d "$d" ]; then mount -t tmpfs -o mode=0755 sandbox-dropins "$d"; fi
done

systemd-id128 new >"$DIR/machine-id"
mount --bind "$DIR/machine-id" /etc/machine-id
mkdir -p "$DIR/journal" /run/log/journal /run/systemd/journal
mount --bind "$DIR/journal" /run/log/journal
cat >"$DIR/journald.conf" <<'CONF'
[Journal]
Storage=volatile
ReadKMsg=no
Audit=no
RateLimitIntervalSec=0
RuntimeMaxUse=128M
ForwardToSyslog=no
ForwardToKMsg=no
ForwardToConsole=no
ForwardToWall=no
MaxLevelStore=debug
CONF
[ -e /etc/systemd/journald.conf ] || die "/etc/systemd/journald.conf does not exist (apt-get install systemd)"
mount --bind "$DIR/journald.conf" /etc/systemd/journald.conf

JOURNALD_PID=
CMD_PID=
# shellcheck disable=SC2317 # called from the EXIT trap
stop_all() {
  if [ -n "$CMD_PID" ]; then kill -s TERM "$CMD_PID" 2>/dev/null || true; fi
  if [ -n "$JOURNALD_PID" ]; then kill -s TERM "$JOURNALD_PID" 2>/dev/null || true; fi
  wait 2>/dev/null || true
}
trap 'stop_all' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

"$JOURNALD" >"$DIR/journald.log" 2>&1 &
JOURNALD_PID=$!
echo "$JOURNALD_PID" >"$DIR/journald.pid"
for ((i = 0; i < 500; i++)); do
  [ -S /run/systemd/journal/socket ] && [ -S /run/systemd/journal/stdout ] && break
  kill -0 "$JOURNALD_PID" 2>/dev/null || { cat "$DIR/journald.log" >&2; die "systemd-journald exited"; }
  sleep 0.02
done
[ -S /run/systemd/journal/socket ] || { cat "$DIR/journald.log" >&2; die "journald's socket did not appear in 10s"; }

# CMD's PID is the wrapper shell's, which then execs CMD.
# shellcheck disable=SC2016 # expanded by the inner shell
bash -c 'echo "$$" >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$DIR/cmd.pid" "$@" &
CMD_PID=$!
rc=0
wait "$CMD_PID" || rc=$?
CMD_PID=
journalctl --sync >/dev/null 2>&1 || echo "journald-sandbox: journalctl --sync failed" >&2
exit "$rc"
