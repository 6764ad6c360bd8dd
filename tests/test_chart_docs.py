"""The chart's values reference is generated from values.yaml (helm-docs style, in Python):
README.md's values table and values.schema.json are what `python -m agentrun.chartdocs` makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agentrun import chartdocs

CHART = Path(__file__).resolve().parent.parent / "charts" / "agentrun"
REGENERATE = "python -m agentrun.chartdocs charts/agentrun"


@pytest.mark.parametrize("name", ["values.schema.json", "README.md"])
def test_the_generated_chart_files_are_in_sync(name: str) -> None:
    rendered = chartdocs.render(CHART)[CHART / name]
    assert (CHART / name).read_text(encoding="utf-8") == rendered, (
        f"charts/agentrun/{name} is stale (edit values.yaml or values.schema.overlay.yaml, "
        f"not it); regenerate it:\n    {REGENERATE}"
    )


def test_every_values_comment_is_a_schema_description() -> None:
    values_yaml = (CHART / "values.yaml").read_text(encoding="utf-8")
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    for path, text in chartdocs.descriptions(values_yaml).items():
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        assert node["description"] == text, path


def test_descriptions_follow_the_key_they_stand_above() -> None:
    text = (
        "# -- top\na:\n  # -- nested, on\n  # two lines\n  b: 1\n  c: 2\n"
        "list:\n  - name: x\n    # -- item key\n    d: 3\n"
    )
    assert chartdocs.descriptions(text) == {
        "a": "top", "a.b": "nested, on two lines", "list[].d": "item key",
    }  # fmt: skip


def test_the_overlay_constrains_only_keys_values_yaml_has() -> None:
    """An overlay path must name a key of values.yaml (or one the chart reads beyond its
    defaults: Helm's `global`, a container's `resources.claims`), so a renamed key cannot leave
    its old constraints behind."""
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    overlay = yaml.safe_load((CHART / chartdocs.OVERLAY).read_text(encoding="utf-8"))
    beyond = {"global"}
    for path in overlay:
        if path.startswith("x-") or path == "" or path in beyond or path.endswith("claims"):
            continue
        node = values
        for part in path.split("."):
            key = part.removesuffix("[]")
            assert isinstance(node, dict) and key in node, f"overlay names {path!r}, not in values"
            node = node[key]
            if part.endswith("[]"):
                node = node[0] if node else {}
