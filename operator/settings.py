"""The operator's settings: environment (``AGENTRUN_*``) and the pools file the Helm chart mounts.

The pools file lists the worker pools the operator scales (pools with a fixed replica count are
not listed, so the operator never touches them)::

    pools:
    - name: default                 # the pool runs are queued in
      namespace: agentrun           # where its worker Deployment lives
      deployment: agentrun-worker-default
      runsPerWorker: 4
      minReplicas: 0
      maxReplicas: 10
      scaleDownDelaySeconds: 300
      spareSlots: 0                 # free run slots kept while there are live runs
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrun.config import env_float, env_int
from agentrun.errors import ConfigError
from agentrun.operator.configfile import read_model
from agentrun.operator.scaling import PoolScaling
from agentrun.operator.tenancy import Tenancy, load_tenancy


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1)
    namespace: str = Field("default", min_length=1)
    deployment: str = Field(min_length=1)
    runs_per_worker: int = Field(4, alias="runsPerWorker", ge=1)
    min_replicas: int = Field(0, alias="minReplicas", ge=0)
    max_replicas: int = Field(10, alias="maxReplicas", ge=0)
    scale_down_delay: float = Field(300.0, alias="scaleDownDelaySeconds", ge=0)
    spare_slots: int = Field(0, alias="spareSlots", ge=0)


class PoolsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pools: list[PoolConfig] = Field(default_factory=list)


def load_pools(path: str | Path) -> list[PoolScaling]:
    """Read the pools file; every error names the file and the field."""
    parsed = read_model(path, PoolsFile, "the pools file")
    pools = []
    seen: set[str] = set()
    for p in parsed.pools:
        if p.name in seen:
            raise ConfigError(f"{path}: pool {p.name!r} is listed twice")
        seen.add(p.name)
        try:
            pools.append(
                PoolScaling(
                    pool=p.name,
                    deployment=p.deployment,
                    namespace=p.namespace,
                    runs_per_worker=p.runs_per_worker,
                    min_replicas=p.min_replicas,
                    max_replicas=p.max_replicas,
                    scale_down_delay=p.scale_down_delay,
                    spare_slots=p.spare_slots,
                )
            )
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return pools


@dataclass(frozen=True)
class OperatorSettings:
    database_url: str
    pools: list[PoolScaling] = field(default_factory=list)
    #: Namespaces to watch; empty: all (cluster-wide).
    namespaces: list[str] = field(default_factory=list)
    migrate: bool = True
    #: How often every live run is re-read (step counts are not notified per step).
    resync_interval: float = 10.0
    #: How long notifications are gathered before the status patches go out (coalescing).
    flush_interval: float = 0.2
    #: Status patches per second at most, over all objects (protects the API server).
    max_patches_per_second: float = 50.0
    #: Scaling re-check interval (a new pending run scales at once, by notification). The
    #: operator's tick runs at the shorter of this and resync_interval, and costs ONE query
    #: when idle: 10 s, so an idle operator stays at 6 queries a minute.
    scale_interval: float = 10.0
    #: How often the run counts behind agentrun_runs are recounted when nothing was notified and
    #: no tick saw a change (a change recounts at the next tick).
    metrics_interval: float = 300.0
    metrics_port: int | None = 9090
    health_port: int | None = 8080
    #: Where the health port listens.
    health_host: str = "0.0.0.0"
    #: How often /readyz's two checks (the API server, the database) run; each must have
    #: passed within 2 intervals + db_timeout for the operator to be Ready (the database's
    #: within its tick + an interval + db_timeout when the tick is longer). The database check
    #: sends no query while another loop's query answered within a tick + db_timeout.
    health_interval: float = 5.0
    db_timeout: float = 5.0
    #: How often an AgentRun whose Agent does not exist yet is retried.
    agent_retry_delay: float = 15.0
    #: Where the worker pods run (the chart: its release namespace); lets the operator say why
    #: a dead-lettered run's workers died (OOMKilled). None: not looked up.
    worker_namespace: str | None = None
    #: Which namespaces may use which pools, and the quotas (AGENTRUN_TENANCY_FILE,
    #: agentrun.operator.tenancy). Default: every pool admits every namespace, no quotas managed.
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: Act on the agentrun.dev/approve and /reject annotations. They are unauthenticated (anyone
    #: who may patch an AgentRun decides, and the name recorded is the object's): False refuses
    #: them, so only AgentRunApproval objects decide (docs/operator.md).
    approval_annotations: bool = True

    @classmethod
    def from_env(cls, database_url: str) -> OperatorSettings:
        pools_file = os.environ.get("AGENTRUN_POOLS_FILE", "")
        tenancy_file = os.environ.get("AGENTRUN_TENANCY_FILE", "")
        return cls(
            database_url=database_url,
            pools=load_pools(pools_file) if pools_file else [],
            namespaces=[
                n.strip()
                for n in os.environ.get("AGENTRUN_WATCH_NAMESPACES", "").split(",")
                if n.strip()
            ],
            migrate=_env_bool("AGENTRUN_MIGRATE"),
            resync_interval=_positive("AGENTRUN_RESYNC_INTERVAL", cls.resync_interval),
            flush_interval=_positive("AGENTRUN_STATUS_FLUSH_INTERVAL", cls.flush_interval,
                                     zero=True),
            max_patches_per_second=_positive("AGENTRUN_MAX_PATCHES_PER_SECOND",
                                             cls.max_patches_per_second, unit="a second"),
            scale_interval=_positive("AGENTRUN_SCALE_INTERVAL", cls.scale_interval),
            metrics_interval=_positive("AGENTRUN_METRICS_INTERVAL", cls.metrics_interval),
            metrics_port=_port(env_int("AGENTRUN_METRICS_PORT", 9090)),
            health_port=_port(env_int("AGENTRUN_HEALTH_PORT", 8080)),
            health_interval=_positive("AGENTRUN_HEALTH_INTERVAL", cls.health_interval),
            agent_retry_delay=_positive("AGENTRUN_AGENT_RETRY_DELAY", cls.agent_retry_delay),
            worker_namespace=os.environ.get("AGENTRUN_WORKER_NAMESPACE") or None,
            tenancy=load_tenancy(tenancy_file) if tenancy_file else Tenancy(),
            approval_annotations=_env_bool("AGENTRUN_APPROVAL_ANNOTATIONS"),
        )


def _env_bool(name: str, default: bool = True) -> bool:
    """A true/false setting; anything else is a one-line error naming it."""
    value = os.environ.get(name, "true" if default else "false").strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"{name} must be true or false, not {value!r}")
    return value in ("true", "1", "yes")


def _positive(name: str, default: float, *, zero: bool = False, unit: str = "seconds") -> float:
    """A finite number above 0 (or 0 too, with ``zero``), else a one-line error naming it: 0
    made the readiness probe a busy loop and the patch rate a division by zero, a negative rate
    spun for ever, NaN passed every comparison."""
    value = env_float(name, default)
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        least = "0 or more" if zero else "more than 0"
        raise ConfigError(f"{name} {value:g}: must be {least} ({unit}; default {default:g})")
    return value


def _port(value: int) -> int | None:
    return None if value < 0 else value
