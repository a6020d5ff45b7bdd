"""python -m tasks.sandbox reap|leftovers [--no-docker]: clean up after killed processes / list what is held."""

import argparse
import sys

from tasks.sandbox import leftovers, reap_stale


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.sandbox")
    p.add_argument("cmd", choices=["reap", "leftovers"])
    p.add_argument("--pid", type=int, help="leftovers: of this process (default: every rlvr sandbox)")
    p.add_argument("--no-docker", action="store_true")
    a = p.parse_args()
    if a.cmd == "reap":
        for r in reap_stale(docker=not a.no_docker):
            print("removed", r)
    else:
        for r in leftovers(a.pid, docker=not a.no_docker) if a.pid else _all(not a.no_docker):
            print(r)
    return 0


def _all(docker: bool) -> list[str]:
    from tasks.sandbox import bwrap

    out = []
    for parent in bwrap._parents():
        out += [str(d) for d in parent.iterdir() if d.is_dir()] if parent.is_dir() else []
    out += [str(d) for d in bwrap.sandbox_work_root().iterdir()] if bwrap.sandbox_work_root().is_dir() else []
    if docker:
        from tasks.sandbox import dockerbox

        out += [c.name for c in dockerbox.client().containers.list(all=True, filters={"label": dockerbox.LABEL})]
    return out


if __name__ == "__main__":
    sys.exit(main())
