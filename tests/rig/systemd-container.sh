#!/usr/bin/env bash
# systemd-container.sh: boot the host's own systemd as PID 1 of a throwaway container, for
# integration tests.  It needs root, util-linux (unshare, nsenter, setpriv) and overlayfs; no
# image, no nspawn, no systemd on the host.
#
#   NAME=ct1 CT_DIR=target/ct SHARE=target/share systemd-container.sh up
#   NAME=ct1 CT_DIR=target/ct systemd-container.sh exec systemctl status
#   NAME=ct1 CT_DIR=target/ct systemd-container.sh down
#
# Commands:
#   up          boot, then wait until `systemctl is-system-running` says running or degraded
#               (exit 1 on timeout or early death; the container may still be up: call down)
#   exec CMD..  run CMD inside, in all the container's namespaces, with a clean environment
#   pid         print the host PID of the container's PID 1
#   down        power off (SIGRTMIN+4), SIGKILL after a grace period, remove the cgroups;
#               safe to call when the container is not (or only half) up
#
# Environment:
#   NAME          container name, also its hostname and cgroup name (default corral-ct)
#   CT_DIR        parent of the container's state dir CT_DIR/NAME (default <repo>/target/containers)
#   SHARE         host dir shown read-only at /srv/host inside (default: an empty CT_DIR/NAME/share)
#   CGMODE        unified (cgroup2 inside, the default) or legacy (cgroup v1 hierarchies)
#   BOOT_TIMEOUT  seconds `up` waits for the boot (default 120)
#   STOP_TIMEOUT  seconds `down` waits for the poweroff before SIGKILL (default 30)
#   WATCH_PID     if set, `up` leaves a reaper behind that runs `down` once this process is gone,
#                 so that a test killed before its teardown does not leave a container running
#
# What the container is:
#   - root: overlayfs with the host's / as its read-only lower layer and a tmpfs as upper layer,
#     so nothing written inside reaches the host (only the root file system is seen: other
#     host mounts show up as their empty mount points, which is why SHARE exists);
#   - namespaces: mount, pid, uts, ipc, cgroup, and net (with only lo, which systemd brings up);
#   - /proc/sys and /sys read-only, a private /dev with a few device nodes, /dev/console bound
#     to CT_DIR/NAME/console.log, a fresh tmpfs on /tmp, a new machine id and hostname;
#   - units that would only slow a boot down or wait for hardware are masked; journald keeps
#     its journal in memory.
#   Host files must go in through SHARE (at /srv/host), never under /tmp, /var/tmp or /run
#   inside: systemd-tmpfiles cleans those at boot.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF=$HERE/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$HERE/../.." && pwd)
NAME=${NAME:-corral-ct}
CT_DIR=${CT_DIR:-$REPO/target/containers}
case $CT_DIR in /*) ;; *) CT_DIR=$PWD/$CT_DIR ;; esac
CT=$CT_DIR/$NAME
CGMODE=${CGMODE:-unified}
BOOT_TIMEOUT=${BOOT_TIMEOUT:-120}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
INNER_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
V1_CONTROLLERS=(memory pids cpu cpuacct blkio devices freezer cpuset)

die() { echo "systemd-container: $*" >&2; exit 1; }

case $NAME in
  '' | *[!A-Za-z0-9_.-]* | .* ) die "NAME must be non-empty and use only letters, digits, '_', '.', '-': '$NAME'" ;;
esac
[ ${#NAME} -le 60 ] || die "NAME is longer than 60 characters: $NAME"

# Where this host mounts cgroup2: /sys/fs/cgroup itself (unified host) or .../unified (hybrid).
cgroup2_mount() {
  if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then echo /sys/fs/cgroup
  elif [ -d /sys/fs/cgroup/unified ] && [ "$(stat -fc %T /sys/fs/cgroup/unified)" = cgroup2fs ]; then
    echo /sys/fs/cgroup/unified
  else die "no cgroup2 mount at /sys/fs/cgroup or /sys/fs/cgroup/unified"; fi
}

# Our own path in a cgroup hierarchy: "0" for cgroup2, else a v1 controller name.
own_cgroup() {
  local key=$1
  [ "$key" = systemd ] && key=name=systemd
  awk -F: -v k="$key" '($1 == "0" && k == "0") || $2 == k { print ($3 == "/" ? "" : $3); exit }' /proc/self/cgroup
}

# The host PID of our unshare process, if it still runs (a recycled PID does not count).
unshare_pid() {
  local u
  u=$(cat "$CT/unshare.pid" 2>/dev/null) || return 1
  case $u in '' | *[!0-9]*) return 1 ;; esac
  tr '\0' ' ' <"/proc/$u/cmdline" 2>/dev/null | grep -q '^unshare .* __stage2 *$' || return 1
  echo "$u"
}

# The host PID of the container's PID 1: the only child of the unshare process.
pid1() {
  local u c
  u=$(unshare_pid) || return 1
  c=$(cat "/proc/$u/task/$u/children" 2>/dev/null) || return 1
  c=${c%% *}
  [ -n "$c" ] || return 1
  echo "$c"
}

in_container() {
  local p
  p=$(pid1) || die "container $NAME is not running"
  nsenter --target "$p" --mount --uts --ipc --net --pid --cgroup -- \
    env -i PATH=$INNER_PATH HOME=/root LANG=C.UTF-8 TERM=dumb SYSTEMD_PAGER=cat SYSTEMD_COLORS=0 "$@"
}

# Runs as PID 1 of the new PID namespace, inside the new mount, uts, ipc, net and cgroup
# namespaces; builds the root file system, then execs systemd.
stage2() {
  local root=$CT/root layer=$CT/layer
  mount -t tmpfs -o mode=0755 ct-layer "$layer"
  mkdir -p "$layer/upper" "$layer/work"
  mount -t overlay ct-root -o "lowerdir=/,upperdir=$layer/upper,workdir=$layer/work" "$root"

  # Corral's own files on this host are not the container's: a corrald run here as root
  # (scripts/run.sh) keeps its store in /var/lib/corral, and the tests install and start
  # corral as on a machine that never had it. Removed from the merged view only: overlayfs
  # records whiteouts in the tmpfs layer, and the host's files stay as they are.
  rm -rf "$root/var/lib/corral" "$root/var/cache/corral" "$root/var/cache/corral-rpc" "$root/etc/corral"

  # Local configuration, written to the tmpfs layer only.
  rm -f "$root/etc/machine-id"
  systemd-id128 new >"$root/etc/machine-id"
  echo "$NAME" >"$root/etc/hostname"
  hostname "$NAME"
  local units=$root/etc/systemd/system u
  mkdir -p "$units"
  ln -sfn /lib/systemd/system/multi-user.target "$units/default.target"
  for u in getty@tty1.service getty.target console-getty.service serial-getty@.service \
    systemd-networkd-wait-online.service systemd-timesyncd.service systemd-pstore.service \
    e2scrub_reap.service postgresql.service ssh.service cron.service \
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer \
    fstrim.timer man-db.timer logrotate.timer systemd-tmpfiles-clean.timer; do
    ln -sfn /dev/null "$units/$u"
  done
  mkdir -p "$root/etc/systemd/journald.conf.d"
  printf '[Journal]\nStorage=volatile\nRateLimitIntervalSec=0\nForwardToSyslog=no\nForwardToWall=no\n' \
    >"$root/etc/systemd/journald.conf.d/10-container.conf"

  # Host files, read-only.
  mkdir -p "$root/srv/host"
  mount --bind "$SHARE" "$root/srv/host"
  mount -o remount,bind,ro "$root/srv/host"
  mount -t tmpfs -o mode=1777,nosuid,nodev ct-tmp "$root/tmp"

  # API file systems.
  mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
  mount --bind "$root/proc/sys" "$root/proc/sys"
  mount -o remount,bind,ro "$root/proc/sys"
  if [ -e "$root/proc/sysrq-trigger" ]; then
    mount --bind "$root/proc/sysrq-trigger" "$root/proc/sysrq-trigger"
    mount -o remount,bind,ro "$root/proc/sysrq-trigger"
  fi
  mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
  if [ "$CGMODE" = unified ]; then
    mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$root/sys/fs/cgroup"
  else
    mount -t tmpfs -o mode=0755,nosuid,nodev,noexec ct-cgroup "$root/sys/fs/cgroup"
    local c
    for c in "${V1_CONTROLLERS[@]}"; do
      mkdir -p "$root/sys/fs/cgroup/$c"
      mount -t cgroup -o "nosuid,nodev,noexec,$c" cgroup "$root/sys/fs/cgroup/$c"
    done
    mkdir -p "$root/sys/fs/cgroup/systemd"
    mount -t cgroup -o nosuid,nodev,noexec,none,name=systemd cgroup "$root/sys/fs/cgroup/systemd"
    mount -o remount,ro "$root/sys/fs/cgroup"
  fi
  mount -t tmpfs -o mode=0755,nosuid,size=4m ct-dev "$root/dev"
  local n
  for n in null zero full random urandom tty; do
    touch "$root/dev/$n"
    mount --bind "/dev/$n" "$root/dev/$n"
  done
  mkdir -p "$root/dev/pts" "$root/dev/shm" "$root/dev/mqueue"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$root/dev/pts"
  ln -s pts/ptmx "$root/dev/ptmx"
  ln -s /proc/self/fd "$root/dev/fd"
  ln -s /proc/self/fd/0 "$root/dev/stdin"
  ln -s /proc/self/fd/1 "$root/dev/stdout"
  ln -s /proc/self/fd/2 "$root/dev/stderr"
  touch "$root/dev/console"
  mount --bind "$CT/console.log" "$root/dev/console"

  # Switch to the new root and become systemd, without the capabilities a container must not
  # use (the same set systemd-nspawn drops).
  cd "$root"
  mkdir -p .host-root
  pivot_root . .host-root
  cd /
  umount -l /.host-root
  rmdir /.host-root
  exec env -i container=other container_uuid="$(cat /etc/machine-id)" PATH=$INNER_PATH TERM=dumb \
    setpriv --bounding-set=-sys_module,-sys_rawio,-sys_time,-sys_pacct,-mac_admin,-mac_override,-syslog,-wake_alarm,-block_suspend,-audit_read \
    /lib/systemd/systemd --system --show-status=no
}

up() {
  [ "$(id -u)" = 0 ] || die "must run as root"
  local tool
  for tool in unshare nsenter setpriv systemd-id128 awk; do
    command -v "$tool" >/dev/null || die "missing tool: $tool"
  done
  [ -x /lib/systemd/systemd ] || die "missing /lib/systemd/systemd (apt-get install systemd)"
  grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
  grep -qw overlay /proc/filesystems || die "the kernel has no overlayfs"
  if pid1 >/dev/null; then die "container $NAME is already up (pid $(pid1))"; fi

  mkdir -p "$CT/root" "$CT/layer"
  : >"$CT/console.log"
  : >"$CT/stage.log"
  if [ -z "${SHARE:-}" ]; then SHARE=$CT/share; mkdir -p "$SHARE"; fi
  [ -d "$SHARE" ] || die "SHARE is not a directory: $SHARE"
  SHARE=$(cd "$SHARE" && pwd)

  # The container's cgroups are children of ours in every hierarchy it uses, so that whatever
  # limits apply to us apply to it too.  `down` removes them, so they are listed.
  local cg2 dirs=() d c
  cg2=$(cgroup2_mount)
  dirs+=("$cg2$(own_cgroup 0)/$NAME")
  if [ "$CGMODE" = legacy ]; then
    for c in "${V1_CONTROLLERS[@]}" systemd; do
      dirs+=("/sys/fs/cgroup/$c$(own_cgroup "$c")/$NAME")
    done
  elif [ "$CGMODE" != unified ]; then
    die "CGMODE must be unified or legacy: $CGMODE"
  fi
  printf '%s\n' "${dirs[@]}" >"$CT/cgroups"
  for d in "${dirs[@]}"; do
    mkdir -p "$d"
    if [ "${d#/sys/fs/cgroup/cpuset/}" != "$d" ]; then
      # cpuset needs cpus and mems before a task may join
      cat "$(dirname "$d")/cpuset.cpus" >"$d/cpuset.cpus"
      cat "$(dirname "$d")/cpuset.mems" >"$d/cpuset.mems"
    fi
  done

  local t0 deadline state=''
  export NAME CT_DIR SHARE CGMODE
  t0=$(date +%s%N)
  # A new session leader joins the container's cgroups, then unshares: the new cgroup namespace
  # is rooted there.  --kill-child: if unshare dies, PID 1 dies too.
  # shellcheck disable=SC2016 # expanded by the inner shell
  setsid bash -c '
    ct=$1; shift
    for f in "$@"; do echo $$ >"$f/cgroup.procs"; done
    echo $$ >"$ct/unshare.pid"
    exec unshare --cgroup --mount --propagation private --uts --ipc --net --pid --fork --kill-child \
      env CONTAINER_STAGE2=1 bash "$0" __stage2
  ' "$SELF" "$CT" "${dirs[@]}" \
    </dev/null >"$CT/stage.log" 2>&1 &
  deadline=$(($(date +%s) + BOOT_TIMEOUT))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if pid1 >/dev/null; then
      state=$(in_container systemctl is-system-running 2>/dev/null || true)
      case $state in running | degraded) break ;; esac
    elif [ -s "$CT/unshare.pid" ] && ! kill -0 "$(cat "$CT/unshare.pid")" 2>/dev/null; then
      echo "systemd-container: $NAME died while booting; stage log:" >&2
      cat "$CT/stage.log" >&2
      echo "--- console (last 40 lines):" >&2
      tail -n 40 "$CT/console.log" >&2
      return 1
    fi
    sleep 0.1
  done

  if [ -n "${WATCH_PID:-}" ]; then
    setsid bash "$SELF" __reaper "$WATCH_PID" </dev/null >>"$CT/reaper.log" 2>&1 &
  fi
  echo "state=${state:-unknown} pid1=$(pid1 || echo none) boot_ms=$((($(date +%s%N) - t0) / 1000000))"
  case $state in
    running | degraded) return 0 ;;
    *)
      echo "systemd-container: $NAME did not finish booting within ${BOOT_TIMEOUT}s (state '$state')" >&2
      in_container systemctl --no-pager list-jobs >&2 2>&1 || true
      tail -n 40 "$CT/console.log" >&2
      return 1
      ;;
  esac
}

down() {
  local u p i
  u=$(unshare_pid || true)
  if p=$(pid1); then
    kill -s RTMIN+4 "$p" 2>/dev/null || true # systemd: start poweroff.target
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
      kill -0 "$p" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$p" 2>/dev/null; then
      echo "systemd-container: $NAME did not power off within ${STOP_TIMEOUT}s; SIGKILL" >&2
      kill -s KILL "$p" 2>/dev/null || true
    fi
  fi
  if [ -n "$u" ]; then
    for ((i = 0; i < 100; i++)); do
      kill -0 "$u" 2>/dev/null || break
      sleep 0.1
    done
    kill -s KILL "$u" 2>/dev/null || true
  fi
  # Remove the cgroups, deepest first; kill anything left over in them first.
  local d left=0
  if [ -f "$CT/cgroups" ]; then
    while read -r d; do
      [ -d "$d" ] || continue
      for ((i = 0; i < 50; i++)); do
        find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [ -d "$d" ] || break
        if [ -e "$d/cgroup.kill" ]; then echo 1 >"$d/cgroup.kill" 2>/dev/null || true
        else
          find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | while read -r pid; do
            kill -s KILL "$pid" 2>/dev/null || true
          done
        fi
        sleep 0.1
      done
      if [ -d "$d" ]; then echo "systemd-container: could not remove cgroup $d" >&2; left=1; fi
    done <"$CT/cgroups"
  fi
  rm -f "$CT/unshare.pid" "$CT/cgroups"
  rmdir "$CT/root" "$CT/layer" 2>/dev/null || true
  echo "down"
  return "$left"
}

# Waits until process $1 is gone, then takes the container down (if it is still up).
reaper() {
  local watched=$1
  while kill -0 "$watched" 2>/dev/null; do
    [ -e "$CT/unshare.pid" ] || exit 0
    sleep 1
  done
  if [ -e "$CT/unshare.pid" ]; then
    echo "$(date -Is) process $watched is gone; taking $NAME down"
    down
  fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  pid) pid1 || die "container $NAME is not running" ;;
  exec)
    shift
    [ $# -gt 0 ] || die "usage: systemd-container.sh exec CMD [ARGS...]"
    in_container "$@"
    ;;
  __stage2) [ -n "${CONTAINER_STAGE2:-}" ] || die "__stage2 is internal"; stage2 ;;
  __reaper) reaper "$2" ;;
  *)
    sed -n '2,/^set -euo/p' "$SELF" | sed '$d' >&2
    exit 2
    ;;
esac
