"""Small text helpers (a src-layout package)."""


def slugify(text):
    """Lower-case words joined by single dashes."""
    return "-".join(text.lower().split(" "))


def title_case(text):
    return " ".join(w.capitalize() for w in text.split())
