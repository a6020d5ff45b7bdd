import pytest

from strutil import slugify


@pytest.mark.parametrize("text,slug", [("Hello World", "hello-world"), ("Hello, World!", "hello-world"), ("x", "x")])
def test_slugify(text, slug):
    assert slugify(text) == slug


def test_unicode_transliteration():
    # A known limitation: fails before and after the fix.
    assert slugify("Cr\u00e8me br\u00fbl\u00e9e") == "creme-brulee"
