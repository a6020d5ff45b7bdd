"""The sandbox base image: one Debian rootfs, used twice.

`python -m tasks.sandbox.image build` (or `ensure_image()`) debootstraps a minimal
bookworm with python3, python3-pytest and git (infra/sandbox/build-rootfs.sh),
keeps it under `.rlvr/sandbox/rootfs/` as the bwrap root filesystem, and
`docker import`s the same tree as `rlvr-sandbox:bookworm`. No registry is
involved. Both are cached by a content key (package list + suite + build
script); a changed script or list rebuilds, an unchanged one costs a stat and a
label look-up.

    python -m tasks.sandbox.image build [--no-docker]
    python -m tasks.sandbox.image key
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "infra" / "sandbox" / "build-rootfs.sh"
PACKAGES = ("python3", "python3-pytest", "git")
SUITE = "bookworm"
MIRROR = os.environ.get("RLVR_DEBIAN_MIRROR", "http://deb.debian.org/debian")
IMAGE = "rlvr-sandbox:bookworm"
KEY_LABEL = "rlvr.sandbox.key"


def cache_dir() -> pathlib.Path:
    # Project-local and git-ignored (.rlvr/); RLVR_CACHE_DIR moves it (CI caches).
    return pathlib.Path(os.environ.get("RLVR_CACHE_DIR", REPO_ROOT / ".rlvr")) / "sandbox"


def content_key() -> str:
    h = hashlib.sha256()
    h.update(",".join(PACKAGES).encode())
    h.update(SUITE.encode())
    h.update(BUILD_SCRIPT.read_bytes())
    return h.hexdigest()[:16]


def rootfs_path() -> pathlib.Path:
    return cache_dir() / "rootfs"


def rootfs_ready() -> bool:
    key_file = cache_dir() / "rootfs.key"
    return rootfs_path().is_dir() and key_file.exists() and key_file.read_text().strip() == content_key()


def _log(msg: str) -> None:
    print(f"[sandbox-image] {msg}", file=sys.stderr, flush=True)


_background: Future | None = None  # the build start_rootfs_build began in this process


def start_rootfs_build() -> None:
    """Build the rootfs (if missing or stale) in a thread while the caller goes on: debootstrap keeps
    one core busy. ensure_rootfs then waits for it and raises its error. A daemon thread: a stopped
    run exits at once; the run's watchdog ends debootstrap and the next build removes its tree."""
    global _background
    if _background is not None or rootfs_ready():
        return
    _background = Future()

    def build(future: Future) -> None:
        try:
            future.set_result(_build_rootfs())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=build, args=(_background,), name="rootfs-build", daemon=True).start()


def ensure_rootfs() -> pathlib.Path:
    """Build the rootfs if missing or stale; returns its path. Safe across processes (file lock)."""
    if _background is not None:
        return _background.result()
    return _build_rootfs()


def _build_rootfs() -> pathlib.Path:
    if rootfs_ready():
        return rootfs_path()
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rootfs_ready():  # another process built it while we waited
            return rootfs_path()
        for stale in [*d.glob("rootfs.tmp-*"), *d.glob("rootfs.old-*")]:  # left by a build killed outright
            shutil.rmtree(stale, ignore_errors=True)
        tmp = d / f"rootfs.tmp-{os.getpid()}"
        t0 = time.monotonic()
        _log(f"debootstrap {SUITE} ({','.join(PACKAGES)}) -> {rootfs_path()} (about a minute)")
        env = dict(os.environ, RLVR_SANDBOX_PACKAGES=",".join(PACKAGES))
        try:
            subprocess.run(["bash", str(BUILD_SCRIPT), str(tmp), SUITE, MIRROR], env=env, check=True,
                           stdout=subprocess.DEVNULL if not os.environ.get("RLVR_VERBOSE") else None)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = d / f"rootfs.old-{os.getpid()}"
        if rootfs_path().exists():
            rootfs_path().rename(old)
        tmp.rename(rootfs_path())
        (d / "rootfs.key").write_text(content_key() + "\n")
        shutil.rmtree(old, ignore_errors=True)
        _log(f"rootfs built in {time.monotonic() - t0:.0f} s")
    return rootfs_path()


def docker_image_ready(client=None, image: str = IMAGE) -> bool:
    import docker

    client = client or docker.from_env()
    try:
        img = client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return (img.labels or {}).get(KEY_LABEL) == content_key()


def ensure_docker_image(client=None, image: str = IMAGE) -> str:
    """Import the rootfs as a docker image (tagged `image`) unless one with the same key exists."""
    import docker

    client = client or docker.from_env()
    if docker_image_ready(client, image):
        return image
    root = ensure_rootfs()
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if docker_image_ready(client, image):
            return image
        t0 = time.monotonic()
        # `docker import` streams the tree; the label carries the content key for the check above.
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run(["docker", "import", "--change", f"LABEL {KEY_LABEL}={content_key()}",
                            "--change", "WORKDIR /testbed", "-", image],
                           stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        finally:
            tar.stdout.close()
            tar.wait()
        _log(f"docker import {image} in {time.monotonic() - t0:.1f} s")
    return image


def ensure_image(docker_too: bool = True) -> pathlib.Path:
    root = ensure_rootfs()
    if docker_too:
        ensure_docker_image()
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.sandbox.image")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or verify) the rootfs and the docker image")
    b.add_argument("--no-docker", action="store_true", help="rootfs only (bwrap machines)")
    sub.add_parser("key", help="print the content key")
    a = p.parse_args(argv)
    if a.cmd == "key":
        print(content_key())
        return 0
    t0 = time.monotonic()
    root = ensure_image(docker_too=not a.no_docker)
    print(f"rootfs {root} key {content_key()}" + ("" if a.no_docker else f" image {IMAGE}")
          + f" ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
