"""The package's layering, checked on the source: import direction, no circles, a pure policy.

`launch -> trainer -> {island, federation, checkpoint, data, models, metrics} -> config`;
island/ and federation/ never import each other; federation/policy.py imports no torch,
torchft, sockets, processes or threads. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "archipelago"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` is a.b if that is a module)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_there_are_no_import_circles():
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycle = trail[trail.index(node):] + [node]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if node in done:
            return
        for nxt in sorted(GRAPH[node]):
            visit(nxt, trail + [node])
        done.add(node)

    for name in sorted(GRAPH):
        visit(name, [])


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("low,high", [("island", "federation"), ("federation", "island"),
                                      ("config", "island"), ("config", "federation"), ("config", "trainer"),
                                      ("federation", "trainer"), ("island", "trainer"), ("models", "trainer"),
                                      ("federation", "launch"), ("trainer", "launch")])
def test_layers_import_downwards_only(low, high):
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if _layer(m) == low
                   for d in deps if _layer(d) == high)
    assert not wrong, wrong


def test_the_round_policy_is_pure():
    imported = _imports(MODULES["archipelago.federation.policy"])
    banned = ("torch", "torchft", "socket", "subprocess", "threading", "multiprocessing", "os")
    assert not [m for m in imported if m.split(".")[0] in banned or m.startswith("archipelago.")], imported


# One name per concept (docs/glossary.md, "Retired names"): a retired name may not come back
# in the package, in code, log messages, `--help` or the dashboard.
RETIRED = {
    r"(?i)\breject": "refuse / refused / refusal",
    r"\bUpdateGuard\b": "PseudoGradientGuard",
    r"\bjudge_update\b": "policy.judge_pseudo_gradient",
    r"\bUPDATE_KINDS\b": "config.faults.POISON_KINDS",
    r"(?i)\bpoisoned updates?\b|\bupdate guards?\b|\bthe updates? of (island|a peer)": "pseudo-gradient",
    r"\b(h|host|outer|loop|pending|p)\.step\b": "outer_step (a plain step is an inner step)",
    r"\bRoundPlan\b|\bplan_round\b": "RoundPart, part_in_round (a plan is an island's split over its ranks)",
    r"\bsimulation\.py\b|\barchipelago\.simulation\b": "quality_simulator.py (simulate is archipelago simulate)",
}


def test_retired_names_stay_out_of_the_package():
    import re

    glossary = (PACKAGE.parent / "docs" / "glossary.md").read_text()
    assert "## Retired names" in glossary
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.html")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, instead in RETIRED.items():
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()[:80]} (use {instead})")
    assert not found, "\n".join(found)
