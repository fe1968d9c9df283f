"""The run configuration: the schema (every knob with its one default), reading and checking a
config file, and rebuilding the snapshot a run stored in the ledger.

Code outside this package imports from here: `from refill.config import RunConfig, load_config`.
The modules, each one job: `schema` (the sections and `RunConfig`), `loading` (YAML, `${VAR}`
expansion, validation, `from_snapshot`), `checks` (cross-field and run-time checks), `hints`
(pydantic errors worded as problems), `warnings`, `urls` (URLs in effect, redaction), `errors`.
"""

from __future__ import annotations

from refill.config.errors import ConfigError, ConfigFileError, Problem
from refill.config.loading import config_from_dict, from_snapshot, load_config, read_yaml
from refill.config.schema import SECTIONS, InfraConfig, RunConfig
from refill.config.urls import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    EMBEDDED_BROKER_URL,
    is_embedded,
    redact_url,
    resolved_urls,
    url_has_password,
)

__all__ = [
    "BROKER_URL_ENV",
    "DATABASE_URL_ENV",
    "EMBEDDED_BROKER_URL",
    "SECTIONS",
    "ConfigError",
    "ConfigFileError",
    "InfraConfig",
    "Problem",
    "RunConfig",
    "config_from_dict",
    "from_snapshot",
    "is_embedded",
    "load_config",
    "read_yaml",
    "redact_url",
    "resolved_urls",
    "url_has_password",
]
