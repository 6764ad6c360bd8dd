"""kubectl's names for our kinds, on a real API server with a fresh discovery cache: singular,
plural, short and fully qualified names each resolve to exactly one kind, and no category
shadows a name (a category spelt like a kind's singular made ``kubectl get agentrun NAME``
fail with "you must specify only one resource" and list Agents too)."""

from __future__ import annotations

import pytest

from tests.kubekit import agent_manifest, agentrun_manifest
from tests.realkube import Kube

AGENTRUN_FORMS = ["agentrun", "agentruns", "ar", "agentrun.agentrun.dev",
                  "agentruns.agentrun.dev", "AgentRun"]
AGENT_FORMS = ["agent", "agents", "agent.agentrun.dev", "Agent"]


@pytest.mark.parametrize("form", AGENTRUN_FORMS)
def test_every_name_of_agentrun_reaches_one_object(kube: Kube, form: str) -> None:
    kube.apply_yaml([agent_manifest("echoer"), agentrun_manifest("one")])
    got = kube.kubectl("get", form, "one", "-o", "name").stdout.split()
    assert got == ["agentrun.agentrun.dev/one"]
    listed = kube.kubectl("get", form, "-o", "name").stdout.split()
    assert listed == ["agentrun.agentrun.dev/one"], "only AgentRuns, no Agents"
    assert "Name:         one" in kube.kubectl("describe", form, "one").stdout
    kube.kubectl("annotate", form, "one", "example.com/note=x")
    assert kube.agentrun("one")["metadata"]["annotations"]["example.com/note"] == "x"  # type: ignore[index]
    kube.kubectl("delete", form, "one", "--wait=false")


@pytest.mark.parametrize("form", AGENT_FORMS)
def test_every_name_of_agent_reaches_one_object(kube: Kube, form: str) -> None:
    kube.apply_yaml([agent_manifest("echoer"), agentrun_manifest("one")])
    assert kube.kubectl("get", form, "-o", "name").stdout.split() == ["agent.agentrun.dev/echoer"]
    assert kube.kubectl("get", form, "echoer", "-o", "name").stdout.split() == [
        "agent.agentrun.dev/echoer"]


def test_the_category_lists_both_kinds_and_shadows_no_name(kube: Kube) -> None:
    kube.apply_yaml([agent_manifest("echoer"), agentrun_manifest("one")])
    got = sorted(kube.kubectl("get", "agentrun-all", "-o", "name").stdout.split())
    assert got == ["agent.agentrun.dev/echoer", "agentrun.agentrun.dev/one"]
    crd = kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/agentruns.agentrun.dev")
    assert crd is not None
    names = crd["spec"]["names"]
    spelled = {names["singular"], names["plural"], *names.get("shortNames", []),
               names["kind"].lower()}
    assert not spelled & set(names.get("categories", []))
