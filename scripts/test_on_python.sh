#!/usr/bin/env bash
# Run the test suite on another CPython, in a virtual environment of its own.
#
#   bash scripts/test_on_python.sh VERSION [pytest args...]      e.g. 3.10, 3.15
#
# It installs this checkout with its [test] extra into a venv of that Python, as the
# README's test command does, and runs `python -m pytest` with the arguments given.
#
# Where the Python comes from:
# - python$VERSION on PATH, or pyenv's latest $VERSION.x (pyenv on these machines has
#   3.10-3.13);
# - else, as root on Linux, Debian sid's build, in a chroot made from Debian's package
#   registry (debootstrap; 3-5 minutes the first time, reused after). The checkout's tracked
#   files, uncommitted edits included, are copied in fresh on each run. The chroot lives in
#   $MULTIENV_CHROOT (default /var/tmp/multienv-sid), with its venvs in /opt; /proc, /sys
#   and /dev are bind-mounted in while it runs. A venv on this machine lives in
#   $MULTIENV_VENVS (default /var/tmp), named multienv-py$VERSION.
#
# If Debian's registry cannot be reached, it says so in one line and exits 0: the run it
# is part of goes on. Every other failure, the tests' included, exits non-zero.
set -euo pipefail
VERSION=${1:?usage: bash scripts/test_on_python.sh VERSION [pytest args...]}
shift
SRC=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${MULTIENV_VENVS:-/var/tmp}
CHROOT=${MULTIENV_CHROOT:-/var/tmp/multienv-sid}
APT=(-o Acquire::Check-Valid-Until=false -q -y)  # sid's Release files may be past it
SKIPPED="CPython $VERSION: not run: Debian's package registry cannot be reached from here"

host_python() {  # one that runs: pyenv puts a shim for every version on PATH
  local found root
  found=$(command -v "python$VERSION" 2>/dev/null) && "$found" -c pass 2>/dev/null && { echo "$found"; return; }
  root=$(pyenv root 2>/dev/null) || return 1
  found=$(ls -d "$root/versions/$VERSION".*/bin/python 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] && "$found" -c pass 2>/dev/null && echo "$found"
}

run_on_host() {
  local python=$1 venv="$VENVS/multienv-py$VERSION"
  shift
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  echo "== CPython $VERSION ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'), $python)"
  cd "$SRC"
  "$venv/bin/python" -m pip install -q -e ".[test]"
  "$venv/bin/python" -m pytest "$@"
}

unreachable() {  # whether a failed apt or debootstrap log says the registry was not reached
  grep -qiE "Temporary failure resolving|Could not resolve|Failed to fetch|Couldn't download|Failed getting release file|Connection (timed out|refused)|Network is unreachable" "$1"
}

make_chroot() {
  local log=/tmp/multienv-sid-debootstrap.log
  if ! command -v debootstrap >/dev/null; then
    apt-get update -q >/tmp/multienv-sid-apt.log 2>&1 && apt-get install -y -q debootstrap \
      >>/tmp/multienv-sid-apt.log 2>&1 || { unreachable /tmp/multienv-sid-apt.log && { echo "$SKIPPED"; exit 0; }
      echo "installing debootstrap failed: see /tmp/multienv-sid-apt.log" >&2; exit 1; }
  fi
  if grep -q " $CHROOT/" /proc/mounts; then  # never remove a tree with /dev bound into it
    echo "$CHROOT is half made and has mounts under it: unmount them, then remove it" >&2; exit 1
  fi
  rm -rf "$CHROOT"  # a half-made one from an interrupted run
  # No mirror named: debootstrap's own default for Debian.
  debootstrap --variant=minbase --include=ca-certificates sid "$CHROOT" >"$log" 2>&1 \
    || { unreachable "$log" && { rm -rf "$CHROOT"; echo "$SKIPPED"; exit 0; }
    echo "debootstrap failed: see $log" >&2; exit 1; }
  touch "$CHROOT/.multienv-complete"
}

run_in_chroot() {
  [ "$(id -u)" = 0 ] || { echo "CPython $VERSION is not on this machine; as root, a Debian chroot brings it" >&2; exit 1; }
  [ -f "$CHROOT/.multienv-complete" ] || make_chroot
  mounted=()
  trap 'for m in "${mounted[@]}"; do umount -l "$m" 2>/dev/null || true; done' EXIT
  for d in proc sys dev; do
    mountpoint -q "$CHROOT/$d" || { mount --rbind "/$d" "$CHROOT/$d"; mount --make-rslave "$CHROOT/$d"; mounted+=("$CHROOT/$d"); }
  done
  cp /etc/resolv.conf "$CHROOT/etc/resolv.conf"
  # pip in the chroot trusts what this machine trusts (the registry may sit behind a proxy).
  cp /etc/ssl/certs/ca-certificates.crt "$CHROOT/etc/ssl/certs/ca-certificates.crt"
  if [ ! -x "$CHROOT/usr/bin/python$VERSION" ] || ! chroot "$CHROOT" "python$VERSION" -m venv --help >/dev/null 2>&1; then
    local log=/tmp/multienv-sid-apt.log
    if ! { chroot "$CHROOT" apt-get update "${APT[@]}" >"$log" 2>&1 \
        && chroot "$CHROOT" env DEBIAN_FRONTEND=noninteractive apt-get install "${APT[@]}" \
          "python$VERSION" "python$VERSION-venv" procps >>"$log" 2>&1; }; then
      unreachable "$log" && { echo "$SKIPPED"; exit 0; }
      echo "apt-get in the chroot failed: see $log" >&2; exit 1
    fi
  fi
  rm -rf "$CHROOT/build/multienv"
  mkdir -p "$CHROOT/build/multienv"
  (cd "$SRC" && git ls-files -z | xargs -0 cp --parents -t "$CHROOT/build/multienv")
  local venv="/opt/multienv-py$VERSION" args
  args=$(printf '%q ' "$@")
  echo "== CPython $VERSION (Debian sid's, in $CHROOT)"
  chroot "$CHROOT" bash -c "cd /build/multienv && { [ -x $venv/bin/python ] || python$VERSION -m venv $venv; } \
    && $venv/bin/python -c 'import sys; print(sys.version)' \
    && $venv/bin/python -m pip install -q -e '.[test]' && $venv/bin/python -m pytest $args"
}

if python=$(host_python); then
  run_on_host "$python" "$@"
elif [ "$(uname -s)" = Linux ]; then
  run_in_chroot "$@"
else
  echo "CPython $VERSION is not on this machine" >&2
  exit 1
fi
