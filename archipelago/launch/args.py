"""Command-line pieces shared by the launch commands."""

from __future__ import annotations


def pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `--name VALUE` / `--name=VALUE` from argv; returns (value, rest)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest
