"""Docs as tests: every kubectl and helm command written in README.md, docs/, the chart's README and
its NOTES.txt is run against a real API server, the way a user types it: through bash, in the
documented order, with kubectl's discovery cache fresh for every command, and each command naming
an AgentRun run again with every name of the kind (singular, plural, short).

What is substituted, and only that: the namespace and release the docs call ``agentrun`` (the
test's own, so a cluster of yours is not touched), the placeholders (``REGISTRY``, ``NAME``,
``WAIT``/``<wait>``, ``run.yaml``) and ``--timeout=1h``. A documented command that no test runs
fails :func:`test_every_documented_command_is_run_or_said_why_not`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentrun.store import Store
from agentrun.waits import WaitRef
from tests.helmtools import helm, kubectl
from tests.kubekit import Operators, eventually
from tests.realkube import CHART, ROOT, Kube, apply_crds
from tests.workerkit import wait_run

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), CHART / "README.md"]
NOTES = "NOTES.txt"  # rendered by `helm install`, read back with `helm get notes`

#: Documented commands not run here, each with the reason. Kept exact: a new command must be
#: run, or added here with its reason.
NOT_RUN = {
    "helm test agentrun -n agentrun": "its test pod needs a node (the control plane runs none)",
}

#: Inline code that names a command in prose without being one to type as is.
PROSE = {
    "kubectl apply -f -": "docs/benchmarks.md describes what the benchmark runs",
    "kubectl auth can-i": "docs/helm.md says how the tests check RBAC",
    "kubectl create token": "docs/helm.md says what a cluster must support",
    "helm lint --strict": "prose: the ci/ values files are linted by tests/test_chart.py",
    "helm lint --strict -f ci/default-values.yaml": "run by tests/test_chart.py (every ci file)",
    "kubectl annotate ... -n NAMESPACE": "docs/operator.md quotes the Event's advice",
}

#: kubectl verbs whose first argument is a kind (or KIND/NAME).
RESOURCE_VERBS = {"get", "describe", "annotate", "delete", "patch", "wait", "edit", "label"}
FORMS = ("agentrun", "agentruns", "ar")


@dataclass(frozen=True)
class DocCommand:
    where: str
    text: str


def _blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            yield start, body
        i += 1


def commands_in(path: Path, text: str | None = None) -> list[DocCommand]:
    """The kubectl and helm commands of a document: ``$ ``-lines of its code blocks (with
    their indented continuation lines), plain kubectl/helm lines of other code blocks, lines of
    NOTES.txt, and inline code that is a whole command."""
    text = path.read_text() if text is None else text
    name = path.name if path.name == NOTES else str(path.relative_to(ROOT))
    out: list[DocCommand] = []
    if path.name == NOTES:
        for n, line in enumerate(text.splitlines(), 1):
            if re.match(r"\s*(kubectl|helm) ", line):
                out.append(DocCommand(f"{name}:{n}", line.strip()))
        return out
    for start, body in _blocks(text):
        current: list[str] | None = None
        at = 0
        for n, line in enumerate(body, start + 1):
            if line.startswith("$ "):
                if current:
                    out.append(DocCommand(f"{name}:{at}", "\n".join(current)))
                current = [line[2:]] if re.match(r"\$ (kubectl|helm) ", line) else None
                at = n
            elif current is not None and line.startswith((" ", "\t")):
                current.append(line)
            else:
                if current:
                    out.append(DocCommand(f"{name}:{at}", "\n".join(current)))
                current = None
                if re.match(r"(kubectl|helm) ", line):
                    out.append(DocCommand(f"{name}:{n}", line))
        if current:
            out.append(DocCommand(f"{name}:{at}", "\n".join(current)))
    in_block = {c.text.split("#")[0].strip() for c in out}
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("$ ", "```")):
            continue
        for span in re.findall(r"`((?:kubectl|helm) [^`]+)`", line):
            if len(span.split()) >= 3 and span not in in_block:
                out.append(DocCommand(f"{name}:{n}", span))
    return out


def strip_comment(cmd: str) -> str:
    """A trailing ``# comment`` (outside quotes) of each line."""
    lines = []
    for line in cmd.splitlines():
        quote = None
        for i, ch in enumerate(line):
            if ch in "'\"" and quote in (None, ch):
                quote = None if quote == ch else ch
            elif ch == "#" and quote is None and (i == 0 or line[i - 1] == " "):
                line = line[:i]
                break
        lines.append(line.rstrip())
    return "\n".join(lines).strip()


def variants(cmd: str) -> list[str]:
    """The command with each name of AgentRun, when the kind is what it acts on (the first
    argument after the verb: ``get agentrun NAME``, ``wait ... agentrun/NAME``)."""
    tokens = cmd.split(" ")
    if tokens[0] != "kubectl":
        return [cmd]
    verb_at = next((i for i, t in enumerate(tokens) if t in RESOURCE_VERBS), None)
    if verb_at is None:
        return [cmd]
    i = verb_at + 1
    while i < len(tokens):
        t = tokens[i]
        if t in ("-n", "--namespace", "-o", "-l", "--type", "-p"):
            i += 2
            continue
        if t.startswith("-") or not t:
            i += 1
            continue
        kind, slash, rest = t.partition("/")
        if kind in FORMS:
            return [" ".join([*tokens[:i], form + slash + rest, *tokens[i + 1:]])
                    for form in FORMS]
        return [cmd]
    return [cmd]


@dataclass
class DocShell:
    """bash with ``kubectl`` and ``helm`` on PATH as the real binaries, bound to a cluster and
    a namespace of the test's own, each kubectl call with a fresh discovery cache."""

    admin: Kube
    namespace: str
    release: str
    home: Path
    subs: dict[str, str] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = yaml.safe_load(self.admin.kubeconfig.read_text())
        for ctx in cfg["contexts"]:
            ctx["context"]["namespace"] = self.namespace
        (self.home / "kubeconfig").write_text(yaml.safe_dump(cfg))
        bin_dir = self.home / "bin"
        bin_dir.mkdir()
        (bin_dir / "kubectl").write_text(
            "#!/bin/sh\ncache=$(mktemp -d)\n"
            f'"{kubectl()}" --cache-dir "$cache" "$@"; rc=$?\nrm -rf "$cache"\nexit $rc\n')
        (bin_dir / "helm").write_text(f'#!/bin/sh\nexec "{helm()}" "$@"\n')
        for b in ("kubectl", "helm"):
            (bin_dir / b).chmod(0o755)
        work = self.home / "work"
        work.mkdir()
        for linked in ("examples", "charts"):
            (work / linked).symlink_to(ROOT / linked)
        (work / "run.yaml").write_text((ROOT / "examples" / "migrate-orders.yaml").read_text())
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "KUBECONFIG": str(self.home / "kubeconfig"),
            "HELM_CACHE_HOME": str(self.home / "helm-cache"),
            "HELM_CONFIG_HOME": str(self.home / "helm-config"),
            "HELM_DATA_HOME": str(self.home / "helm-data"),
            "ANTHROPIC_API_KEY": "sk-docs-test",
        }

    def localise(self, cmd: str) -> str:
        ns, rel = self.namespace, self.release
        cmd = strip_comment(cmd)
        cmd = re.sub(r"(-n|--namespace|namespace) agentrun\b(?![-.])", rf"\1 {ns}", cmd)
        cmd = re.sub(r"\bhelm (install|test|uninstall|upgrade) agentrun\b(?![-.])",
                     rf"helm \1 {rel}", cmd)
        cmd = cmd.replace("REGISTRY/", "localhost/").replace("--timeout=1h", "--timeout=60s")
        for placeholder, value in self.subs.items():
            cmd = re.sub(rf"(?<![\w-]){re.escape(placeholder)}(?![\w-])", value, cmd)
        return cmd

    def run(self, cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=self.home / "work",
                              env=self.env, capture_output=True, text=True, timeout=180)
        self.ran.append(cmd)
        if check:
            assert proc.returncode == 0, f"{cmd}\n-> exit {proc.returncode}: {proc.stderr}"
        return proc


@dataclass
class Scenario:
    shell: DocShell
    kube: Kube
    store: Store
    #: Called before a command whose text matches the key (a regex): puts the run in the state
    #: the command is about.
    before: dict[str, Callable[[], Any]] = field(default_factory=dict)

    async def run_all(self, docs: list[DocCommand]) -> None:
        for doc in docs:
            text = strip_comment(doc.text)
            if text in NOT_RUN or text in PROSE:
                continue
            for variant in variants(text):
                # Hooks see the documented text (placeholders unfilled) and may set them.
                for pattern, hook in self.before.items():
                    if re.search(pattern, variant):
                        await hook()
                cmd = self.shell.localise(variant)
                self.shell.run(cmd)
                await self._settle(cmd)

    async def _settle(self, cmd: str) -> None:
        """After an annotation the operator acts on: wait until it has consumed it (it removes
        the annotation), as a user would before setting it again."""
        m = re.search(r"annotate \S+ (\S+) (agentrun\.dev/(?:cancel|approve|reject))=", cmd)
        if not m:
            return
        name, key = m.group(1), m.group(2)
        await eventually(
            lambda: key not in (((self.kube.agentrun(name) or {}).get("metadata") or {})
                                .get("annotations") or {}),
            30, f"the operator to act on {key} of {name}")


@pytest.fixture
def shell(admin_kube: Kube, tmp_path: Path) -> Iterator[DocShell]:
    ns = f"agentrun-t-{uuid.uuid4().hex[:8]}"  # created by the docs' own commands
    sh = DocShell(admin_kube, ns, f"agentrun-t{uuid.uuid4().hex[:6]}", tmp_path)
    try:
        yield sh
    finally:
        sh.run(f"helm uninstall {sh.release} -n {ns} --wait=false || true", check=False)
        admin_kube.request("DELETE", f"/api/v1/namespaces/{ns}")


def start_operator(shell: DocShell, database_url: str, tmp: Path) -> Operators:
    """The operator the docs' install would run, here as a local process watching the
    namespace (with the admin's credentials: RBAC is tests/test_k8s_helm.py's subject)."""
    kc = tmp / "operator-kubeconfig"
    kc.write_text((shell.home / "kubeconfig").read_text())

    class _Kc:
        def kubeconfig(self, directory: Path) -> Path:
            return kc

    ops = Operators(_Kc(), database_url, tmp)  # type: ignore[arg-type]
    ops.start(env={"AGENTRUN_WATCH_NAMESPACES": shell.namespace})
    return ops


def docs_of(path: Path) -> list[DocCommand]:
    return commands_in(path)


async def _waiting_run(shell: DocShell, kube: Kube, store: Store, name: str) -> str:
    """Make the run of ``name`` wait for approval, as a worker would at an irreversible call,
    and return the wait a decision names (``<seq>.<call>``). A run that is not waiting
    (cancelled by the command before, or decided) is replaced: its AgentRun deleted and applied
    again."""
    def run_id() -> Any:
        return ((kube.agentrun(name) or {}).get("status") or {}).get("runId")

    run = await store.get_run(await eventually(run_id, 30, f"{name}'s run"))
    if run.status == "waiting_approval" and run.pending_call:
        return str(WaitRef.of(run.pending_call))
    assert kube.delete_agentrun(name) == 200
    shell.run("kubectl apply -f examples/migrate-orders.yaml")
    run = await store.get_run(await eventually(
        lambda: (rid := run_id()) and rid != str(run.id) and rid, 30, f"{name}'s new run"))
    claimed = (await store.with_lease_ttl(300).claim(run.pool, "docs-worker")).claimed
    [lease] = [lease for _, lease in claimed if lease.run_id == run.id]
    seq = run.next_seq
    call = {"seq": seq, "call_index": 0, "tool": "write_production",
            "input": {"statement": "ALTER TABLE orders ADD COLUMN region text"},
            "stage": "before_call"}
    await store.wait_for_approval(lease, f"approval required before write_production "
                                         f"(step {seq})", call)
    await eventually(lambda: ((kube.agentrun(name) or {}).get("status") or {}).get(
        "pendingApproval"), 30, "pendingApproval mirrored")
    return str(WaitRef.of(call))


async def test_readme_install_and_first_run(
    shell: DocShell, admin_kube: Kube, store: Store, database_url: str, tmp_path: Path
) -> None:
    docs = docs_of(ROOT / "README.md")
    kube = admin_kube.for_namespace(shell.namespace)
    ops: Operators | None = None

    async def operator() -> None:
        nonlocal ops
        if ops is None:
            ops = start_operator(shell, database_url, tmp_path)

    async def make_it_wait() -> None:
        shell.subs["WAIT"] = await _waiting_run(shell, kube, store, "migrate-orders")

    scenario = Scenario(shell, kube, store, before={
        r"^kubectl apply -f examples/": operator,
        r"agentrun\.dev/approve=WAIT": make_it_wait,
        r"agentrun\.dev/reject=WAIT": make_it_wait,
        r"pendingApproval": make_it_wait,
    })
    try:
        install = [d for d in docs if "helm upgrade" not in d.text and "helm uninstall" not in
                   d.text]
        await scenario.run_all(install)
        # The install did what it says: the release's operator and pools exist, the run too.
        assert kube.deployment(f"{shell.release}-operator") is not None
        assert kube.deployment(f"{shell.release}-worker-default") is not None
        approved = await store.get_approval(
            (await store.get_run(kube.agentrun("migrate-orders")["status"]["runId"])).id,  # type: ignore[index]
            WaitRef.parse(shell.subs["WAIT"], "WAIT").seq, 0, "before_call")
        assert approved is not None and approved.decision in ("approved", "rejected")
        # The release's NOTES.txt, as helm prints it after the install.
        notes = shell.run(f"helm get notes {shell.release} -n {shell.namespace}").stdout
        note_cmds = commands_in(Path(NOTES), notes)
        assert any("annotate agentrun" in c.text for c in note_cmds)
        for c in note_cmds:
            if re.match(r"helm test ", c.text):  # NOT_RUN: its pod needs a node
                continue
            await scenario.run_all([DocCommand(c.where, c.text.replace("<wait>", "WAIT"))])
        # Upgrade and uninstall, as the README's prose gives them.
        await scenario.run_all([d for d in docs if "helm upgrade" in d.text])
        await scenario.run_all([d for d in docs if "helm uninstall" in d.text])
        assert kube.agentrun("migrate-orders") is not None  # AgentRuns survive the uninstall
    finally:
        if ops is not None:
            ops.stop_all()


async def test_chart_readme_install(shell: DocShell, admin_kube: Kube, store: Store) -> None:
    await Scenario(shell, admin_kube.for_namespace(shell.namespace), store).run_all(
        docs_of(CHART / "README.md"))
    assert admin_kube.for_namespace(shell.namespace).deployment(
        f"{shell.release}-operator") is not None


async def test_operator_doc(
    shell: DocShell, admin_kube: Kube, store: Store, database_url: str, tmp_path: Path
) -> None:
    shell.run(f"kubectl create namespace {shell.namespace}")
    kube = admin_kube.for_namespace(shell.namespace)
    ops = start_operator(shell, database_url, tmp_path)

    async def succeed() -> None:
        rid = await eventually(lambda: ((kube.agentrun("migrate-orders") or {}).get("status")
                                        or {}).get("runId"), 30, "the run")
        run = await store.get_run(rid)
        if not run.finished:
            claimed = (await store.with_lease_ttl(60).claim(run.pool, "docs-worker")).claimed
            [lease] = [lease for _, lease in claimed if lease.run_id == run.id]
            await store.finish(lease, "succeeded", result="migrated")
        await wait_run(store, run.id, lambda r: r.status == "succeeded", 10)

    try:
        await Scenario(shell, kube, store, before={r"condition=Ready": succeed}).run_all(
            docs_of(ROOT / "docs" / "operator.md"))
    finally:
        ops.stop_all()


async def test_helm_doc_steering_and_uninstall(
    shell: DocShell, admin_kube: Kube, store: Store, database_url: str, tmp_path: Path
) -> None:
    if os.environ.get("AGENTRUN_TEST_KUBECONFIG"):
        pytest.skip("deletes the CRDs and patches AgentRuns in every namespace: only on a "
                    "control plane of the test session's own")
    docs = docs_of(ROOT / "docs" / "helm.md")
    shell.run(f"kubectl create namespace {shell.namespace}")
    shell.run(f"kubectl -n {shell.namespace} create secret generic agentrun-db "
              "--from-literal=url=postgresql://u@h/d")
    shell.run(f"kubectl -n {shell.namespace} create secret generic anthropic "
              "--from-literal=api-key=x")
    shell.run(f"helm install {shell.release} charts/agentrun -n {shell.namespace} "
              "--set database.existingSecret=agentrun-db --set anthropic.existingSecret=anthropic")
    kube = admin_kube.for_namespace(shell.namespace)
    ops = start_operator(shell, database_url, tmp_path)
    shell.subs["NAME"] = "migrate-orders"

    async def make_it_wait() -> None:
        shell.subs["WAIT"] = await _waiting_run(shell, kube, store, "migrate-orders")

    async def recreate() -> None:  # `kubectl delete agentrun NAME` ran before: apply it again
        if kube.agentrun("migrate-orders") is None:
            shell.run("kubectl apply -f run.yaml")

    async def stop_operator() -> None:
        ops.stop_all()

    steering = [d for d in docs if "uninstall" not in d.text and "delete crd" not in d.text
                and "delete namespace" not in d.text and "finalizers" not in d.text
                and "-A" not in d.text]
    removal = [d for d in docs if d not in steering]
    try:
        await Scenario(shell, kube, store, before={
            r"approve=WAIT|reject=WAIT": make_it_wait,
            r"(annotate|describe|delete|get) (agentruns?|ar) NAME": recreate,
        }).run_all(steering)
        await stop_operator()
        # An AgentRun with the finalizer of earlier versions, for the documented removal loop.
        legacy = yaml.safe_load_all((ROOT / "examples" / "migrate-orders.yaml").read_text())
        run_doc = next(d for d in legacy if d["kind"] == "AgentRun")
        run_doc["metadata"] = {"name": "legacy", "finalizers": ["agentrun.dev/finalizer"]}
        kube.apply_agentrun(run_doc)
        finalizer_loop = [d for d in removal if "finalizers" in d.text]
        assert finalizer_loop, "docs/helm.md's finalizer removal is documented"
        await Scenario(shell, kube, store).run_all(finalizer_loop)
        assert not (kube.agentrun("legacy") or {})["metadata"].get("finalizers")
        await Scenario(shell, kube, store).run_all([d for d in removal if d not in finalizer_loop])
        shell.run(f"kubectl wait --for=delete namespace/{shell.namespace} --timeout=60s")
    finally:
        ops.stop_all()
        apply_crds(admin_kube)  # the session's other tests need them back


def test_every_documented_command_is_run_or_said_why_not() -> None:
    """Each command found in the docs is one the scenarios above run (by the document they
    read), or is in NOT_RUN / PROSE with its reason."""
    found = {strip_comment(c.text) for path in DOCS for c in commands_in(path)}
    scenario_docs = {ROOT / "README.md", ROOT / "docs" / "operator.md", ROOT / "docs" / "helm.md",
                     CHART / "README.md"}
    covered = {strip_comment(c.text) for path in scenario_docs for c in commands_in(path)}
    loose = sorted(found - covered - set(PROSE))
    assert not loose, f"documented commands no test runs: {json.dumps(loose, indent=1)}"
    assert not set(PROSE) - found, "PROSE lists commands the docs no longer have"
    assert "kubectl get agentruns" in covered
