"""Encryption at rest: the keys that seal trigger kwargs, resume kwargs, events and results.

Values are Fernet tokens (AES-128-CBC and HMAC-SHA256, from ``cryptography``) behind a one-byte
marker, ``0xc1``: MessagePack never starts a value with that byte, so a stored value is either
plaintext MessagePack (written with no key, or before keys were configured) or a token, and
the two never look alike. Several keys may be configured: the first encrypts, all decrypt
(``MultiFernet``), which is how keys rotate (``deferral keys rotate``).

Where keys come from, first match wins: the ``fernet_key`` setting (comma-separated,
``DEFERRAL_FERNET_KEY``), the ``fernet_key_file`` setting (one key a line), then, on the
embedded database only, ``<home>/fernet.key``, created (mode 0600) on first use. With an
external database and no key the engine refuses to start unless ``insecure_dev`` is set.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from engine.config import ConfigError, Settings

__all__ = [
    "KEY_FILE_NAME",
    "Keyring",
    "MissingKeyError",
    "UnreadableValue",
    "child_key_env",
    "generate_key",
    "keyring_from_settings",
    "write_key_file",
]

log = logging.getLogger(__name__)

#: Name of the key file the embedded default creates in the deferral home.
KEY_FILE_NAME = "fernet.key"
#: Marks an encrypted value; 0xc1 is the one byte MessagePack never uses.
MARKER = b"\xc1"
_HOW_TO = "generate one with `deferral keys generate`"
_warned_insecure = False


class MissingKeyError(ConfigError):
    """No encryption key is configured where one is required."""


class UnreadableValue(ValueError):
    """A stored value is encrypted with a key that is not configured (or was tampered with)."""


def generate_key() -> str:
    """A new random Fernet key, as the text the settings take."""
    return Fernet.generate_key().decode()


def _parse_keys(text: str, source: str) -> list[bytes]:
    keys = [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]
    for i, key in enumerate(keys, 1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            # Never the key itself in a message: it may be a real key with one typo.
            raise ConfigError(
                f"{source}: key #{i} is not a Fernet key (32 url-safe base64-encoded bytes); "
                f"{_HOW_TO}"
            ) from None
    if not keys:
        raise ConfigError(f"{source} holds no key; {_HOW_TO}")
    return [k.encode() for k in keys]


class Keyring:
    """Encrypts and decrypts stored values; with no keys it stores plaintext (dev mode)."""

    def __init__(self, keys: Sequence[bytes | str] = (), *, source: str = "fernet_key") -> None:
        raw = [k.encode() if isinstance(k, str) else k for k in keys]
        self.source = source
        self._fernets = [Fernet(k) for k in raw]
        self._multi = MultiFernet(self._fernets) if self._fernets else None
        # The deduplication key is an HMAC under a key derived from the primary key (not the
        # key itself: one key, one purpose). It only has to be stable while identical triggers
        # wait, so a rotation that changes it costs sharing, not correctness.
        # (An HMAC object keyed once, copied for each value: keying a new one per deferral
        # cost more than hashing the value.)
        self._dedup_mac = (
            hmac.new(
                hmac.new(base64.urlsafe_b64decode(raw[0]), b"deferral dedup v1", "sha256").digest(),
                digestmod=hashlib.sha256,
            )
            if raw
            else None
        )

    @property
    def encrypts(self) -> bool:
        return self._multi is not None

    def encrypt(self, data: bytes) -> bytes:
        if self._multi is None:
            return data
        return MARKER + self._fernets[0].encrypt(data)

    def encrypt_opt(self, data: bytes | None) -> bytes | None:
        return None if data is None else self.encrypt(data)

    def decrypt(self, data: bytes) -> bytes:
        """Plaintext for a stored value (plaintext values pass through)."""
        if not data.startswith(MARKER):
            return data
        if self._multi is None:
            raise UnreadableValue(
                "a stored value is encrypted but no key is configured: set the setting "
                "fernet_key (DEFERRAL_FERNET_KEY) or fernet_key_file to the key it was written "
                "with"
            )
        try:
            return self._multi.decrypt(data[1:])
        except InvalidToken:
            raise UnreadableValue(
                f"a stored value is encrypted with a key not in {self.source}; add the key it "
                "was written with to the setting fernet_key (DEFERRAL_FERNET_KEY) or "
                "fernet_key_file (several keys, comma-separated: the first encrypts, all decrypt)"
            ) from None

    def decrypt_opt(self, data: bytes | None) -> bytes | None:
        return None if data is None else self.decrypt(data)

    def is_current(self, data: bytes) -> bool:
        """Whether a stored value is already encrypted with the primary key."""
        if self._multi is None:
            return not data.startswith(MARKER)
        if not data.startswith(MARKER):
            return False
        try:
            self._fernets[0].decrypt(data[1:])
        except InvalidToken:
            return False
        return True

    def reencrypt(self, data: bytes) -> bytes:
        """The value encrypted with the primary key (raises UnreadableValue if no key opens it)."""
        return self.encrypt(self.decrypt(data))

    def dedup_key(self, classpath: str, kwargs: bytes, unkeyed: str) -> str:
        """The key identical triggers share: keyed, so it reveals neither the kwargs nor their
        equality to anyone without the key. ``unkeyed`` (the contract's sha256) is used when
        there is no key."""
        if self._dedup_mac is None:
            return unkeyed
        mac = self._dedup_mac.copy()
        mac.update(classpath.encode() + b"\0" + kwargs)
        return "h1:" + mac.hexdigest()


def _read_key_file(path: Path, source: str) -> list[bytes]:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("key file %s can be read by other users; chmod 600 it", path)
    return _parse_keys(text, f"{source} ({path})")


def write_key_file(path: Path, key: str | None = None) -> bool:
    """Create a key file (mode 0600) holding ``key`` (a new one by default) unless it exists;
    returns whether it was created. Atomic: concurrent first uses agree on one key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fernet-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, ((key or generate_key()) + "\n").encode())
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def _default_key_file(settings: Settings) -> Path:
    return settings.home_path / KEY_FILE_NAME


def keyring_from_settings(settings: Settings) -> Keyring:
    """The keys the settings name; see the module docstring for the order. Raises
    MissingKeyError with an external database and no key unless ``insecure_dev``."""
    global _warned_insecure
    if settings.fernet_key:
        return Keyring(_parse_keys(settings.fernet_key, "setting fernet_key"))
    if settings.fernet_key_file:
        path = Path(settings.fernet_key_file).expanduser()
        return Keyring(_read_key_file(path, "setting fernet_key_file"), source=str(path))
    if not settings.database_url:
        path = _default_key_file(settings)
        if not path.exists() and write_key_file(path):
            log.info("created the encryption key file %s (mode 0600); back it up", path)
        return Keyring(_read_key_file(path, "key file"), source=str(path))
    if settings.insecure_dev:
        if not _warned_insecure:
            _warned_insecure = True
            log.warning(
                "insecure_dev: no encryption key; trigger kwargs, events and results are "
                "stored in plaintext. Never use this with real credentials."
            )
        return Keyring()
    raise MissingKeyError(
        "no encryption key: with an external database (DEFERRAL_DATABASE_URL) the setting "
        "fernet_key (DEFERRAL_FERNET_KEY) or fernet_key_file is required; "
        f"{_HOW_TO}, or pass --insecure-dev (setting insecure_dev) to store plaintext in "
        "development"
    )


def child_key_env(settings: Settings) -> dict[str, str]:
    """Environment a child process needs to use the same keys as this one, although it is
    handed the database URL (which, for it, makes the database external). The embedded
    default's key file is passed by its path, not its content."""
    if settings.fernet_key:
        return {"DEFERRAL_FERNET_KEY": settings.fernet_key}
    if settings.fernet_key_file:
        return {"DEFERRAL_FERNET_KEY_FILE": str(Path(settings.fernet_key_file).expanduser())}
    if not settings.database_url:
        # The child reads the file by this path: it is created here if this process has not
        # needed a key yet (a fresh home started a benchmark's children with no key file).
        path = _default_key_file(settings)
        if not path.exists() and write_key_file(path):
            log.info("created the encryption key file %s (mode 0600); back it up", path)
        return {"DEFERRAL_FERNET_KEY_FILE": str(path.resolve())}
    if settings.insecure_dev:
        return {"DEFERRAL_INSECURE_DEV": "true"}
    return {}
