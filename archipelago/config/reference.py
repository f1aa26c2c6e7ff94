"""Generate the configuration reference (docs/configuration.md) from field docstrings.

The docstrings live as string literals right under each field, the convention tyro
reads for `--help`; we read the same literals with `ast` so both stay in one place.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from archipelago.config.loading import _type_name
from archipelago.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring literal written under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = following.value.value.strip()
    return docs


def _default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "unset"
    return repr(value) if isinstance(value, str) else str(value)


def reference_markdown() -> str:
    """The whole configuration reference as Markdown."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the field docstrings in `archipelago/config/schema.py` by",
        "`archipelago config reference`; do not edit by hand.",
        "",
        "Every key can be set in a TOML run file (`[section]` then `key = value`) or on the",
        "command line as `--section.key value` / `--section.key=value`; booleans are bare flags",
        "(`--checkpoint.enable`, `--checkpoint.no_enable`).",
        "",
    ]
    defaults = Config()
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        lines += [f"## [{section.name}]", "", (inspect.getdoc(cls) or "").strip(), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section.name), f.name)
            type_name = _type_name(hints[f.name]).replace("|", "\\|")
            doc = docs.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{f.name}` | {type_name} | `{_default(value)}` | {doc} |")
        lines.append("")
    return "\n".join(lines)
