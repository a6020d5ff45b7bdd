from tally import count_words


def test_counts_ignore_case():
    assert count_words("A a b") == {"a": 2, "b": 1}


def test_counts_plain():
    assert count_words("x y x") == {"x": 2, "y": 1}


def test_plugin_is_loaded(pytestconfig):
    assert pytestconfig.getoption("--cov") == ["tally"]
