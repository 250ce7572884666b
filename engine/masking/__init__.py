"""Secrets masking: the one function every place that shows a value uses.

The status page, the CLI (listings, ``show``, ``--json``, ``tasks test``), the stored task
and trigger log lines and the processes' own logs all show values through :func:`redact`
(any value: dicts, lists, JSON text, plain text) or :func:`redact_text` (one string). Three
rules, applied in this order:

1. **Registered secrets.** A value handed to :func:`register_secret` is replaced by ``***``
   wherever it appears, in any string, from then on (in this process). The engine registers
   the passwords of the ``DEFERRAL_CONN_*`` connection URLs, of the database URL (also the
   embedded server's), and the Fernet keys (:func:`register_environment`,
   :func:`register_url_password`). Values shorter than :data:`MIN_SECRET_CHARS`, and a few
   words a password is often set to in development (``postgres``), are not registered:
   masking them everywhere would garble every line.
2. **Sensitive key names.** The value under a key named like a secret is masked whole, at any
   depth: ``password``, ``passwd``, ``pwd``, ``secret``, ``token``, ``api_key``,
   ``access_token``, ``private_key``, ``authorization``, ``credentials``, ``cookie``,
   ``x-api-key``, ``ocp-apim-subscription-key``, ... (:data:`SENSITIVE_KEY_PARTS`: a key
   containing one, case-insensitively, with ``-``, ``_``, ``.`` and spaces ignored; and
   :data:`SENSITIVE_KEY_WORDS`: a key with one of these as a word, such as ``basic_auth``). Also
   ``{"name": "password", "value": ...}`` pairs and ``("Authorization", ...)`` header tuples.
3. **Secret shapes in text.** Within any string: the password of a URL
   (``scheme://user:PASSWORD@host``, the user part ending at the last ``@`` before the host,
   so a password may contain ``@``); header lines (``Authorization: Bearer ...``,
   ``X-Api-Key: ...``, ``Api-Key``, ``Ocp-Apim-Subscription-Key``, ``Cookie``, ...); a
   ``Bearer`` token anywhere; ``name=value`` pairs whose name is sensitive (libpq DSN keywords
   ``password=secret`` and ``password='quoted value'``, ``?token=...`` and other query
   strings, presigned URLs' ``X-Amz-Signature=``, ``X-Amz-Credential=``, ``sig=``,
   ``Signature=``, ``key=``); and ``"password": "..."`` in JSON or Python-repr text.

Masking never raises: a value it cannot walk shows as :data:`MASK_FAILED`. It is cheap enough
for the log path: patterns are compiled once, and a line with nothing that looks secret costs
one scan of a precompiled pattern plus one substring test per registered secret.

What it cannot know: a secret that is neither registered nor under a sensitive key nor in a
known shape (a bare token in free text, a password in a key called ``x``); a secret
registered in another process (a task run with ``isolation="process"`` registers in its
child process, whose lines the worker stores with the worker's registrations only).

The package imports nothing of the engine, so every layer may use it. Its parts:
:mod:`~engine.masking.rules` (rules 2 and 3: key names and shapes in text, stateless),
:mod:`~engine.masking.registry` (rule 1: the secrets registered in this process) and
:mod:`~engine.masking.apply` (the functions above, which apply both). ``engine.masking`` is the
import path of every public name.
"""

from engine.masking.apply import (
    SHOWN_CHARS,
    SecretsFilter,
    masked_url,
    redact,
    redact_text,
    shown_json,
)
from engine.masking.registry import (
    MIN_SECRET_CHARS,
    forget_secrets,
    is_registered,
    register_environment,
    register_secret,
    register_url_password,
)
from engine.masking.rules import (
    MASK,
    MASK_FAILED,
    SENSITIVE_KEY_PARTS,
    SENSITIVE_KEY_WORDS,
    is_sensitive_key,
)

__all__ = [
    "MASK",
    "MASK_FAILED",
    "MIN_SECRET_CHARS",
    "SENSITIVE_KEY_PARTS",
    "SENSITIVE_KEY_WORDS",
    "SHOWN_CHARS",
    "SecretsFilter",
    "forget_secrets",
    "is_registered",
    "is_sensitive_key",
    "masked_url",
    "redact",
    "redact_text",
    "register_environment",
    "register_secret",
    "register_url_password",
    "shown_json",
]
