"""Every condition type and reason the operator writes (on a condition or an Event) is a constant
of its API module (agentrun.operator.api), never a string written where it is used: an AST scan
of the operator's code."""

from __future__ import annotations

import ast
from pathlib import Path

from agentrun.operator import api

OPERATOR = Path(__file__).resolve().parent.parent / "operator"

#: Calls that take a condition type or a reason: the positions (and keywords) holding them.
TAKES = {
    "Event": ({1}, {"reason"}),
    "Cond": ({0, 2}, {"type", "reason"}),
    "not_ready": ({0}, {"reason"}),
    "_has_reason": ({1, 2}, {"ctype", "reason"}),
    "refuse": ({0}, {"reason"}),
}
CONSTANTS = {"Reason", "CondType"}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def written_reasons(source: str, filename: str) -> list[str]:
    """Each place in ``source`` where a condition type or reason is not a name: a literal, an
    f-string, or a constant of a class other than the API module's."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call) or (name := _name(node.func)) not in TAKES:
            continue
        positions, keywords = TAKES[name]
        args = [a for i, a in enumerate(node.args) if i in positions]
        args += [k.value for k in node.keywords if k.arg in keywords]
        for arg in args:
            if isinstance(arg, ast.Constant | ast.JoinedStr) or (
                isinstance(arg, ast.Attribute)
                and isinstance(arg.value, ast.Name)
                and arg.value.id not in CONSTANTS
                and arg.value.id[:1].isupper()
            ):
                found.append(f"{filename}:{node.lineno}: {name}(... {ast.unparse(arg)} ...)")
    return found


def test_every_reason_and_condition_type_is_a_constant_of_the_api_module() -> None:
    sources = sorted(OPERATOR.glob("*.py"))
    assert len(sources) > 10
    found = [w for p in sources for w in written_reasons(p.read_text(), p.name)]
    assert found == [], "name these in agentrun.operator.api (Reason, CondType):\n" + "\n".join(
        found)


def test_the_scan_finds_a_written_reason() -> None:
    # The rule's own check: each way of writing one past the constants is caught.
    source = (
        'Event("Warning", "SomeReason", "text")\n'
        'Cond(CondType.READY, False, f"{x}Reason")\n'
        'Cond("Ready", False, Reason.FAILED)\n'
        'not_ready(reason="Oops", why="")\n'
        'Event("Normal", Reason.CREATED, "fine")\n'
    )
    assert len(written_reasons(source, "example.py")) == 4


def test_the_api_module_names_the_group_and_version_manifests_use() -> None:
    from agentrun.manifests import API_VERSION

    assert f"{api.GROUP}/{api.VERSION}" == API_VERSION
    assert api.AGENTRUNS == (api.GROUP, api.VERSION, "agentruns")
