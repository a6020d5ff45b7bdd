"""Shared test set-up. Expensive fixtures (moto S3 server, sandbox image, vLLM server)
live in tests/fixtures/<area>.py, are session-scoped, and are registered here."""

import atexit
import os
import pathlib
import shutil
import tempfile

# Prefect: a throwaway home and no telemetry for the whole session, set before prefect is imported.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="rlvr-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"  # as flows.process sets it for a run

# Under `make test`'s two workers on two cores, every process gets one thread per math library (torch's
# OpenMP, OpenBLAS, MKL), before torch is imported: with two threads each, their OpenMP threads spin at
# every barrier while the other worker holds a core (`make bench-threads`, docs/history.md). Set the
# variable to override.
if "PYTEST_XDIST_WORKER" in os.environ:  # tests/fixtures/xdist_groups.py's under_xdist (not imported yet)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

# tests/data holds R2E-format task repos whose own hidden tests run inside sandboxes, not here.
collect_ignore = ["data"]

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (pathlib.Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


# Session fixtures that hold servers or clusters (memory, and CPU the tests after them need): each is
# torn down right after the last collected test that uses it, not at the session's end. Under xdist a
# worker runs whole work units (tests/fixtures/xdist_groups.py): the last reader in each unit.
RELEASED_AFTER_LAST_READER = ("prefect_ui", "ray_cluster", "vllm_server", "smoke_server")
_RELEASE = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the tests that will really run
def pytest_collection_modifyitems(config, items):
    from tests.fixtures.xdist_groups import under_xdist, work_unit

    last = {(name, work_unit(item.nodeid) if under_xdist() else ""): item
            for item in items for name in RELEASED_AFTER_LAST_READER if name in item.fixturenames}
    for (name, _), item in last.items():
        item.stash.setdefault(_RELEASE, []).append(name)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        for name in item.stash.get(_RELEASE, []):
            # FixtureDef.finish: the same teardown the session's end would run (its dependents first);
            # the session's own later call finds it finished.
            item._fixtureinfo.name2fixturedefs[name][-1].finish(item._request)


def pytest_sessionfinish(session, exitstatus):
    # Prefect's temporary API server stops at exit and says so on a stream pytest has closed by then
    # ("--- Logging error --- ... I/O operation on closed file"): stop it while the stream is open.
    import sys

    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for s in list(server.SubprocessASGIServer._instances.values()):
            s.stop()
