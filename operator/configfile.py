"""The operator's configuration files (pools, tenancy): YAML read into a pydantic model, every
error one line naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from agentrun.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_model(path: str | Path, model: type[M], what: str) -> M:
    """``path``'s YAML as ``model`` (an empty file: the model's defaults); ``what`` names the
    file in errors ("the pools file")."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        return model.model_validate(raw)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"{path}: {where}") from None
