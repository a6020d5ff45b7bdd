from wordcount import longest_word


def test_first_of_equals_wins():
    assert longest_word("ab cd") == "ab"


def test_longest():
    assert longest_word("a abc ab") == "abc"


def test_empty():
    assert longest_word("") == ""
