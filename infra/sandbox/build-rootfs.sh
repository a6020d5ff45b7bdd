#!/usr/bin/env bash
# Build the sandbox root filesystem from Debian packages (no registry needed).
#
#   build-rootfs.sh DEST [SUITE] [MIRROR]
#
# DEST must not exist; the caller (tasks/sandbox/image.py) builds into a temporary
# directory and renames it into place, so a half-built rootfs is never used.
# The package list is $RLVR_SANDBOX_PACKAGES (comma separated), set by image.py so
# that the list and this script together form the cache key.
set -euo pipefail

DEST=$1
SUITE=${2:-bookworm}
MIRROR=${3:-http://deb.debian.org/debian}
PACKAGES=${RLVR_SANDBOX_PACKAGES:-python3,python3-pytest,git}

if [ -e "$DEST" ]; then echo "build-rootfs: $DEST exists" >&2; exit 2; fi

debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$DEST" "$MIRROR"

# Trim what a sandbox never reads: docs, manuals, translations, apt's caches and
# lists, logs. Smaller rootfs = faster `docker import` and less disk per cache.
rm -rf "$DEST"/usr/share/doc/* "$DEST"/usr/share/man/* "$DEST"/usr/share/info/* \
       "$DEST"/usr/share/locale/* "$DEST"/usr/share/lintian "$DEST"/usr/share/common-licenses \
       "$DEST"/var/cache/apt/* "$DEST"/var/lib/apt/lists/* "$DEST"/var/cache/debconf/*-old \
       "$DEST"/var/log/* "$DEST"/tmp/* "$DEST"/root/.[!.]* 2>/dev/null || true
# Keep (and complete) the bytecode caches: the root filesystem is read-only inside the
# sandbox, so without them every pytest run recompiles pytest (~0.7 s each).
chroot "$DEST" python3 -m compileall -q /usr/lib/python3/dist-packages /usr/lib/python3.11 >/dev/null 2>&1 || true

# The unprivileged sandbox user (uid/gid 1000). Its HOME is /tmp: the only
# writable place besides /testbed, and per-sandbox.
echo 'sandbox:x:1000:1000:sandbox:/tmp:/bin/bash' >> "$DEST"/etc/passwd
echo 'sandbox:x:1000:' >> "$DEST"/etc/group
echo 'sandbox:!:19000::::::' >> "$DEST"/etc/shadow

# /testbed is the repo mount point (bwrap cannot create mount points on a
# read-only root). /root holds hidden tests in grading mode and must be
# traversable by uid 1000, who runs them.
mkdir -p "$DEST"/testbed
chmod 755 "$DEST"/root "$DEST"/testbed

# Git: the repo's owner differs between backends (uid 1000, root, a mapped uid);
# `safe.directory=*` stops git refusing to work on it. A fixed identity lets
# `git commit`/`git stash` run without set-up.
cat > "$DEST"/etc/gitconfig <<'GIT'
[safe]
	directory = *
[user]
	name = sandbox
	email = sandbox@localhost
[core]
	pager = cat
[advice]
	detachedHead = false
GIT

echo "build-rootfs: $(du -sh "$DEST" | cut -f1) in $DEST"
