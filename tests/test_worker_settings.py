"""One route per worker setting (issue 18): WorkerSettings.from_env owns each variable, and a
flag given on the command line only overrides it. --tools is one of them: the variable's list,
or the flags' list in its place (never the two concatenated)."""

from __future__ import annotations

import socket

import pytest

from agentrun.cli import build_parser, worker_settings
from agentrun.worker.settings import WorkerSettings


def settings_for(argv: list[str]) -> WorkerSettings:
    return worker_settings(build_parser().parse_args(["worker", *argv]))


def test_the_tools_come_from_the_variable_and_a_flag_replaces_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENTRUN_TOOLS", raising=False)
    assert WorkerSettings.from_env(prices=False).tools == ()
    assert settings_for([]).tools == ()

    monkeypatch.setenv("AGENTRUN_TOOLS", "agentrun.demo_tools,,tools/extra.py")
    assert WorkerSettings.from_env(prices=False).tools == ("agentrun.demo_tools", "tools/extra.py")
    assert settings_for([]).tools == ("agentrun.demo_tools", "tools/extra.py")
    assert settings_for(["--tools", "a", "--tools", "b.py"]).tools == ("a", "b.py")


def test_the_model_transport_comes_from_the_variable_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentrun.errors import ConfigError
    from agentrun.worker.settings import check_settings

    monkeypatch.delenv("AGENTRUN_MODEL_TRANSPORT", raising=False)
    assert settings_for([]).model_transport == "aiohttp"
    monkeypatch.setenv("AGENTRUN_MODEL_TRANSPORT", "httpx")
    assert settings_for([]).model_transport == "httpx"
    assert settings_for(["--model-transport", "aiohttp"]).model_transport == "aiohttp"
    with pytest.raises(ConfigError) as bad:
        check_settings(settings_for(["--model-transport", "curl"]))
    assert str(bad.value) == (
        "--model-transport 'curl' (AGENTRUN_MODEL_TRANSPORT): choose aiohttp or httpx (the "
        "first-party API's HTTP transport; default aiohttp)")


def test_a_workers_id_starts_with_its_pods_name_not_its_cut_hostname(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kubelet cuts a pod's hostname to 63 characters, and the chart's Deployment names
    reach 63 before the ReplicaSet's hash and the pod's suffix: every pod of such a pool had the
    same cut hostname in its workers' ids, matched no pod name, and the operator spared no busy
    pod at a scale-down (found by an adversarial review on 2026-12-06)."""
    pod = "customer-support-production-agentrun-worker-default-5d8f7c9b6d-x7k2p"
    monkeypatch.setenv("POD_NAME", pod)
    assert WorkerSettings().worker_id.startswith(pod + "-")
    assert WorkerSettings.from_env(prices=False).worker_id.startswith(pod + "-")
    monkeypatch.delenv("POD_NAME")
    assert WorkerSettings().worker_id.startswith(socket.gethostname() + "-")
