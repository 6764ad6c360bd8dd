"""The LICENSE file is the license pyproject declares, and the package ships it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text Apache-2.0 names.
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def test_the_license_file_is_the_apache_2_text_pyproject_declares() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_MD5
    meta = importlib.metadata.metadata("agentrun")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
