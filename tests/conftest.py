"""Shared test set-up. Expensive fixtures (moto S3 server, sandbox image, vLLM server)
live in tests/fixtures/<area>.py, are session-scoped, and are registered here."""

import pathlib

import pytest
import torch

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (pathlib.Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
