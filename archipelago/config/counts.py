"""Per-rank and per-stage integer lists in a config value, in our form or SynerFuse's.

Ours lists one value per rank or stage: `"6,2"`. SynerFuse's flags list pairs of
(how many ranks or stages, value): `"1 6 1 2"` is one with 6 and one with 2, `"2 3"` is two
with 3 each. Both forms are accepted wherever a list of counts is, so a user's SynerFuse
command line carries over unchanged.
"""

from __future__ import annotations


def _positive(token: str, what: str, text: str) -> int:
    try:
        value = int(token)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{what} = {text!r}: {token!r} is not a positive whole number")
    return value


def parse_counts(text: str, expected: int, what: str) -> tuple[int, ...]:
    """`expected` positive integers from `"v0,v1,..."` or SynerFuse's `"n0 v0 n1 v1 ..."`
    (ValueError naming both forms when the text is neither or has the wrong length)."""
    forms = (f"write one value per entry separated by commas (\"6,2\") or SynerFuse's pairs of count and "
             f"value (\"1 6 1 2\"), {expected} entries in all")
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{what} is empty; {forms}")
    if "," in stripped or len(stripped.split()) == 1:
        values = tuple(_positive(token.strip(), what, text) for token in stripped.split(","))
    else:
        tokens = stripped.split()
        if len(tokens) % 2:
            raise ValueError(f"{what} = {text!r}: SynerFuse's form takes pairs (count value), got an odd "
                             f"number of numbers; {forms}")
        pairs = [(_positive(n, what, text), _positive(v, what, text)) for n, v in zip(tokens[::2], tokens[1::2])]
        values = tuple(value for count, value in pairs for _ in range(count))
    if len(values) != expected:
        raise ValueError(f"{what} = {text!r} gives {len(values)} entries for {expected}; {forms}")
    return values


def parse_factors(text: str, expected: int, what: str) -> tuple[float, ...]:
    """`expected` factors >= 1 from `"1,2.5"` (ValueError naming the form otherwise)."""
    try:
        values = tuple(float(token) for token in text.split(","))
    except ValueError:
        values = ()
    if len(values) != expected or not all(v >= 1 for v in values):
        raise ValueError(f"{what} = {text!r}: write {expected} factors of at least 1 separated by commas, "
                         "one per rank (\"1,2\": rank 1 twice as slow)")
    return values
