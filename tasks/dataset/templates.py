"""The code the mini benchmark is made of: small stdlib-only functions with bug sites.

A `Template` is one realistic function (3-10 lines) written with `$slot` placeholders
(string.Template): `$fn` is the function name, other slots are argument/local names
drawn from `names` pools, and constants drawn from `consts`. Each `Bug` names a family
and a text edit (`old` -> `new`, applied once to the correct function) that injects it.
`cases` are argument tuples (or a function of the chosen constants returning them):
the generator runs the correct and the buggy function on each to find the inputs that
expose the bug (failing tests, the issue's reproduction) and those that do not (tests
that pass both ways). Nothing here is checked by hand: `mini.py` rejects any
combination whose bug is not exposed, whose lines are not unique, and so on.

Templates are grouped into packages (the `repo_name`) and modules; the other
templates of a task's package are its distractor code. Identifier pools are shared
by both splits (a tiny model fails on names it never saw: docs/architecture.md s8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = (
    "off_by_one",
    "wrong_comparison",
    "inverted_condition",
    "wrong_default",
    "swapped_arguments",
    "missing_edge_case",
    "wrong_exception",
    "wrong_constant",
    "wrong_operator",
    "wrong_accumulator_init",
    "wrong_return_value",
    "wrong_function",
)

# Families whose fix needs more than flipping one token the issue points at
# (an inserted guard, an argument order, a value that is only wrong at the start or
# end). `difficulty` shifts the mix towards them.
HARD_FAMILIES = frozenset({"missing_edge_case", "swapped_arguments", "wrong_accumulator_init",
                           "wrong_return_value", "off_by_one", "wrong_function"})


@dataclass(frozen=True)
class Bug:
    family: str
    old: str
    new: str


@dataclass(frozen=True)
class Template:
    package: str
    module: str
    fn: tuple[str, ...]
    src: str
    bugs: tuple[Bug, ...]
    cases: object  # list[tuple] | Callable[[dict], list[tuple]]
    summary: str  # what the function does, for issue titles: "apply a percentage discount"
    names: dict = field(default_factory=dict)
    consts: dict = field(default_factory=dict)
    imports: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.package}.{self.module}.{self.fn[0]}"

    def case_list(self, consts: dict) -> list[tuple]:
        return list(self.cases(consts) if callable(self.cases) else self.cases)


# Shared vocabulary: argument names reused across packages, like real code bases do.
ITEMS = ("items", "entries", "records")
VALUES = ("values", "data", "numbers")
TEXT = ("text", "line", "source")
TOTAL = ("total", "result", "acc")
COUNT = ("count", "n", "hits")
LIMIT = ("limit", "threshold", "cutoff")


def B(family: str, old: str, new: str) -> Bug:
    assert family in FAMILIES, family
    return Bug(family, old, new)


T = Template
TEMPLATES: list[Template] = [
    # ------------------------------------------------------------------ stockroom (inventory)
    T("stockroom", "stock", ("needs_restock", "below_reorder_point", "should_reorder"),
      '''
def $fn($qty, $limit=$reorder):
    """Return True when $qty has fallen to or below $limit."""
    if $qty < 0:
        raise ValueError("quantity cannot be negative")
    return $qty <= $limit
''',
      (B("wrong_comparison", "$qty <= $limit", "$qty < $limit"),
       B("wrong_default", "$limit=$reorder", "$limit=0"),
       B("wrong_exception", "raise ValueError", "raise KeyError"),
       B("missing_edge_case", '    if $qty < 0:\n        raise ValueError("quantity cannot be negative")\n', "")),
      lambda c: [(c["reorder"],), (c["reorder"] + 3,), (1,), (4, 4), (0, 2), (-1,), (-5, 10)],
      "decide when to restock an item",
      names={"qty": ("qty", "quantity", "on_hand"), "limit": LIMIT}, consts={"reorder": (5, 10, 20)}),

    T("stockroom", "stock", ("stock_value", "inventory_value", "total_stock_value"),
      '''
def $fn($items):
    """Sum quantity * unit price over (name, quantity, unit_price) rows."""
    $total = 0
    for _name, $qty, $unit in $items:
        $total += $qty * $unit
    return round($total, 2)
''',
      (B("wrong_accumulator_init", "$total = 0", "$total = 1"),
       B("wrong_operator", "$qty * $unit", "$qty + $unit"),
       B("off_by_one", "in $items:", "in $items[1:]:"),
       B("wrong_return_value", "return round($total, 2)", "return round($unit, 2)")),
      [([("bolt", 10, 0.25), ("nut", 4, 0.5)],), ([],), ([("gear", 2, 12.5)],),
       ([("pin", 3, 1.0), ("cap", 1, 2.0), ("rod", 2, 4.0)],), ([("washer", 0, 3.0)],)],
      "compute the value of the stock",
      names={"items": ITEMS, "qty": ("qty", "quantity"), "unit": ("price", "unit_price", "cost"), "total": TOTAL}),

    T("stockroom", "stock", ("low_stock", "items_below", "short_items"),
      '''
def $fn($stock, $limit=$lim):
    """Names of items whose count is under $limit, sorted by name."""
    $found = []
    for $name, $count in $stock.items():
        if $count < $limit:
            $found.append($name)
    return sorted($found)
''',
      (B("wrong_comparison", "if $count < $limit:", "if $count <= $limit:"),
       B("inverted_condition", "if $count < $limit:", "if not $count < $limit:"),
       B("wrong_default", "$limit=$lim", "$limit=1"),
       B("wrong_return_value", "return sorted($found)", "return $found")),
      lambda c: [({"tape": 1, "glue": c["lim"], "clip": c["lim"] + 2, "bolt": 0},), ({},),
                 ({"x": 7, "a": 2}, 5), ({"saw": c["lim"] - 1},), ({"zip": 3, "box": 3}, 3)],
      "list items that are low on stock",
      names={"stock": ("stock", "levels", "inventory"), "limit": LIMIT, "found": ("found", "low", "names"),
             "name": ("name", "item"), "count": ("count", "qty")}, consts={"lim": (3, 5, 8)}),

    T("stockroom", "pricing", ("apply_discount", "discounted_price", "price_after_discount"),
      '''
def $fn($price, $pct):
    """Return $price reduced by $pct percent (0-100), rounded to cents."""
    if $pct < 0 or $pct > 100:
        raise ValueError("discount must be between 0 and 100")
    return round($price * (100 - $pct) / 100, 2)
''',
      (B("wrong_comparison", "$pct > 100", "$pct >= 100"),
       B("wrong_exception", "raise ValueError", "raise TypeError"),
       B("wrong_operator", "(100 - $pct)", "(100 + $pct)"),
       B("wrong_constant", "/ 100, 2)", "/ 10, 2)")),
      [(20.0, 100), (80.0, 25), (19.99, 0), (10.0, 101), (50.0, -5), (12.0, 50)],
      "apply a percentage discount",
      names={"price": ("price", "amount", "cost"), "pct": ("percent", "pct", "discount")}),

    T("stockroom", "pricing", ("bulk_price", "order_total", "tiered_price"),
      '''
def $fn($unit_price, $qty):
    """Price of $qty items at $unit_price each; orders of $bulk or more get $off% off."""
    $cost = $unit_price * $qty
    if $qty >= $bulk:
        $cost = $cost * (100 - $off) / 100
    return round($cost, 2)
''',
      (B("wrong_comparison", "$qty >= $bulk", "$qty > $bulk"),
       B("wrong_constant", "(100 - $off) / 100", "(100 - $off) / 10"),
       B("wrong_operator", "$unit_price * $qty", "$unit_price + $qty"),
       B("inverted_condition", "if $qty >= $bulk:", "if not $qty >= $bulk:")),
      lambda c: [(2.0, c["bulk"]), (2.0, 1), (4.0, c["bulk"] + 5), (1.5, 0), (3.0, c["bulk"] - 1)],
      "price an order with a bulk discount",
      names={"unit_price": ("unit_price", "price"), "qty": ("qty", "quantity", "units"), "cost": ("cost", "total")},
      consts={"bulk": (10, 12, 50), "off": (5, 10, 15)}),

    T("stockroom", "pricing", ("add_tax", "price_with_tax", "gross_price"),
      '''
def $fn($net, $rate=$default_rate):
    """Gross price for a net price and a tax rate given as a fraction."""
    if $rate < 0:
        raise ValueError("tax rate must not be negative")
    return round($net * (1 + $rate), 2)
''',
      (B("wrong_default", "$rate=$default_rate", "$rate=0"),
       B("wrong_exception", "raise ValueError", "raise TypeError"),
       B("wrong_operator", "(1 + $rate)", "(1 - $rate)"),
       B("wrong_comparison", "if $rate < 0:", "if $rate <= 0:")),
      [(100.0,), (10.0, 0), (80.0, 0.5), (5.0, -0.1), (19.99, 0.25)],
      "add sales tax to a price",
      names={"net": ("net", "price", "amount"), "rate": ("rate", "tax_rate", "tax")},
      consts={"default_rate": (0.2, 0.07, 0.19)}),

    # ------------------------------------------------------------------ textkit
    T("textkit", "cleanup", ("truncate", "shorten", "ellipsize"),
      '''
def $fn($text, $width=$w, $marker="..."):
    """Cut $text to at most $width characters, ending with $marker when cut."""
    if $width < len($marker):
        raise ValueError("width is smaller than the marker")
    if len($text) <= $width:
        return $text
    return $text[:$width - len($marker)] + $marker
''',
      (B("off_by_one", "[:$width - len($marker)]", "[:$width - len($marker) + 1]"),
       B("wrong_comparison", "if len($text) <= $width:", "if len($text) < $width:"),
       B("wrong_default", '$marker="..."', '$marker=".."'),
       B("wrong_exception", "raise ValueError", "raise IndexError")),
      lambda c: [("hello world, this is long",), ("short",), ("x" * c["w"],), ("abcdefghij", 6),
                 ("abcdefghij", 2), ("abcdef", 5, "~")],
      "shorten long text",
      names={"text": TEXT, "width": ("width", "max_len", "size"), "marker": ("marker", "suffix", "tail")},
      consts={"w": (10, 12, 20)}),

    T("textkit", "cleanup", ("strip_prefix", "remove_prefix", "drop_prefix"),
      '''
def $fn($text, $prefix):
    """Remove $prefix from the start of $text if present (case-sensitive)."""
    if $prefix and $text.startswith($prefix):
        return $text[len($prefix):]
    return $text
''',
      (B("inverted_condition", "and $text.startswith($prefix)", "and not $text.startswith($prefix)"),
       B("off_by_one", "[len($prefix):]", "[len($prefix) + 1:]"),
       B("wrong_function", "$text.startswith($prefix)", "$text.endswith($prefix)")),
      [("v1.2.3", "v"), ("release-notes", "release-"), ("abc", "x"), ("abc", ""), ("data.csv", "csv"),
       ("Version", "v")],
      "strip a prefix from a string",
      names={"text": TEXT, "prefix": ("prefix", "head", "start")}),

    T("textkit", "cleanup", ("title_case", "headline", "to_title"),
      '''
def $fn($text, $small=("a", "an", "of", "the")):
    """Capitalise each word except the small words after the first one."""
    $words = $text.lower().split()
    $out = []
    for $i, $word in enumerate($words):
        if $i > 0 and $word in $small:
            $out.append($word)
        else:
            $out.append($word.capitalize())
    return " ".join($out)
''',
      (B("wrong_comparison", "if $i > 0 and", "if $i >= 0 and"),
       B("inverted_condition", "and $word in $small:", "and $word not in $small:"),
       B("wrong_function", "$out.append($word.capitalize())", "$out.append($word.upper())"),
       B("wrong_constant", 'return " ".join($out)', 'return "-".join($out)'),
       B("wrong_accumulator_init", "$out = []", '$out = [""]')),
      [("the lord of the rings",), ("a tale",), ("HELLO",), ("",), ("war and peace",), ("an idea of march", ())],
      "title-case a heading",
      names={"text": TEXT, "small": ("small", "minor", "skip"), "words": ("words", "parts", "tokens"),
             "out": ("out", "result", "titled"), "i": ("i", "idx", "pos"), "word": ("word", "w")}),

    T("textkit", "words", ("count_words", "word_count", "num_words"),
      '''
def $fn($text, $min_len=1):
    """Count words with at least $min_len letters, ignoring punctuation."""
    $count = 0
    for $word in $text.split():
        $word = $word.strip(".,;:!?")
        if len($word) >= $min_len:
            $count += 1
    return $count
''',
      (B("wrong_accumulator_init", "$count = 0", "$count = 1"),
       B("wrong_comparison", "if len($word) >= $min_len:", "if len($word) > $min_len:"),
       B("wrong_default", "$min_len=1", "$min_len=2"),
       B("missing_edge_case", '        $word = $word.strip(".,;:!?")\n', "")),
      [("the quick brown fox",), ("",), ("a b c",), ("to be, or not to be !",), ("one two three", 4),
       ("hi ! there", 1)],
      "count the words in a text",
      names={"text": TEXT, "min_len": ("min_len", "shortest", "min_length"), "count": COUNT,
             "word": ("word", "w", "token")}),

    T("textkit", "words", ("most_common_word", "top_word", "frequent_word"),
      '''
def $fn($text):
    """The most frequent lower-cased word; ties go to the earliest word."""
    $counts = {}
    for $word in $text.lower().split():
        $counts[$word] = $counts.get($word, 0) + 1
    if not $counts:
        return None
    return max($counts, key=$counts.get)
''',
      (B("missing_edge_case", "    if not $counts:\n        return None\n", ""),
       B("wrong_function", "return max($counts", "return min($counts"),
       B("wrong_return_value", "return None", 'return ""')),
      [("the cat and the hat",), ("",), ("b a b a c",), ("Go go GO stop",), ("one",)],
      "find the most common word",
      names={"text": TEXT, "counts": ("counts", "freq", "tally"), "word": ("word", "w", "token")}),

    T("textkit", "words", ("initials", "acronym", "abbreviate"),
      '''
def $fn($phrase, $sep=""):
    """Upper-case first letters of the words in $phrase, joined by $sep."""
    $letters = [$w[0].upper() for $w in $phrase.split()]
    return $sep.join($letters)
''',
      (B("off_by_one", "$w[0].upper()", "$w[1].upper()"),
       B("wrong_default", '$sep=""', '$sep="."'),
       B("wrong_function", "$w[0].upper()", "$w[0].lower()")),
      [("portable network graphics",), ("ada lovelace", "."), ("",), ("as soon as possible",), ("x", "-")],
      "build initials from a phrase",
      names={"phrase": ("phrase", "name", "text"), "sep": ("sep", "joiner", "delimiter"),
             "letters": ("letters", "firsts", "chars"), "w": ("w", "word", "part")}),

    # ------------------------------------------------------------------ timespan (dates)
    T("timespan", "ranges", ("days_between", "day_span", "count_days"),
      '''
def $fn($start, $end, $inclusive=False):
    """Number of days from $start to $end (ISO dates); one more when inclusive."""
    $first = date.fromisoformat($start)
    $last = date.fromisoformat($end)
    $days = ($last - $first).days
    if $inclusive:
        $days += 1
    return $days
''',
      (B("swapped_arguments", "($last - $first)", "($first - $last)"),
       B("inverted_condition", "if $inclusive:", "if not $inclusive:"),
       B("wrong_default", "$inclusive=False", "$inclusive=True"),
       B("wrong_constant", "$days += 1", "$days += 2")),
      [("2024-01-01", "2024-01-31"), ("2024-02-27", "2024-03-01", True), ("2023-05-05", "2023-05-05"),
       ("2024-12-30", "2025-01-02", False)],
      "count the days between two dates",
      names={"start": ("start", "begin", "since"), "end": ("end", "until", "stop"),
             "first": ("first", "d0", "start_day"), "last": ("last", "d1", "end_day"), "days": ("days", "span")},
      imports=("from datetime import date",)),

    T("timespan", "ranges", ("overlaps", "ranges_overlap", "intersects"),
      '''
def $fn($a_start, $a_end, $b_start, $b_end):
    """True when the half-open ranges [a_start, a_end) and [b_start, b_end) share a day."""
    if $a_end < $a_start or $b_end < $b_start:
        raise ValueError("range ends before it starts")
    return $a_start < $b_end and $b_start < $a_end
''',
      (B("wrong_comparison", "return $a_start < $b_end", "return $a_start <= $b_end"),
       B("inverted_condition", "$b_end and $b_start < $a_end", "$b_end or $b_start < $a_end"),
       B("wrong_exception", "raise ValueError", "raise AssertionError")),
      [("2024-01-01", "2024-01-10", "2024-01-05", "2024-01-20"), ("2024-01-01", "2024-01-05", "2024-01-05", "2024-01-09"),
       ("2024-03-01", "2024-03-02", "2024-04-01", "2024-04-02"), ("2024-02-10", "2024-02-01", "2024-01-01", "2024-01-02"),
       ("2024-06-01", "2024-06-30", "2024-06-10", "2024-06-11"), ("2024-01-05", "2024-01-09", "2024-01-01", "2024-01-05")],
      "check whether two date ranges overlap",
      names={"a_start": ("a_start", "start1"), "a_end": ("a_end", "end1"), "b_start": ("b_start", "start2"),
             "b_end": ("b_end", "end2")}),

    T("timespan", "ranges", ("month_end", "last_day_of_month", "end_of_month"),
      '''
def $fn($year, $month):
    """ISO date of the last day of the given month."""
    if not 1 <= $month <= 12:
        raise ValueError("month must be in 1..12")
    if $month == 12:
        return date($year, 12, 31).isoformat()
    return (date($year, $month + 1, 1) - timedelta(days=1)).isoformat()
''',
      (B("wrong_constant", "date($year, 12, 31)", "date($year, 12, 30)"),
       B("off_by_one", "timedelta(days=1)", "timedelta(days=2)"),
       B("inverted_condition", "if not 1 <= $month <= 12:", "if 1 <= $month <= 12:"),
       B("wrong_exception", "raise ValueError", "raise IndexError")),
      [(2024, 2), (2023, 12), (2023, 2), (2024, 13), (2024, 4), (2024, 0)],
      "find the last day of a month",
      names={"year": ("year", "yr", "y"), "month": ("month", "mon", "m")},
      imports=("from datetime import date, timedelta",)),

    T("timespan", "workdays", ("add_business_days", "add_workdays", "shift_workdays"),
      '''
def $fn($start, $days):
    """ISO date $days working days after $start, skipping weekends."""
    $current = date.fromisoformat($start)
    $left = $days
    while $left > 0:
        $current += timedelta(days=1)
        if $current.weekday() < 5:
            $left -= 1
    return $current.isoformat()
''',
      (B("wrong_comparison", "while $left > 0:", "while $left >= 0:"),
       B("wrong_constant", "if $current.weekday() < 5:", "if $current.weekday() < 6:"),
       B("wrong_accumulator_init", "$left = $days", "$left = $days - 1")),
      [("2024-01-05", 1), ("2024-01-01", 0), ("2024-01-01", 5), ("2024-01-03", 1), ("2024-01-06", 2)],
      "add business days to a date",
      names={"start": ("start", "day", "since"), "days": ("days", "n", "count"), "current": ("current", "cur", "d"),
             "left": ("left", "remaining", "todo")},
      imports=("from datetime import date, timedelta",)),

    T("timespan", "workdays", ("fiscal_quarter", "quarter_of", "quarter"),
      '''
def $fn($iso_date, $first_month=1):
    """Quarter (1-4) of a date, for a year that starts in $first_month."""
    $month = date.fromisoformat($iso_date).month
    $shifted = ($month - $first_month) % 12
    return $shifted // 3 + 1
''',
      (B("off_by_one", "return $shifted // 3 + 1", "return $shifted // 3"),
       B("swapped_arguments", "($month - $first_month)", "($first_month - $month)"),
       B("wrong_default", "$first_month=1", "$first_month=0"),
       B("wrong_operator", "$shifted // 3", "$shifted % 3")),
      [("2024-05-10",), ("2024-01-01",), ("2024-12-31",), ("2024-03-15", 4), ("2024-10-01", 10), ("2024-02-29", 2)],
      "compute the fiscal quarter of a date",
      names={"iso_date": ("iso_date", "day", "when"), "first_month": ("first_month", "start_month"),
             "month": ("month", "m"), "shifted": ("shifted", "offset", "k")},
      imports=("from datetime import date",)),

    T("timespan", "workdays", ("format_duration", "hms", "clock_time"),
      '''
def $fn($seconds):
    """Format a duration in whole seconds as H:MM:SS."""
    if $seconds < 0:
        raise ValueError("duration cannot be negative")
    $hours, $rest = divmod($seconds, 3600)
    $minutes, $secs = divmod($rest, 60)
    return f"{$hours}:{$minutes:02d}:{$secs:02d}"
''',
      (B("swapped_arguments", "divmod($rest, 60)", "divmod(60, $rest)"),
       B("wrong_constant", "divmod($seconds, 3600)", "divmod($seconds, 360)"),
       B("wrong_comparison", "if $seconds < 0:", "if $seconds <= 0:"),
       B("wrong_exception", "raise ValueError", "raise OverflowError")),
      [(3725,), (0,), (59,), (86399,), (-1,), (3600,)],
      "format a duration",
      names={"seconds": ("seconds", "secs_total", "elapsed"), "hours": ("hours", "h"), "rest": ("rest", "rem"),
             "minutes": ("minutes", "mins"), "secs": ("secs", "s")}),

    # ------------------------------------------------------------------ confparse
    T("confparse", "parser", ("parse_line", "split_setting", "parse_assignment"),
      '''
def $fn($line, $sep="="):
    """Split 'key = value' into a (key, value) pair; comments and blanks give None."""
    $line = $line.strip()
    if not $line or $line.startswith("#"):
        return None
    $key, _, $value = $line.partition($sep)
    return $key.strip(), $value.strip()
''',
      (B("inverted_condition", "if not $line or", "if $line or"),
       B("wrong_default", '$sep="="', '$sep=":"'),
       B("wrong_function", "$line.partition($sep)", "$line.rpartition($sep)"),
       B("wrong_return_value", "return $key.strip(), $value.strip()", "return $value.strip(), $key.strip()")),
      [("name = demo",), ("# comment",), ("",), ("url = a=b",), ("port: 80", ":"), ("  debug=true  ",)],
      "parse a config line",
      names={"line": ("line", "raw", "entry"), "sep": ("sep", "delimiter"), "key": ("key", "name"),
             "value": ("value", "val")}),

    T("confparse", "parser", ("parse_bool", "to_bool", "as_bool"),
      '''
def $fn($value, $default=None):
    """Interpret common spellings of booleans; unknown text gives $default."""
    $word = $value.strip().lower()
    if $word in ("1", "true", "yes", "on"):
        return True
    if $word in ("0", "false", "no", "off"):
        return False
    return $default
''',
      (B("wrong_constant", '"yes", "on")', '"yes", "no")'),
       B("wrong_function", "$value.strip().lower()", "$value.strip().upper()"),
       B("wrong_default", "$default=None", "$default=False"),
       B("wrong_return_value", "return $default", "return None")),
      [("yes",), ("Off",), ("maybe",), (" TRUE ",), ("no",), ("?", True), ("on",)],
      "parse a boolean setting",
      names={"value": ("value", "text", "raw"), "default": ("default", "fallback"), "word": ("word", "norm", "v")}),

    T("confparse", "parser", ("parse_list", "split_list", "csv_values"),
      '''
def $fn($value, $sep=","):
    """Split a separated setting into items, dropping blanks and surrounding spaces."""
    $items = []
    for $part in $value.split($sep):
        $part = $part.strip()
        if $part:
            $items.append($part)
    return $items
''',
      (B("inverted_condition", "if $part:", "if not $part:"),
       B("missing_edge_case", "        $part = $part.strip()\n", ""),
       B("wrong_default", '$sep=","', '$sep=";"'),
       B("wrong_accumulator_init", "$items = []", '$items = [""]')),
      [("a, b, c",), ("",), ("x,,y",), ("one;two", ";"), ("solo",), (" p ,q",)],
      "split a list setting",
      names={"value": ("value", "text", "raw"), "sep": ("sep", "delimiter"), "items": ITEMS,
             "part": ("part", "piece", "chunk")}),

    T("confparse", "values", ("parse_size", "size_to_bytes", "to_bytes"),
      '''
def $fn($text):
    """Convert '10KB', '3MB', '1GB' or '512' into a byte count (1KB = 1024 bytes)."""
    $text = $text.strip().upper()
    for $suffix, $factor in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("KB", 1024)):
        if $text.endswith($suffix):
            return int($text[:-len($suffix)]) * $factor
    return int($text)
''',
      (B("wrong_constant", '("KB", 1024)', '("KB", 1000)'),
       B("off_by_one", "$text[:-len($suffix)]", "$text[:-len($suffix) - 1]"),
       B("wrong_function", "$text.strip().upper()", "$text.strip().lower()"),
       B("wrong_operator", '("MB", 1024 ** 2)', '("MB", 1024 * 2)')),
      [("10KB",), ("512",), ("3mb",), ("1GB",), ("20MB",), (" 7 ",)],
      "parse a size setting",
      names={"text": ("text", "value", "size"), "suffix": ("suffix", "unit"), "factor": ("factor", "scale")}),

    T("confparse", "values", ("clamp", "clamp_value", "bounded"),
      '''
def $fn($value, $low, $high):
    """Clamp $value into [$low, $high]; raise if the bounds are reversed."""
    if $low > $high:
        raise ValueError("low bound above high bound")
    return max($low, min($high, $value))
''',
      (B("swapped_arguments", "max($low, min($high, $value))", "max($high, min($low, $value))"),
       B("wrong_function", "max($low, min($high, $value))", "min($low, max($high, $value))"),
       B("wrong_exception", "raise ValueError", "raise ArithmeticError"),
       B("wrong_comparison", "if $low > $high:", "if $low >= $high:")),
      [(5, 0, 10), (-3, 0, 10), (42, 0, 10), (1, 5, 2), (7, 7, 7), (0.5, 0.0, 1.0)],
      "clamp a numeric setting",
      names={"value": ("value", "x", "setting"), "low": ("low", "lo", "minimum"), "high": ("high", "hi", "maximum")}),

    T("confparse", "values", ("get_int", "int_setting", "read_int"),
      '''
def $fn($settings, $key, $default=0):
    """Integer value of $key in a settings dict, or $default when absent."""
    if $key not in $settings:
        return $default
    try:
        return int($settings[$key])
    except ValueError:
        raise ValueError(f"setting {$key!r} is not an integer") from None
''',
      (B("inverted_condition", "if $key not in $settings:", "if $key in $settings:"),
       B("wrong_default", "$default=0", "$default=None"),
       B("wrong_exception", "raise ValueError(f", "raise KeyError(f"),
       B("wrong_return_value", "return $default", "return 0")),
      [({"port": "8080"}, "port"), ({}, "port"), ({"workers": "x"}, "workers"), ({}, "retries", 3),
       ({"n": "-2"}, "n", 5)],
      "read an integer setting",
      names={"settings": ("settings", "config", "options"), "key": ("key", "name", "option"),
             "default": ("default", "fallback")}),

    # ------------------------------------------------------------------ gridmath
    T("gridmath", "matrix", ("transpose", "transposed", "flip_axes"),
      '''
def $fn($rows):
    """Transpose a matrix given as a list of equal-length rows."""
    if not $rows:
        return []
    $width = len($rows[0])
    return [[$row[$j] for $row in $rows] for $j in range($width)]
''',
      (B("missing_edge_case", "    if not $rows:\n        return []\n", ""),
       B("off_by_one", "for $j in range($width)]", "for $j in range($width - 1)]"),
       B("wrong_return_value", "return []", "return [[]]")),
      [([[1, 2, 3], [4, 5, 6]],), ([],), ([[7]],), ([[1, 2], [3, 4], [5, 6]],)],
      "transpose a matrix",
      names={"rows": ("rows", "matrix", "grid"), "row": ("row", "r"), "j": ("j", "col", "k"),
             "width": ("width", "ncols", "cols")}),

    T("gridmath", "matrix", ("matmul", "mat_mul", "multiply"),
      '''
def $fn($a, $b):
    """Product of matrices $a (n x m) and $b (m x p) as nested lists."""
    if len($a[0]) != len($b):
        raise ValueError("inner dimensions differ")
    $cols = list(zip(*$b))
    return [[sum($x * $y for $x, $y in zip($row, $col)) for $col in $cols] for $row in $a]
''',
      (B("inverted_condition", "if len($a[0]) != len($b):", "if len($a[0]) == len($b):"),
       B("wrong_operator", "sum($x * $y", "sum($x + $y"),
       B("wrong_exception", "raise ValueError", "raise IndexError"),
       B("swapped_arguments", "list(zip(*$b))", "list(zip(*$a))")),
      [([[1, 2], [3, 4]], [[5, 6], [7, 8]]), ([[1, 0], [0, 1]], [[2, 3], [4, 5]]), ([[1, 2, 3]], [[1], [2], [3]]),
       ([[1, 2]], [[1, 2]]), ([[2]], [[3]])],
      "multiply two matrices",
      names={"a": ("a", "left", "m1"), "b": ("b", "right", "m2"), "cols": ("cols", "columns"), "x": ("x", "p"),
             "y": ("y", "q"), "row": ("row", "r"), "col": ("col", "c")}),

    T("gridmath", "matrix", ("identity", "eye", "unit_matrix"),
      '''
def $fn($n, $scale=1):
    """An $n x $n identity matrix with $scale on the diagonal."""
    if $n < 0:
        raise ValueError("size cannot be negative")
    return [[$scale if $i == $j else 0 for $j in range($n)] for $i in range($n)]
''',
      (B("inverted_condition", "if $i == $j else", "if $i != $j else"),
       B("wrong_default", "$scale=1", "$scale=0"),
       B("off_by_one", "for $j in range($n)]", "for $j in range($n + 1)]"),
       B("wrong_exception", "raise ValueError", "raise TypeError")),
      [(2,), (0,), (3, 5), (1,), (-1,)],
      "build an identity matrix",
      names={"n": ("n", "size", "dim"), "scale": ("scale", "value", "diag"), "i": ("i", "r"), "j": ("j", "c")}),

    T("gridmath", "matrix", ("trace", "diagonal_sum", "diag_total"),
      '''
def $fn($m):
    """Sum of the main diagonal of a square matrix."""
    $total = 0
    for $i in range(len($m)):
        $total += $m[$i][$i]
    return $total
''',
      (B("wrong_accumulator_init", "$total = 0", "$total = 1"),
       B("off_by_one", "range(len($m))", "range(1, len($m))"),
       B("wrong_operator", "$total += $m", "$total -= $m")),
      [([[1, 2], [3, 4]],), ([],), ([[5]],), ([[0, 1], [1, 0]],), ([[2, 0, 0], [0, 3, 0], [0, 0, 4]],)],
      "sum the diagonal of a matrix",
      names={"m": ("m", "matrix", "grid"), "total": TOTAL, "i": ("i", "k", "idx")}),

    T("gridmath", "vectors", ("dot", "dot_product", "inner"),
      '''
def $fn($u, $v):
    """Dot product of two vectors of the same length."""
    if len($u) != len($v):
        raise ValueError("vectors differ in length")
    return sum($a * $b for $a, $b in zip($u, $v))
''',
      (B("wrong_exception", "raise ValueError", "raise IndexError"),
       B("wrong_operator", "sum($a * $b", "sum($a + $b"),
       B("inverted_condition", "if len($u) != len($v):", "if len($u) == len($v):")),
      [([1, 2, 3], [4, 5, 6]), ([], []), ([2], [3]), ([1, 2], [1]), ([0, 0], [5, 5])],
      "compute a dot product",
      names={"u": ("u", "left", "xs"), "v": ("v", "right", "ys"), "a": ("a", "p"), "b": ("b", "q")}),

    T("gridmath", "vectors", ("norm", "p_norm", "magnitude"),
      '''
def $fn($vec, $p=2):
    """The p-norm of a vector, rounded to 4 places."""
    if $p <= 0:
        raise ValueError("p must be positive")
    return round(sum(abs($x) ** $p for $x in $vec) ** (1 / $p), 4)
''',
      (B("wrong_default", "$p=2", "$p=1"),
       B("wrong_operator", "** (1 / $p)", "** (1 * $p)"),
       B("wrong_constant", ", 4)", ", 1)"),
       B("wrong_comparison", "if $p <= 0:", "if $p < 0:")),
      [([3, 4],), ([1, -1], 1), ([],), ([2.5],), ([1, 2, 2], 0), ([1.23456, 0],)],
      "compute the length of a vector",
      names={"vec": ("vec", "v", "coords"), "p": ("p", "order"), "x": ("x", "c", "comp")}),

    T("gridmath", "vectors", ("normalize", "unit_scale", "rescale"),
      '''
def $fn($vec):
    """Scale $vec so that its largest absolute component is 1."""
    $peak = max((abs($x) for $x in $vec), default=0)
    if $peak == 0:
        return list($vec)
    return [$x / $peak for $x in $vec]
''',
      (B("missing_edge_case", "    if $peak == 0:\n        return list($vec)\n", ""),
       B("wrong_function", "$peak = max(", "$peak = min("),
       B("wrong_operator", "[$x / $peak", "[$x * $peak")),
      [([2, -4, 1],), ([],), ([0, 0],), ([5],), ([1, 1, 1],)],
      "normalise a vector",
      names={"vec": ("vec", "v", "coords"), "peak": ("peak", "biggest", "scale"), "x": ("x", "c", "comp")}),

    # ------------------------------------------------------------------ taskqueue
    T("taskqueue", "jobs", ("pop_highest", "next_job", "take_urgent"),
      '''
def $fn($jobs):
    """Remove and return the (priority, name) job with the highest priority; None if empty."""
    if not $jobs:
        return None
    $best = 0
    for $i in range(1, len($jobs)):
        if $jobs[$i][0] > $jobs[$best][0]:
            $best = $i
    return $jobs.pop($best)
''',
      (B("off_by_one", "range(1, len($jobs))", "range(1, len($jobs) - 1)"),
       B("wrong_comparison", "if $jobs[$i][0] > $jobs[$best][0]:", "if $jobs[$i][0] >= $jobs[$best][0]:"),
       B("missing_edge_case", "    if not $jobs:\n        return None\n", ""),
       B("wrong_accumulator_init", "$best = 0", "$best = 1")),
      [([(1, "mail"), (5, "build"), (3, "lint")],), ([],), ([(2, "a"), (2, "b")],), ([(1, "x"), (9, "y")],),
       ([(4, "solo")],)],
      "take the most urgent job",
      names={"jobs": ("jobs", "queue", "pending"), "best": ("best", "top", "pick"), "i": ("i", "k", "idx")}),

    T("taskqueue", "jobs", ("backoff_delays", "retry_delays", "backoff"),
      '''
def $fn($attempts, $base=$b, $cap=$c):
    """Delays before each retry: $base, 2*$base, 4*$base, ... each at most $cap seconds."""
    $delays = []
    for $n in range($attempts):
        $delays.append(min($cap, $base * 2 ** $n))
    return $delays
''',
      (B("wrong_function", "append(min($cap", "append(max($cap"),
       B("off_by_one", "range($attempts)", "range($attempts - 1)"),
       B("wrong_default", "$cap=$c", "$cap=1000"),
       B("wrong_constant", "$base * 2 ** $n", "$base * 3 ** $n"),
       B("wrong_accumulator_init", "$delays = []", "$delays = [0]")),
      [(3,), (0,), (8,), (4, 1, 5), (1,)],
      "compute retry back-off delays",
      names={"attempts": ("attempts", "retries", "tries"), "base": ("base", "initial", "first"),
             "cap": ("cap", "ceiling", "max_delay"), "delays": ("delays", "waits", "out"), "n": ("n", "i", "k")},
      consts={"b": (1, 2), "c": (30, 60, 10)}),

    T("taskqueue", "jobs", ("chunked", "batches", "split_batches"),
      '''
def $fn($items, $size):
    """Split $items into consecutive lists of at most $size elements."""
    if $size <= 0:
        raise ValueError("batch size must be positive")
    return [$items[$i:$i + $size] for $i in range(0, len($items), $size)]
''',
      (B("wrong_exception", "raise ValueError", "raise TypeError"),
       B("off_by_one", "[$i:$i + $size]", "[$i:$i + $size - 1]"),
       B("wrong_constant", "range(0, len($items), $size)", "range(1, len($items), $size)")),
      [([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2, 3], 3), (["a", "b"], 0), ([9], 1)],
      "split work into batches",
      names={"items": ITEMS, "size": ("size", "batch_size", "n"), "i": ("i", "start", "k")}),

    T("taskqueue", "scheduler", ("due_tasks", "tasks_due", "ready_tasks"),
      '''
def $fn($tasks, $now):
    """Names of (name, due_time) tasks due at or before $now, earliest first."""
    $due = [($when, $name) for $name, $when in $tasks if $when <= $now]
    $due.sort()
    return [$name for $when, $name in $due]
''',
      (B("wrong_comparison", "if $when <= $now]", "if $when < $now]"),
       B("missing_edge_case", "    $due.sort()\n", ""),
       B("inverted_condition", "if $when <= $now]", "if not $when <= $now]")),
      [([("backup", 30), ("email", 10), ("report", 50)], 30), ([], 5), ([("a", 1)], 0), ([("x", 9), ("y", 2)], 10)],
      "list the tasks that are due",
      names={"tasks": ("tasks", "jobs", "schedule"), "now": ("now", "current", "at"), "due": ("due", "ready"),
             "when": ("when", "at_time", "t"), "name": ("name", "task")}),

    T("taskqueue", "scheduler", ("round_robin", "interleave", "fair_order"),
      '''
def $fn($queues):
    """Take one item from each queue in turn until all queues are empty."""
    $order = []
    $longest = max((len($q) for $q in $queues), default=0)
    for $i in range($longest):
        for $q in $queues:
            if $i < len($q):
                $order.append($q[$i])
    return $order
''',
      (B("wrong_comparison", "if $i < len($q):", "if $i <= len($q):"),
       B("wrong_accumulator_init", "$order = []", "$order = [None]"),
       B("wrong_function", "$longest = max(", "$longest = min("),
       B("off_by_one", "range($longest)", "range($longest - 1)")),
      [([[1, 2, 3], ["a"]],), ([],), ([[1], [2], [3]],), ([["x", "y"], []],)],
      "interleave several queues",
      names={"queues": ("queues", "lanes", "lists"), "order": ("order", "out", "merged"),
             "longest": ("longest", "depth", "rounds"), "i": ("i", "k", "step"), "q": ("q", "lane")}),

    T("taskqueue", "scheduler", ("utilisation", "busy_percent", "load_factor"),
      '''
def $fn($busy, $total):
    """Percentage of $total time spent busy, rounded to one decimal."""
    if $total == 0:
        return 0.0
    return round(100 * $busy / $total, 1)
''',
      (B("missing_edge_case", "    if $total == 0:\n        return 0.0\n", ""),
       B("swapped_arguments", "100 * $busy / $total", "100 * $total / $busy"),
       B("wrong_constant", "round(100 * ", "round(10 * "),
       B("wrong_return_value", "return 0.0", "return 100.0")),
      [(30, 120), (0, 0), (60, 60), (1, 3), (0, 10)],
      "compute a worker's utilisation",
      names={"busy": ("busy", "used", "active"), "total": ("total", "window", "span")}),

    # ------------------------------------------------------------------ unitconv
    T("unitconv", "length", ("to_meters", "length_in_meters", "as_meters"),
      '''
def $fn($value, $unit):
    """Convert a length in cm, m, km, in or ft to meters."""
    $factors = {"cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048}
    if $unit not in $factors:
        raise KeyError(f"unknown unit {$unit!r}")
    return round($value * $factors[$unit], 4)
''',
      (B("wrong_constant", '"km": 1000.0', '"km": 100.0'),
       B("wrong_constant", '"ft": 0.3048', '"ft": 0.348'),
       B("wrong_exception", "raise KeyError", "raise ValueError"),
       B("wrong_operator", "round($value * $factors", "round($value / $factors")),
      [(2.5, "km"), (10, "ft"), (100, "cm"), (3, "yd"), (1, "m"), (12, "in")],
      "convert lengths to meters",
      names={"value": ("value", "amount", "length"), "unit": ("unit", "units", "from_unit"),
             "factors": ("factors", "scale", "per_meter")}),

    T("unitconv", "length", ("feet_and_inches", "split_inches", "to_feet_inches"),
      '''
def $fn($inches):
    """Split a length in whole inches into (feet, inches)."""
    if $inches < 0:
        raise ValueError("length cannot be negative")
    return divmod($inches, 12)
''',
      (B("swapped_arguments", "divmod($inches, 12)", "divmod(12, $inches)"),
       B("wrong_constant", "divmod($inches, 12)", "divmod($inches, 10)"),
       B("wrong_comparison", "if $inches < 0:", "if $inches <= 0:")),
      [(75,), (0,), (11,), (-3,), (12,)],
      "split inches into feet and inches",
      names={"inches": ("inches", "length", "total")}),

    T("unitconv", "length", ("route_length", "total_distance", "path_length"),
      '''
def $fn($segments):
    """Total length in meters of (value, unit) segments; unit is 'm' or 'km'."""
    $total = 0
    for $value, $unit in $segments:
        if $unit == "km":
            $total += $value * 1000
        else:
            $total += $value
    return $total
''',
      (B("wrong_accumulator_init", "$total = 0", "$total = 1"),
       B("wrong_constant", "$value * 1000", "$value * 100"),
       B("inverted_condition", 'if $unit == "km":', 'if $unit != "km":')),
      [([(2, "km"), (300, "m")],), ([],), ([(5, "m")],), ([(1.5, "km")],), ([(0, "km"), (0, "m")],)],
      "add up the length of a route",
      names={"segments": ("segments", "legs", "parts"), "total": TOTAL, "value": ("value", "amount", "length"),
             "unit": ("unit", "units")}),

    T("unitconv", "temperature", ("c_to_f", "celsius_to_fahrenheit", "to_fahrenheit"),
      '''
def $fn($celsius):
    """Celsius to Fahrenheit, rounded to one decimal."""
    if $celsius < -273.15:
        raise ValueError("below absolute zero")
    return round($celsius * 9 / 5 + 32, 1)
''',
      (B("wrong_constant", "+ 32, 1)", "+ 30, 1)"),
       B("swapped_arguments", "$celsius * 9 / 5", "$celsius * 5 / 9"),
       B("wrong_comparison", "if $celsius < -273.15:", "if $celsius <= -273.15:"),
       B("wrong_exception", "raise ValueError", "raise ArithmeticError")),
      [(100,), (0,), (-40,), (-273.15,), (-300,), (37,)],
      "convert Celsius to Fahrenheit",
      names={"celsius": ("celsius", "deg_c", "temp")}),

    T("unitconv", "temperature", ("classify_temperature", "temperature_label", "describe_temp"),
      '''
def $fn($celsius, $hot=$h):
    """Label a temperature: 'freezing' at or below 0, 'hot' from $hot up, else 'mild'."""
    if $celsius <= 0:
        return "freezing"
    if $celsius >= $hot:
        return "hot"
    return "mild"
''',
      (B("wrong_comparison", "if $celsius <= 0:", "if $celsius < 0:"),
       B("wrong_comparison", "if $celsius >= $hot:", "if $celsius > $hot:"),
       B("wrong_default", "$hot=$h", "$hot=40"),
       B("wrong_return_value", 'return "mild"', 'return "cold"')),
      lambda c: [(0,), (c["h"],), (15,), (-5,), (c["h"] + 10,), (33, 35)],
      "label a temperature",
      names={"celsius": ("celsius", "deg_c", "temp"), "hot": ("hot", "hot_from", "warm_limit")},
      consts={"h": (25, 28, 30)}),

    T("unitconv", "temperature", ("mean_reading", "average_temperature", "avg_reading"),
      '''
def $fn($readings):
    """Mean of the readings, skipping None; None when nothing is left."""
    $valid = [$r for $r in $readings if $r is not None]
    if not $valid:
        return None
    return round(sum($valid) / len($valid), 2)
''',
      (B("inverted_condition", "if $r is not None]", "if $r is None]"),
       B("missing_edge_case", "    if not $valid:\n        return None\n", ""),
       B("wrong_constant", "/ len($valid), 2)", "/ len($valid), 0)")),
      [([20.5, None, 21.5],), ([],), ([None, None],), ([18.25, 19.5, 20.0],), ([3],)],
      "average sensor readings",
      names={"readings": ("readings", "samples", VALUES[0]), "valid": ("valid", "kept", "present"),
             "r": ("r", "x", "s")}),

    T("unitconv", "storage", ("human_size", "format_bytes", "pretty_size"),
      '''
def $fn($num_bytes, $precision=1):
    """Format a byte count with B, KB, MB, GB or TB (powers of 1024)."""
    $size = float($num_bytes)
    for $unit in ("B", "KB", "MB", "GB"):
        if $size < 1024:
            return f"{$size:.{$precision}f} {$unit}"
        $size /= 1024
    return f"{$size:.{$precision}f} TB"
''',
      (B("wrong_comparison", "if $size < 1024:", "if $size <= 1024:"),
       B("wrong_constant", "$size /= 1024", "$size /= 1000"),
       B("wrong_default", "$precision=1", "$precision=2"),
       B("wrong_return_value", 'f"{$size:.{$precision}f} TB"', 'f"{$size:.{$precision}f} GB"')),
      [(512,), (2048,), (1024,), (5 * 1024 ** 4,), (1536, 0), (3 * 1024 ** 2,)],
      "format a byte count",
      names={"num_bytes": ("num_bytes", "nbytes", "size_bytes"), "precision": ("precision", "digits"),
             "size": ("size", "amount", "value"), "unit": ("unit", "suffix")}),

    T("unitconv", "storage", ("bytes_needed", "bits_to_bytes", "byte_count"),
      '''
def $fn($bits):
    """Whole bytes needed to store $bits bits."""
    if $bits < 0:
        raise ValueError("bit count cannot be negative")
    return ($bits + 7) // 8
''',
      (B("off_by_one", "($bits + 7)", "($bits + 8)"),
       B("wrong_operator", "($bits + 7) // 8", "($bits + 7) / 8"),
       B("wrong_exception", "raise ValueError", "raise TypeError"),
       B("inverted_condition", "if $bits < 0:", "if not $bits < 0:")),
      [(9,), (0,), (8,), (1,), (-1,), (64,)],
      "count the bytes needed for some bits",
      names={"bits": ("bits", "nbits", "width")}),

    # ------------------------------------------------------------------ ledger
    T("ledger", "accounts", ("balance", "closing_balance", "running_total"),
      '''
def $fn($entries, $opening=0):
    """Closing balance from (kind, amount) entries; kind is 'credit' or 'debit'."""
    $total = $opening
    for $kind, $amount in $entries:
        if $kind == "credit":
            $total += $amount
        elif $kind == "debit":
            $total -= $amount
        else:
            raise ValueError(f"unknown entry kind {$kind!r}")
    return $total
''',
      (B("wrong_accumulator_init", "$total = $opening", "$total = 0"),
       B("wrong_constant", 'if $kind == "credit":', 'if $kind == "credits":'),
       B("wrong_exception", "raise ValueError", "raise KeyError"),
       B("wrong_default", "$opening=0", "$opening=100")),
      [([("credit", 50), ("debit", 20)],), ([], 10), ([("debit", 5)], 100), ([("refund", 3)],), ([],),
       ([("credit", 7)], 3)],
      "compute an account balance",
      names={"entries": ("entries", "ledger", "records"), "opening": ("opening", "start", "initial"),
             "total": ("total", "balance_now", "acc"), "kind": ("kind", "typ"), "amount": ("amount", "value")}),

    T("ledger", "accounts", ("largest_expense", "biggest_debit", "max_debit"),
      '''
def $fn($entries):
    """The biggest debit amount among (kind, amount) entries, or 0 when there is none."""
    $largest = 0
    for $kind, $amount in $entries:
        if $kind == "debit" and $amount > $largest:
            $largest = $amount
    return $largest
''',
      (B("inverted_condition", 'if $kind == "debit" and', 'if $kind != "debit" and'),
       B("wrong_comparison", "and $amount > $largest:", "and $amount < $largest:"),
       B("wrong_accumulator_init", "$largest = 0", "$largest = 1")),
      [([("debit", 40), ("credit", 500), ("debit", 70)],), ([],), ([("credit", 9)],), ([("debit", 0.5)],)],
      "find the largest expense",
      names={"entries": ("entries", "ledger", "records"), "largest": ("largest", "biggest", "top"),
             "kind": ("kind", "typ"), "amount": ("amount", "value")}),

    T("ledger", "accounts", ("split_bill", "share_cost", "divide_evenly"),
      '''
def $fn($cents, $people):
    """Split $cents among $people; the first shares absorb the remainder."""
    if $people <= 0:
        raise ValueError("need at least one person")
    $share, $extra = divmod($cents, $people)
    return [$share + 1 if $i < $extra else $share for $i in range($people)]
''',
      (B("swapped_arguments", "divmod($cents, $people)", "divmod($people, $cents)"),
       B("wrong_comparison", "if $i < $extra else", "if $i <= $extra else"),
       B("wrong_exception", "raise ValueError", "raise ZeroDivisionError")),
      [(1000, 3), (10, 1), (0, 2), (7, 0), (9, 4)],
      "split a bill between people",
      names={"cents": ("cents", "amount", "total"), "people": ("people", "parts", "n"), "share": ("share", "base"),
             "extra": ("extra", "rest"), "i": ("i", "k")}),

    T("ledger", "interest", ("compound", "compound_value", "future_value"),
      '''
def $fn($principal, $rate, $years, $per_year=$n):
    """Value after compounding $rate (a fraction) $per_year times a year."""
    $periods = $years * $per_year
    $value = $principal * (1 + $rate / $per_year) ** $periods
    return round($value, 2)
''',
      (B("wrong_default", "$per_year=$n", "$per_year=365"),
       B("wrong_operator", "(1 + $rate / $per_year)", "(1 + $rate * $per_year)"),
       B("wrong_return_value", "return round($value, 2)", "return round($principal, 2)")),
      [(1000, 0.05, 2), (500, 0.0, 3), (100, 0.1, 1, 1), (1000, 0.12, 0)],
      "compute compound interest",
      names={"principal": ("principal", "amount", "deposit"), "rate": ("rate", "annual_rate"),
             "years": ("years", "term"), "per_year": ("per_year", "periods_per_year"),
             "periods": ("periods", "steps"), "value": ("value", "grown")},
      consts={"n": (12, 4, 1)}),

    T("ledger", "interest", ("monthly_payment", "loan_payment", "installment"),
      '''
def $fn($principal, $annual_rate, $months):
    """Fixed monthly payment of an amortised loan."""
    if $months <= 0:
        raise ValueError("months must be positive")
    if $annual_rate == 0:
        return round($principal / $months, 2)
    $r = $annual_rate / 12
    return round($principal * $r / (1 - (1 + $r) ** -$months), 2)
''',
      (B("missing_edge_case", "    if $annual_rate == 0:\n        return round($principal / $months, 2)\n", ""),
       B("wrong_constant", "$annual_rate / 12", "$annual_rate / 100"),
       B("wrong_comparison", "if $months <= 0:", "if $months < 0:")),
      [(1200, 0.0, 12), (10000, 0.06, 24), (500, 0.12, 0), (1000, 0.0, 4), (2400, 0.03, 1)],
      "compute a loan's monthly payment",
      names={"principal": ("principal", "amount", "loan"), "annual_rate": ("annual_rate", "rate", "apr"),
             "months": ("months", "term", "n_months"), "r": ("r", "monthly")}),

    T("ledger", "interest", ("percent_change", "pct_change", "growth_rate"),
      '''
def $fn($old, $new):
    """Percentage change from $old to $new, rounded to 2 places."""
    if $old == 0:
        raise ZeroDivisionError("change from zero is undefined")
    return round(($new - $old) / abs($old) * 100, 2)
''',
      (B("swapped_arguments", "($new - $old)", "($old - $new)"),
       B("wrong_exception", "raise ZeroDivisionError", "raise ValueError"),
       B("wrong_constant", "abs($old) * 100, 2)", "abs($old) * 10, 2)"),
       B("wrong_function", "/ abs($old)", "/ float($old)")),
      [(50, 75), (200, 150), (0, 5), (-10, -5), (8, 8)],
      "compute a percentage change",
      names={"old": ("old", "before", "previous"), "new": ("new", "after", "current")}),

    # ------------------------------------------------------------------ gradebook
    T("gradebook", "stats", ("mean", "average", "arithmetic_mean"),
      '''
def $fn($values):
    """Arithmetic mean rounded to 2 places; ValueError when there are no values."""
    if not $values:
        raise ValueError("mean of empty data")
    return round(sum($values) / len($values), 2)
''',
      (B("wrong_exception", "raise ValueError", "raise IndexError"),
       B("missing_edge_case", '    if not $values:\n        raise ValueError("mean of empty data")\n', ""),
       B("wrong_constant", "/ len($values), 2)", "/ len($values), 1)")),
      [([1, 2, 3, 4],), ([],), ([2.25, 2.5],), ([10],), ([1, 2],)],
      "compute an average",
      names={"values": VALUES}),

    T("gradebook", "stats", ("median", "middle_value", "med"),
      '''
def $fn($values):
    """Median of the values (mean of the two middle ones for an even count)."""
    $ordered = sorted($values)
    $mid = len($ordered) // 2
    if len($ordered) % 2:
        return $ordered[$mid]
    return ($ordered[$mid - 1] + $ordered[$mid]) / 2
''',
      (B("off_by_one", "$ordered[$mid - 1] +", "$ordered[$mid + 1] +"),
       B("inverted_condition", "if len($ordered) % 2:", "if not len($ordered) % 2:"),
       B("wrong_function", "$ordered = sorted($values)", "$ordered = list($values)"),
       B("wrong_operator", "+ $ordered[$mid]) / 2", "+ $ordered[$mid]) // 2")),
      [([3, 1, 2],), ([4, 1, 3, 2],), ([7],), ([1, 2, 3, 5, 8, 13],), ([5, 2],)],
      "compute a median",
      names={"values": VALUES, "ordered": ("ordered", "ranked", "srt"), "mid": ("mid", "half", "centre")}),

    T("gradebook", "stats", ("value_range", "spread", "span_of"),
      '''
def $fn($values):
    """Difference between the largest and the smallest value; 0 when there are none."""
    if not $values:
        return 0
    return max($values) - min($values)
''',
      (B("missing_edge_case", "    if not $values:\n        return 0\n", ""),
       B("swapped_arguments", "return max($values) - min($values)", "return min($values) - max($values)"),
       B("wrong_return_value", "return 0", "return None")),
      [([3, 9, 4],), ([],), ([5],), ([-2, 2],)],
      "compute the spread of values",
      names={"values": VALUES}),

    T("gradebook", "stats", ("weighted_mean", "weighted_average", "mean_weighted"),
      '''
def $fn($values, $weights):
    """Mean of $values weighted by $weights; None when the weights sum to 0."""
    $total = 0.0
    $weight_sum = 0.0
    for $v, $w in zip($values, $weights):
        $total += $v * $w
        $weight_sum += $w
    if $weight_sum == 0:
        return None
    return round($total / $weight_sum, 3)
''',
      (B("wrong_accumulator_init", "$total = 0.0", "$total = 1.0"),
       B("wrong_accumulator_init", "$weight_sum = 0.0", "$weight_sum = 1.0"),
       B("missing_edge_case", "    if $weight_sum == 0:\n        return None\n", ""),
       B("wrong_operator", "$total += $v * $w", "$total += $v + $w"),
       B("wrong_return_value", "return None", "return 0.0")),
      [([80, 90], [1, 3]), ([], []), ([5, 7], [0, 0]), ([2.5], [2]), ([1, 2, 3], [1, 1, 1])],
      "compute a weighted average",
      names={"values": VALUES, "weights": ("weights", "counts", "w_list"), "total": TOTAL,
             "weight_sum": ("weight_sum", "denom", "wsum"), "v": ("v", "x", "val"), "w": ("w", "k", "wt")}),

    T("gradebook", "grades", ("letter_grade", "grade_for", "to_letter"),
      '''
def $fn($score):
    """Letter for a 0-100 score: A from $a_cut, B from 80, C from 70, D from 60, else F."""
    if not 0 <= $score <= 100:
        raise ValueError("score out of range")
    for $cutoff, $letter in (($a_cut, "A"), (80, "B"), (70, "C"), (60, "D")):
        if $score >= $cutoff:
            return $letter
    return "F"
''',
      (B("wrong_comparison", "if $score >= $cutoff:", "if $score > $cutoff:"),
       B("wrong_constant", '(80, "B")', '(85, "B")'),
       B("wrong_return_value", 'return "F"', 'return "D"'),
       B("wrong_exception", "raise ValueError", "raise AssertionError")),
      lambda c: [(95,), (c["a_cut"],), (80,), (59,), (101,), (83,), (70,)],
      "turn a score into a letter grade",
      names={"score": ("score", "points", "mark"), "cutoff": ("cutoff", "floor", "bound"),
             "letter": ("letter", "grade")},
      consts={"a_cut": (90, 93)}),

    T("gradebook", "grades", ("curve", "curve_scores", "shift_scores"),
      '''
def $fn($scores, $target=$t):
    """Shift all scores so the best one equals $target, capping at 100."""
    if not $scores:
        return []
    $bonus = $target - max($scores)
    return [min(100, $s + $bonus) for $s in $scores]
''',
      (B("missing_edge_case", "    if not $scores:\n        return []\n", ""),
       B("wrong_function", "$target - max($scores)", "$target - min($scores)"),
       B("wrong_default", "$target=$t", "$target=100"),
       B("wrong_operator", "$s + $bonus", "$s - $bonus")),
      lambda c: [([70, 85, 60],), ([],), ([c["t"]],), ([50, 99], 100), ([40, 80],)],
      "curve a list of scores",
      names={"scores": ("scores", "marks", "points"), "target": ("target", "top", "best"),
             "bonus": ("bonus", "shift", "delta"), "s": ("s", "x", "score")},
      consts={"t": (95, 98, 90)}),

    T("gradebook", "grades", ("pass_rate", "passing_fraction", "share_passed"),
      '''
def $fn($scores, $pass_mark=$pm):
    """Fraction of scores at or above $pass_mark, rounded to 3 places."""
    if not $scores:
        return 0.0
    $passed = sum(1 for $s in $scores if $s >= $pass_mark)
    return round($passed / len($scores), 3)
''',
      (B("wrong_comparison", "if $s >= $pass_mark)", "if $s > $pass_mark)"),
       B("wrong_default", "$pass_mark=$pm", "$pass_mark=70"),
       B("missing_edge_case", "    if not $scores:\n        return 0.0\n", ""),
       B("wrong_constant", "/ len($scores), 3)", "/ len($scores), 1)")),
      lambda c: [([c["pm"], c["pm"] - 1, 90],), ([],), ([100, 100],), ([10, 20, 30], 20), ([c["pm"] + 5, 12, 13],)],
      "compute the pass rate",
      names={"scores": ("scores", "marks", "points"), "pass_mark": ("pass_mark", "threshold", "minimum"),
             "passed": ("passed", "ok", "count"), "s": ("s", "x", "score")},
      consts={"pm": (50, 60, 65)}),

    # ------------------------------------------------------------------ logscan
    T("logscan", "lines", ("parse_log_line", "split_record", "parse_entry"),
      '''
def $fn($line):
    """Split 'DATE TIME LEVEL message' into (timestamp, level, message)."""
    $parts = $line.split(" ", 3)
    if len($parts) < 4:
        raise ValueError(f"malformed log line: {$line!r}")
    return $parts[0] + " " + $parts[1], $parts[2].upper(), $parts[3]
''',
      (B("wrong_constant", '$line.split(" ", 3)', '$line.split(" ", 2)'),
       B("wrong_comparison", "if len($parts) < 4:", "if len($parts) < 3:"),
       B("wrong_exception", "raise ValueError", "raise IndexError"),
       B("wrong_function", "$parts[2].upper()", "$parts[2].title()")),
      [("2024-01-02 10:00:00 info started worker 3",), ("garbage",), ("2024-01-02 10:00:01 ERROR disk full",),
       ("2024-01-02 10:00:02 WARN",)],
      "parse a log line",
      names={"line": ("line", "raw", "record"), "parts": ("parts", "fields", "cols")}),

    T("logscan", "lines", ("count_levels", "level_counts", "tally_levels"),
      '''
def $fn($lines):
    """Count 'DATE TIME LEVEL message' lines per level: (level, count) pairs sorted by level."""
    $counts = {}
    for $line in $lines:
        $level = $line.split()[2]
        $counts[$level] = $counts.get($level, 0) + 1
    return sorted($counts.items())
''',
      (B("off_by_one", "$line.split()[2]", "$line.split()[1]"),
       B("wrong_constant", "$counts.get($level, 0) + 1", "$counts.get($level, 1) + 1"),
       B("wrong_return_value", "return sorted($counts.items())", "return list($counts.items())")),
      [(["d 1 INFO a", "d 2 ERROR b", "d 3 INFO c"],), ([],), (["d 1 WARN x"],), (["d 1 b x", "d 2 a y"],)],
      "count log lines per level",
      names={"lines": ("lines", "records", "rows"), "counts": ("counts", "tally", "freq"),
             "line": ("line", "rec"), "level": ("level", "lvl")}),

    T("logscan", "lines", ("tail", "last_lines", "tail_lines"),
      '''
def $fn($lines, $n=$default_n):
    """The last $n lines (all of them when there are fewer)."""
    if $n <= 0:
        return []
    return $lines[-$n:]
''',
      (B("missing_edge_case", "    if $n <= 0:\n        return []\n", ""),
       B("off_by_one", "return $lines[-$n:]", "return $lines[-$n + 1:]"),
       B("wrong_default", "$n=$default_n", "$n=1"),
       B("wrong_return_value", "return []", "return $lines")),
      lambda c: [(["a", "b", "c"], 2), (list("abcdefghijklm"),), ([], 3), (["x", "y"], 0), (["p"],)],
      "take the last lines of a log",
      names={"lines": ("lines", "records", "rows"), "n": ("n", "count", "keep")},
      consts={"default_n": (5, 10)}),

    T("logscan", "levels", ("at_least", "is_severe", "level_at_least"),
      '''
def $fn($level, $minimum="WARNING"):
    """True when $level is at least as severe as $minimum."""
    $order = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    return $order.index($level.upper()) >= $order.index($minimum.upper())
''',
      (B("wrong_comparison", ") >= $order.index(", ") > $order.index("),
       B("wrong_default", '$minimum="WARNING"', '$minimum="ERROR"'),
       B("swapped_arguments", "$order.index($level.upper()) >= $order.index($minimum.upper())",
         "$order.index($minimum.upper()) >= $order.index($level.upper())")),
      [("warning",), ("INFO",), ("critical", "ERROR"), ("debug", "DEBUG"), ("ERROR",)],
      "compare log levels",
      names={"level": ("level", "lvl", "severity"), "minimum": ("minimum", "floor", "threshold"),
             "order": ("order", "ranks", "levels")}),

    T("logscan", "levels", ("filter_level", "messages_at", "select_level"),
      '''
def $fn($records, $level):
    """Messages of (level, message) records whose level is $level, ignoring case."""
    $wanted = $level.lower()
    return [$msg for $lvl, $msg in $records if $lvl.lower() == $wanted]
''',
      (B("inverted_condition", "if $lvl.lower() == $wanted]", "if $lvl.lower() != $wanted]"),
       B("wrong_function", "$wanted = $level.lower()", "$wanted = $level.upper()"),
       B("wrong_return_value", "return [$msg for", "return [$lvl for")),
      [([("INFO", "up"), ("error", "down"), ("info", "ok")], "info"), ([], "debug"), ([("WARN", "w")], "error"),
       ([("Error", "e1")], "ERROR")],
      "filter log messages by level",
      names={"records": ("records", "entries", "events"), "level": ("level", "lvl_name", "severity"),
             "wanted": ("wanted", "target", "needle"), "msg": ("msg", "message", "text"), "lvl": ("lvl", "lev")}),

    T("logscan", "levels", ("mask_secret", "redact", "hide_token"),
      '''
def $fn($value, $visible=4, $mask_char="*"):
    """Mask all but the last $visible characters of $value."""
    if len($value) <= $visible:
        return $mask_char * len($value)
    return $mask_char * (len($value) - $visible) + $value[-$visible:]
''',
      (B("wrong_comparison", "if len($value) <= $visible:", "if len($value) < $visible:"),
       B("wrong_default", "$visible=4", "$visible=3"),
       B("off_by_one", "(len($value) - $visible)", "(len($value) - $visible - 1)"),
       B("wrong_default", '$mask_char="*"', '$mask_char="#"')),
      [("sk-1234567890",), ("abcd",), ("",), ("password", 2), ("token", 3, "x"), ("abc",)],
      "mask a secret",
      names={"value": ("value", "secret", "token"), "visible": ("visible", "keep", "show"),
             "mask_char": ("mask_char", "fill", "pad")}),
]


PACKAGE_DOCS = {
    "stockroom": "Inventory and pricing helpers for a small shop.",
    "textkit": "Text utilities: clean-up, words and formatting.",
    "timespan": "Date ranges, working days and durations.",
    "confparse": "Parsing and typed access for simple configuration files.",
    "gridmath": "Matrix and vector helpers on plain Python lists.",
    "taskqueue": "Job queue and scheduling helpers.",
    "unitconv": "Unit conversions: lengths, temperatures and data sizes.",
    "ledger": "Bookkeeping: account entries, interest and loans.",
    "gradebook": "Statistics and grading for course scores.",
    "logscan": "Parsing and filtering of application logs.",
}

MODULE_DOCS = {
    ("stockroom", "stock"): "Stock level helpers.",
    ("stockroom", "pricing"): "Price calculations for orders.",
    ("textkit", "cleanup"): "Small text clean-up helpers.",
    ("textkit", "words"): "Word-level text utilities.",
    ("timespan", "ranges"): "Helpers for date ranges given as ISO strings.",
    ("timespan", "workdays"): "Working days, quarters and durations.",
    ("confparse", "parser"): "Parsing of raw configuration lines.",
    ("confparse", "values"): "Typed access to configuration values.",
    ("gridmath", "matrix"): "Matrix helpers on nested lists.",
    ("gridmath", "vectors"): "Vector helpers on plain lists.",
    ("taskqueue", "jobs"): "Job queue helpers.",
    ("taskqueue", "scheduler"): "Scheduling helpers.",
    ("unitconv", "length"): "Length conversions.",
    ("unitconv", "temperature"): "Temperature conversions and summaries.",
    ("unitconv", "storage"): "Data size conversions.",
    ("ledger", "accounts"): "Account entry helpers.",
    ("ledger", "interest"): "Interest and loan calculations.",
    ("gradebook", "stats"): "Descriptive statistics.",
    ("gradebook", "grades"): "Grading helpers.",
    ("logscan", "lines"): "Parsing of log lines.",
    ("logscan", "levels"): "Log level helpers.",
}
