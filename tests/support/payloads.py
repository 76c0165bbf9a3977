"""Hostile inputs shared by the hostile-input suites."""

# A YAML "billion laughs": 7 levels of 10 aliases each, 10^7 nodes once expanded, 400 bytes on disk.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdef", "bcdefg", strict=True))
