"""Counting helpers."""


def count_words(text):
    """How often each word occurs, case-insensitively."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
