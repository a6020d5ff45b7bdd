#!/usr/bin/env bash
# System set-up for the sandboxes (Debian 12, run as root; no systemd needed).
#
#   - installs the Debian packages the sandbox tests need, only when one is missing;
#   - starts dockerd when the engine does not answer, and waits until it does.
#
# Idempotent and fast the second time (one dpkg query + one `docker info`): the
# Makefile and CI call it before every test run. Set RLVR_SKIP_DOCKER=1 to leave
# the engine alone (bwrap-only machines).
set -euo pipefail

# chromium: the UI browser test; docker-compose: validating infra/compose.yaml; curl: make ui's health checks
PACKAGES=(docker.io bubblewrap debootstrap iptables git util-linux coreutils procps ca-certificates chromium docker-compose
          curl)
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/rlvr-dockerd.log}
WAIT_S=${DOCKERD_WAIT_S:-60}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in "${PACKAGES[@]}"; do
  # "install ok installed" is dpkg's word for a fully configured package.
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "system-setup: installing ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ "${RLVR_SKIP_DOCKER:-0}" = 1 ]; then
  exit 0
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi

if ! pgrep -x dockerd >/dev/null; then
  echo "system-setup: starting dockerd (log: $DOCKERD_LOG)"
  # No bridge and no iptables: every sandbox runs with network_mode=none, and this
  # sandbox images are built locally from Debian packages. overlay2 is the fast driver.
  as_root sh -c "nohup dockerd --iptables=false --bridge=none --storage-driver=overlay2 >>'$DOCKERD_LOG' 2>&1 &"
fi

for _ in $(seq 1 $((WAIT_S * 4))); do
  if docker info >/dev/null 2>&1; then
    echo "system-setup: docker engine is up"
    exit 0
  fi
  sleep 0.25
done
echo "system-setup: dockerd did not answer within ${WAIT_S}s; see $DOCKERD_LOG" >&2
tail -n 20 "$DOCKERD_LOG" >&2 || true
exit 1
