"""Word counting."""


def longest_word(text):
    """The longest word; the first of equally long ones."""
    best = ""
    for word in text.split():
        if len(word) >= len(best):
            best = word
    return best
