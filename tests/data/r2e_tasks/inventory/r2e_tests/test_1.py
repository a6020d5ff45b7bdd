def test_add_accumulates(inv):
    inv.add("apple")
    inv.add("apple", 2)
    assert inv.count("apple") == 3


def test_missing(inv):
    assert inv.count("pear") == 0


def test_persist(db):
    assert db is not None
