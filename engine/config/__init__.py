"""One settings struct, read from ``deferral.toml`` and ``DEFERRAL_*`` environment variables.

Precedence, lowest first: defaults below, the ``[deferral]`` table of the settings file
(``--config PATH`` or ``DEFERRAL_CONFIG``; else ``./deferral.toml``, else ``deferral.toml`` in
the home folder, ``DEFERRAL_HOME``), environment variables (``DEFERRAL_WORKER_SLOTS=8``), then
command-line flags. :func:`load` also says where each value came from.

The table is :mod:`engine.config.settings`: each field's ``#:`` comment is its
documentation, docs/reference/settings.md is generated from them (``python
tools/gen_settings_reference.py``; tests/test_docs.py keeps the two equal). Reading the
settings is :mod:`engine.config.loading`'s, the database URL's checks are
:mod:`engine.config.urls`'. ``engine.config`` is the import path of every public name.
"""

from engine.config.loading import (
    CONFIG_FILE_NAME,
    DEFAULT_SOURCE,
    Loaded,
    config_file,
    key_line,
    load,
    load_settings,
    register_setting_secrets,
)
from engine.config.settings import (
    DEFAULT_BLOCKED_LOOP_S,
    DEFAULT_CALLBACK_TIMEOUT_S,
    DEFAULT_CLAIM_BATCH,
    DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S,
    DEFAULT_DAG_RESCAN_INTERVAL_S,
    DEFAULT_HOME,
    DEFAULT_LOG_BUFFER_BYTES,
    DEFAULT_LOG_MAX_LINE_BYTES,
    DEFAULT_LOG_MAX_LINES_PER_S,
    DEFAULT_LOG_MAX_TOTAL_BYTES,
    DEFAULT_LOG_RETENTION_DAYS,
    DEFAULT_MAX_MAP_LENGTH,
    DEFAULT_METRICS_MAX_SERIES,
    DEFAULT_OUTCOME_LINGER_S,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_TRIGGERER_CAPACITY,
    DEFAULT_TRIGGERER_LEASE_S,
    DEFAULT_TRIGGERER_MAX_BLOCK_S,
    DEFAULT_WORKER_SLOTS,
    DEFAULT_XCOM_MAX_BYTES,
    SECRET_SETTINGS,
    STANDALONE_METRICS_PORT,
    ConfigError,
    Settings,
)
from engine.config.urls import DATABASE_URL_SCHEMES
from engine.masking import masked_url

__all__ = [
    "CONFIG_FILE_NAME",
    "DATABASE_URL_SCHEMES",
    "DEFAULT_BLOCKED_LOOP_S",
    "DEFAULT_CALLBACK_TIMEOUT_S",
    "DEFAULT_CLAIM_BATCH",
    "DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S",
    "DEFAULT_DAG_RESCAN_INTERVAL_S",
    "DEFAULT_HOME",
    "DEFAULT_LOG_BUFFER_BYTES",
    "DEFAULT_LOG_MAX_LINES_PER_S",
    "DEFAULT_LOG_MAX_LINE_BYTES",
    "DEFAULT_LOG_MAX_TOTAL_BYTES",
    "DEFAULT_LOG_RETENTION_DAYS",
    "DEFAULT_MAX_MAP_LENGTH",
    "DEFAULT_METRICS_MAX_SERIES",
    "DEFAULT_OUTCOME_LINGER_S",
    "DEFAULT_POLL_INTERVAL_S",
    "DEFAULT_SOURCE",
    "DEFAULT_TRIGGERER_CAPACITY",
    "DEFAULT_TRIGGERER_LEASE_S",
    "DEFAULT_TRIGGERER_MAX_BLOCK_S",
    "DEFAULT_WORKER_SLOTS",
    "DEFAULT_XCOM_MAX_BYTES",
    "SECRET_SETTINGS",
    "STANDALONE_METRICS_PORT",
    "ConfigError",
    "Loaded",
    "Settings",
    "config_file",
    "key_line",
    "load",
    "load_settings",
    "masked_url",
    "register_setting_secrets",
]
