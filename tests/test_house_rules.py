"""House rules as tests: the SQL file's conventions and the import layers.

Each rule reads the real files (queries.sql; every module under src/agentrun, the symlinked
operator/ and worker/ subpackages included, which import-linter cannot see) and names what breaks
it, so a change that breaks a rule fails here rather than in review.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from agentrun.sql import queries

SRC = Path(__file__).resolve().parent.parent / "src"
QUERIES_SQL = SRC / "agentrun" / "sql" / "queries.sql"

# -- queries.sql ---------------------------------------------------------------------------------

_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)

#: The fence: a statement on behalf of a lease holder matches only while this worker still holds
#: the run, under this epoch, and the run is running (docs/store.md, "Leases and fencing").
FENCE = re.compile(
    r"lease_owner\s*=\s*%\(worker\)s\s+AND\s+lease_epoch\s*=\s*%\(epoch\)s\s+AND\s+"
    r"status\s*=\s*'running'"
)
#: The same fence for many runs of one holder at once (the batched heartbeat, the group commit):
#: each row's own epoch, from the unnest of the ids and epochs the worker holds (and, for the
#: group commit, more columns after those two).
BATCH_FENCE = re.compile(
    r"unnest\(%\(run_ids\)s::uuid\[\],\s*%\(epochs\)s::bigint\[\][^;]*?\)\s+"
    r"AS\s+held\(run_id,\s*epoch\b[^)]*\)"
    r".*\bid\s*=\s*held\.run_id\s+AND\s+lease_owner\s*=\s*%\(worker\)s\s+AND\s+"
    r"lease_epoch\s*=\s*held\.epoch\s+AND\s+status\s*=\s*'running'",
    re.DOTALL,
)

#: Writes that act for a lease holder (see _acts_for_a_holder) yet are fenced otherwise, on
#: purpose.
FENCED_OTHERWISE = {
    "claim_runs": "the claim takes the lease: it sets lease_owner and bumps the epoch, "
    "and matches pending runs or expired leases instead",
}


def _named_queries() -> dict[str, str]:
    text = QUERIES_SQL.read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    return dict(zip(parts[1::2], (b.strip() for b in parts[2::2]), strict=True))


def _code(body: str) -> str:
    """The statement without its `--` comments."""
    return "\n".join(line.split("--", 1)[0] for line in body.splitlines())


def _acts_for_a_holder(code: str) -> bool:
    """A write naming the holder's epoch, a `fence` CTE, or the lease owner and the worker."""
    if not re.search(r"\b(UPDATE|INSERT|DELETE)\b", code, re.IGNORECASE):
        return False
    return (
        "%(epoch)s" in code
        or "%(epochs)s" in code
        or re.search(r"\bWITH\s+fence\s+AS\b", code, re.IGNORECASE) is not None
        or ("lease_owner" in code and "%(worker)s" in code)
    )


def test_the_rule_readers_see_every_named_query() -> None:
    assert set(_named_queries()) == set(queries)


def test_every_named_query_has_a_description_line() -> None:
    """procrastinate's habit: each `-- name --` header is followed by a `--` line saying what the
    statement is for."""
    undescribed = [
        name
        for name, body in _named_queries().items()
        if not re.match(r"--\s*\S", body.splitlines()[0] if body else "")
    ]
    assert not undescribed, (
        f"named queries without a `-- description` line after their header: {undescribed}"
    )


def test_every_fenced_statement_carries_the_full_fence_predicate() -> None:
    broken = []
    for name, body in _named_queries().items():
        code = _code(body)
        if not _acts_for_a_holder(code) or name in FENCED_OTHERWISE:
            continue
        if not (FENCE.search(code) or BATCH_FENCE.search(code)):
            broken.append(name)
    assert not broken, (
        "statements acting for a lease holder must match "
        "`lease_owner = %(worker)s AND lease_epoch = %(epoch)s AND status = 'running'` "
        f"(or be listed in FENCED_OTHERWISE with a reason): {broken}"
    )


def test_the_fenced_otherwise_list_names_only_real_holder_statements() -> None:
    """A stale exception (renamed or no longer acting for a holder) is dropped, not kept."""
    named = _named_queries()
    for name, reason in FENCED_OTHERWISE.items():
        assert name in named, f"FENCED_OTHERWISE names {name!r}, which queries.sql lacks"
        assert _acts_for_a_holder(_code(named[name])), f"{name!r} no longer needs an exception"
        assert reason


# -- import layers -------------------------------------------------------------------------------

#: Entry points may import every layer; the core (store, manifests, tools, ...) neither the
#: worker, the operator nor an entry point; the worker and the operator never each other.
ENTRY = ("agentrun.cli", "agentrun.__main__", "agentrun.entrypoint")


def _layer(module: str) -> str:
    for layer in ("agentrun.worker", "agentrun.operator"):
        if module == layer or module.startswith(layer + "."):
            return layer.removeprefix("agentrun.")
    if module in ENTRY or any(module.startswith(e + ".") for e in ENTRY):
        return "entry"
    return "core"


FORBIDDEN = {
    ("worker", "operator"),
    ("operator", "worker"),
    ("core", "worker"),
    ("core", "operator"),
    ("core", "entry"),
    ("worker", "entry"),
    ("operator", "entry"),
}

#: (importer, imported) pairs that break a layer on purpose, each with its reason.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, through the operator/worker symlinks."""
    root = SRC / "agentrun"
    found: dict[str, Path] = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and entry.name != "__pycache__":
                stack.append(entry)  # is_dir() follows the symlinks
            elif entry.suffix == ".py":
                rel = entry.relative_to(SRC).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                found[".".join(parts)] = entry
    return found


def _imports(module: str, path: Path) -> set[str]:
    """Every agentrun module ``module`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            # `from agentrun import worker` imports the subpackage itself
            out.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in out if m == "agentrun" or m.startswith("agentrun.")}


def test_the_layer_reader_sees_the_symlinked_subpackages() -> None:
    modules = _modules()
    assert "agentrun.worker.process" in modules and "agentrun.operator.handlers" in modules
    assert _layer("agentrun.worker.process") == "worker"
    assert _layer("agentrun.store") == "core"


def test_imports_point_one_way_operator_core_worker() -> None:
    """operator -> core <- worker (src/agentrun/__init__.py); only entry points see both."""
    modules = _modules()
    broken: set[str] = set()
    for module, path in modules.items():
        for imported in _imports(module, path):
            if imported not in modules and imported.rpartition(".")[0] in modules:
                imported = imported.rpartition(".")[0]  # `from pkg.mod import name`
            pair = (_layer(module), _layer(imported))
            if pair in FORBIDDEN and (module, imported) not in LAYER_EXCEPTIONS:
                broken.add(f"{module} ({pair[0]}) imports {imported} ({pair[1]})")
    assert not broken, "imports across the layers:\n" + "\n".join(sorted(broken))


def test_the_layer_exceptions_are_still_needed() -> None:
    modules = _modules()
    for (importer, imported), reason in LAYER_EXCEPTIONS.items():
        assert reason
        assert imported in _imports(importer, modules[importer]), (
            f"{importer} no longer imports {imported}: drop the exception"
        )
