#!/usr/bin/env bash
# Network sources for tests/netfs and `vllm-fastload bench --source sshfs|s3`. Never fatal: the
# tests that need one skip and name what is missing and how to get it.
#   sshfs + a private sshd: Debian/Ubuntu packages openssh-server, openssh-client, sshfs (apt, as root
#                           or with passwordless sudo); FUSE needs /dev/fuse (containers: --device
#                           /dev/fuse --cap-add SYS_ADMIN); sshfs brings fuse3 (fusermount3, libfuse 3),
#                           which tests/faultfs.py (the fault-injecting filesystem) also uses
#   s3rver                : npm package, into .fastload/s3rver (never globally)
# Run by scripts/test.sh; safe to run again and again (it does nothing once both are there).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
have_sshd() { command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; }
apt_install() {  # packages...; quietly, as root or with passwordless sudo
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$(id -u)" = 0 ]; then local sudo=(); elif sudo -n true 2>/dev/null; then local sudo=(sudo -n); else return 1; fi
  local install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@")
  "${install[@]}" >/dev/null 2>&1 || { "${sudo[@]}" apt-get update >/dev/null 2>&1 && "${install[@]}" >/dev/null 2>&1; }
}
if ! { command -v sshfs >/dev/null 2>&1 && have_sshd && command -v fusermount3 >/dev/null 2>&1; }; then
  echo "installing openssh-server, sshfs and fuse3 (tests/netfs, tests/core/test_faults.py) ..." >&2
  apt_install openssh-server openssh-client sshfs fuse3 \
    || echo "could not install openssh-server/sshfs (needs apt-get and root or passwordless sudo): the sshfs tests skip" >&2
fi
if [ ! -e "$root/.fastload/s3rver/node_modules/s3rver/bin/s3rver.js" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "installing nodejs and npm (s3rver for tests/netfs) ..." >&2
    apt_install nodejs npm || echo "could not install nodejs/npm" >&2
  fi
  if command -v npm >/dev/null 2>&1; then
    echo "installing s3rver into .fastload/s3rver (bench --source s3) ..." >&2
    npm install --no-audit --no-fund --silent --prefix "$root/.fastload/s3rver" s3rver@3.7.1 >/dev/null 2>&1 \
      || echo "npm install s3rver failed: the s3rver tests skip" >&2
  else
    echo "no npm: the s3rver tests skip (apt-get install nodejs npm)" >&2
  fi
fi
exit 0
