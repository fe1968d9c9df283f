"""The run configuration: the pydantic schema, the one default of every knob, and its loading.

Code outside this package imports from here: `from refill.config import RunConfig, load_config`.
"""

from __future__ import annotations

from refill.config.schema import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    EMBEDDED_BROKER_URL,
    ConfigError,
    ConfigFileError,
    Problem,
    RunConfig,
    config_from_dict,
    is_embedded,
    load_config,
    redact_url,
    resolved_urls,
    url_has_password,
)

__all__ = [
    "BROKER_URL_ENV",
    "DATABASE_URL_ENV",
    "EMBEDDED_BROKER_URL",
    "ConfigError",
    "ConfigFileError",
    "Problem",
    "RunConfig",
    "config_from_dict",
    "is_embedded",
    "load_config",
    "redact_url",
    "resolved_urls",
    "url_has_password",
]
