import pytest

from inventory import Inventory


@pytest.fixture
def inv():
    return Inventory()


@pytest.fixture
def db():
    raise RuntimeError("no database in the sandbox")
