"""Tenancy: which namespaces may send runs to which pool, and each namespace's quota.

A pool is a set of tools and credentials (its workers' modules, Secrets and cloud identity), so
which namespaces may use it is a security boundary. The chart renders the tenancy file from its
values (``workers.pools[].namespaces`` / ``namespaceSelector``, ``quotas``)::

    pools:
    - name: payments
      namespaces: [payments, payments-staging]     # these namespaces ...
      namespaceSelector:                           # ... and any namespace with these labels
        matchLabels: {agentrun.dev/tenant: payments}
    quotas:
      team-a: {maxRunningRuns: 4}

A pool listed with neither key, and a pool not listed, admit every namespace. An AgentRun whose
namespace its pool does not admit is refused by the operator before any run exists
(``Accepted=False``, reason ``PoolNotAllowed``, naming the pool and the rule). The quotas are
written into the store, where the claim enforces them (migration 0012).

The check is the operator's, not CEL's: an AgentRun's CEL rules see only the object, not the
operator's configuration nor the namespace's labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrun.errors import ConfigError
from agentrun.operator.configfile import read_model


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Requirement(_Model):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return labels.get(self.key) in self.values
        return labels.get(self.key) not in self.values  # NotIn: also when the key is absent


class LabelSelector(_Model):
    """A metav1.LabelSelector: every matchLabels pair and every expression must hold."""

    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[Requirement] = Field(default_factory=list, alias="matchExpressions")

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.match_labels.items()]
        parts += [
            f"{r.key} {r.operator}" + (f" ({', '.join(r.values)})" if r.values else "")
            for r in self.match_expressions
        ]
        return ", ".join(parts)


class PoolAccess(_Model):
    name: str = Field(min_length=1)
    namespaces: list[str] = Field(default_factory=list)
    namespace_selector: LabelSelector | None = Field(None, alias="namespaceSelector")

    @property
    def bound(self) -> bool:
        """Whether this pool admits only some namespaces."""
        return bool(self.namespaces) or self.namespace_selector is not None

    def rule(self) -> str:
        """The rule, as the refusal names it."""
        parts = []
        if self.namespaces:
            parts.append(f"namespaces {', '.join(self.namespaces)}")
        if self.namespace_selector is not None:
            parts.append(f"namespaces labelled {self.namespace_selector.describe()}")
        return " or ".join(parts)


class QuotaConfig(_Model):
    max_running_runs: int = Field(alias="maxRunningRuns", ge=0)


class TenancyFile(_Model):
    pools: list[PoolAccess] = Field(default_factory=list)
    quotas: dict[str, QuotaConfig] = Field(default_factory=dict)


@dataclass(frozen=True)
class Tenancy:
    pools: Mapping[str, PoolAccess] = field(default_factory=dict)
    #: namespace -> most runs running at once. None: the operator does not manage quotas (no
    #: tenancy file), so it leaves the store's quota rows as they are.
    quotas: Mapping[str, int] | None = None

    def needs_labels(self, pool: str, namespace: str) -> bool:
        """Whether deciding needs the namespace's labels (a selector, and no listed name)."""
        access = self.pools.get(pool)
        return (
            access is not None
            and access.namespace_selector is not None
            and namespace not in access.namespaces
        )

    def refusal(
        self, pool: str, namespace: str, labels: Mapping[str, str] | None = None
    ) -> str | None:
        """Why ``namespace`` may not use ``pool`` (None: it may). ``labels``: the namespace's,
        when :meth:`needs_labels` says they are needed."""
        access = self.pools.get(pool)
        if access is None or not access.bound or namespace in access.namespaces:
            return None
        selector = access.namespace_selector
        if selector is not None and selector.matches(labels or {}):
            return None
        return (
            f"pool {pool} admits only {access.rule()}; namespace {namespace} is not one of "
            "them: use a pool that admits it (spec.pool), or ask the platform team to add the "
            f"namespace to workers.pools[{pool}] in the agentrun chart"
        )


def load_tenancy(path: str | Path) -> Tenancy:
    """Read the tenancy file; every error names the file and the field."""
    parsed = read_model(path, TenancyFile, "the tenancy file")
    pools: dict[str, PoolAccess] = {}
    for p in parsed.pools:
        if p.name in pools:
            raise ConfigError(f"{path}: pool {p.name!r} is listed twice")
        pools[p.name] = p
    return Tenancy(
        pools=pools, quotas={ns: q.max_running_runs for ns, q in parsed.quotas.items()}
    )
