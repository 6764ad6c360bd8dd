"""House rules of docs/security.md that a reader can check in the source, as tests.

* SQL is parameterised: no statement is built with Python string formatting (an f-string, ``%``
  or ``.format``); identifiers go through ``psycopg.sql.Identifier``; values are bound.
* queries.sql binds values only as ``%(name)s`` placeholders.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "src" / "agentrun").rglob("*.py")),
           *sorted((ROOT / "operator").glob("*.py")), *sorted((ROOT / "worker").glob("*.py"))]
EXECUTE = {"execute", "executemany"}


def formatted(node: ast.expr) -> bool:
    """Whether an expression builds a string by Python formatting."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        # psycopg.sql.SQL(...).format(Identifier(...)) composes safely; str.format does not.
        and not (isinstance(node.func.value, ast.Call)
                 and getattr(node.func.value.func, "attr", "") == "SQL")
    )


def test_no_statement_is_built_by_string_formatting() -> None:
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in EXECUTE and node.args and formatted(node.args[0])):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert SOURCES and not offenders, f"SQL built by string formatting: {offenders}"


def test_queries_bind_values_only_as_named_placeholders() -> None:
    text = (ROOT / "src" / "agentrun" / "sql" / "queries.sql").read_text()
    body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))
    # %(name)s placeholders (%(name)b: the same, the value sent in binary) and %% (a literal %
    # for format()) only; no {name} or bare %s.
    stray = re.findall(r"%.{0,12}", re.sub(r"%%|%\(\w+\)[sb]", "", body))
    assert not stray, f"queries.sql has placeholders other than %(name)s / %(name)b: {stray[:5]}"
    assert not re.search(r"\{\w*\}", body), "queries.sql has a Python format field"


def test_the_rule_catches_a_formatted_statement() -> None:
    bad = ast.parse('conn.execute(f"SELECT * FROM t WHERE id = {x}")').body[0]
    assert isinstance(bad, ast.Expr) and isinstance(bad.value, ast.Call)
    assert formatted(bad.value.args[0])
    good = ast.parse('conn.execute(sql.SQL("DROP SCHEMA {}").format(sql.Identifier(n)))').body[0]
    assert isinstance(good, ast.Expr) and isinstance(good.value, ast.Call)
    assert not formatted(good.value.args[0])


def test_every_test_the_threat_model_cites_exists() -> None:
    """docs/security.md ties each claim to tests: each cited file and test function exists (a
    renamed or deleted test would leave a claim unbacked)."""
    doc = (ROOT / "docs" / "security.md").read_text()
    cited = 0
    for m in re.finditer(r"tests/(\w+\.py)((?:(?:, )?::\w+)*)", doc):
        path = ROOT / "tests" / m.group(1)
        assert path.exists(), f"docs/security.md cites {path.name}, which does not exist"
        names = {n.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for test in re.findall(r"::(\w+)", m.group(2)):
            assert test in names, f"docs/security.md cites {path.name}::{test}, which is gone"
            cited += 1
    assert cited >= 10
