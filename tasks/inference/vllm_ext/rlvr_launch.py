"""Runs the vLLM server as its child and takes it down when our owner dies.

VLLMServer.stop() handles normal exits and exceptions, but a SIGKILLed (or
crashed) owner never gets to run it, and the server, in its own session, would
live on. This launcher polls its parent pid and terminates the server, then its
whole process group, once the parent is gone. Signals are forwarded.
Runs in vLLM's interpreter: standard library only.
"""

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    owner = os.getppid()
    child = subprocess.Popen(sys.argv[1:])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    while child.poll() is None:
        if os.getppid() != owner:
            child.terminate()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            os.killpg(os.getpgrp(), signal.SIGKILL)  # includes us
        time.sleep(0.5)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
