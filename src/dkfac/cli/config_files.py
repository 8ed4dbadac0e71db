"""Reading a file of ``dkfac train`` options (``--config``): TOML or YAML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dkfac.cli.config import ConfigError


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file of options."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = file.read_text()
    if file.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - exercised on Python 3.10 only
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path}: invalid TOML ({error})") from None
    elif file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"--config {path}: YAML needs PyYAML (pip install 'dkfac[cli]')"
            ) from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"--config {path}: invalid YAML ({error})") from None
    else:
        raise ConfigError(f"--config {path}: expected a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a table of options at the top level")
    return {str(key).replace("-", "_"): value for key, value in data.items()}
