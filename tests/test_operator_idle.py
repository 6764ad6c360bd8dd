"""An idle operator's database load (issue 17): ONE statement per tick (every pool's depth and a
fingerprint of the live runs and quotas); the full resync and the agentrun_runs recount only
after a change; the readiness check sends no query while a tick's just answered. Statements are
counted at the driver (every psycopg cursor execute), the loop driven a fixed number of ticks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import psycopg
import pytest

from agentrun.manifests import AgentSpec
from agentrun.operator.app import OperatorApp
from agentrun.operator.kube import Deployment, KubeApi, Pod
from agentrun.operator.metrics import OperatorMetrics
from agentrun.operator.scaling import PoolScaling
from agentrun.operator.settings import OperatorSettings
from agentrun.store import K8sRef, Store


class Kube:
    """The calls a pool's tick makes: its Deployment (at 0 replicas to start), no pods."""

    def __init__(self) -> None:
        self.replicas = 0

    async def get_deployment(self, namespace: str, name: str) -> Deployment:
        return Deployment(name=name, namespace=namespace, replicas=self.replicas,
                          annotations={}, pristine=False)

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.replicas = replicas

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[Pod]:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    sent: list[str] = []
    real = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(" ".join(str(query).split())[:60])
        return await real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute)
    yield sent


def gauge(app: OperatorApp, pool: str, status: str) -> float:
    return float(app.metrics.registry.get_sample_value(
        "agentrun_runs", {"pool": pool, "status": status}) or 0)


async def test_an_idle_tick_is_one_statement_and_a_change_is_read(
    store: Store, statements: list[str]
) -> None:
    settings = OperatorSettings(
        database_url=store.url,
        pools=[PoolScaling(pool="gpu", deployment="workers")],
        metrics_port=None, health_port=None, metrics_interval=3600.0,
    )
    kube = Kube()
    app = OperatorApp(settings, cast(KubeApi, kube), OperatorMetrics())
    app.store, app.db_up = store, True
    await app.tick_once(store)  # the first tick resyncs and recounts: nothing seen yet
    assert len(statements) > 1

    for _ in range(5):
        statements.clear()
        await app.tick_once(store)
        assert len(statements) == 1, statements
        # The tick's answer proved the database: the readiness check does not ask again.
        await app._check_db()
        assert len(statements) == 1, statements
        assert app.readiness.database.error is None

    # A change nobody notified (a new run; step progress alike) moves the fingerprint: the
    # next tick reads the runs and recounts, the one after is idle again.
    run, _ = await store.create_run("t", AgentSpec(model="m", pool="gpu"), pool="gpu",
                                    k8s=K8sRef("default", "a", "u-1"))
    statements.clear()
    await app.tick_once(store)
    assert len(statements) > 1
    assert gauge(app, "gpu", "pending") == 1
    assert kube.replicas == 1  # the tick's depth scaled the pool
    statements.clear()
    await app.tick_once(store)
    assert len(statements) == 1, statements
    await store.cancel(run.id)
    statements.clear()
    await app.tick_once(store)
    assert len(statements) > 1
    assert gauge(app, "gpu", "cancelled") == 1
