"""The one masking function (engine/masking.py), shape by shape: what it masks in
text and in nested values, what it registers, what it leaves alone, and that it never raises.
The surfaces that use it (the status page, the CLI, the stored logs) are tested end to end in
tests/test_masking_surfaces.py."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from engine import masking
from engine.masking import MASK, MASK_FAILED, redact, redact_text
from engine.runtime import logs


@pytest.fixture(autouse=True)
def no_registered_secrets() -> Iterator[None]:
    masking.forget_secrets()
    yield
    masking.forget_secrets()


def _hidden(shown: str, *secrets: str) -> None:
    assert MASK in shown, shown
    for secret in secrets:
        assert secret not in shown, shown


# -- shapes in text, one test each -------------------------------------------------------------


def test_header_x_api_key() -> None:
    shown = redact_text("calling with X-Api-Key: k-123456 and Accept: json")
    assert shown.startswith("calling with X-Api-Key: ***")
    _hidden(shown, "k-123456")


def test_header_api_key() -> None:
    _hidden(redact_text("Api-Key: k-123456"), "k-123456")
    _hidden(redact_text("api-key:k-123456"), "k-123456")


def test_header_ocp_apim_subscription_key() -> None:
    shown = redact_text("Ocp-Apim-Subscription-Key: 0123456789abcdef")
    assert shown == "Ocp-Apim-Subscription-Key: ***"


def test_header_authorization_bearer_keeps_the_scheme() -> None:
    assert redact_text("Authorization: Bearer eyJhbGci.eyJzdWIi.sig") == "Authorization: Bearer ***"
    assert redact_text("Authorization: Basic dXNlcjpwYXNz") == "Authorization: Basic ***"
    # A bearer token outside a header line too.
    _hidden(redact_text("sending Bearer eyJhbGci.eyJzdWIi.sig upstream"), "eyJhbGci")


def test_headers_in_a_dict_written_as_text() -> None:
    text = str({"X-Api-Key": "k-123456", "Ocp-Apim-Subscription-Key": "s-654321", "A": "json"})
    shown = redact_text(text)
    _hidden(shown, "k-123456", "s-654321")
    assert "'A': 'json'" in shown


def test_presigned_url_signature_and_credential() -> None:
    url = (
        "https://bucket.s3.amazonaws.com/key.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
        "&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLE&X-Amz-Signature=f00dfeedbeef0123"
    )
    shown = redact_text(url)
    _hidden(shown, "AKIAEXAMPLE", "f00dfeedbeef0123", "FwoGZXIvYXdzEXAMPLE")
    assert "X-Amz-Expires=3600" in shown  # what is not secret stays readable
    assert shown.startswith("https://bucket.s3.amazonaws.com/key.csv?")


def test_other_signed_urls() -> None:
    azure = "https://acct.blob.core.windows.net/c/b?sv=2024-01-01&se=2026&sig=abcSIG%3D"
    _hidden(redact_text(azure), "abcSIG")
    cloudfront = "https://d1.cloudfront.net/f?Expires=1&Signature=cfSIG-123&Key-Pair-Id=K1"
    _hidden(redact_text(cloudfront), "cfSIG-123")
    google = "https://maps.googleapis.com/maps/api/geocode/json?address=x&key=AIzaSyEXAMPLE"
    _hidden(redact_text(google), "AIzaSyEXAMPLE")


def test_token_in_a_query_string() -> None:
    shown = redact_text("GET https://api.example.com/items?page=2&token=tok-98765&x=1")
    assert shown == "GET https://api.example.com/items?page=2&token=***&x=1"
    _hidden(redact_text("/hook?access_token=at-12345"), "at-12345")
    _hidden(redact_text("/hook?api_key=ak-12345"), "ak-12345")


def test_libpq_dsn_password_keyword() -> None:
    shown = redact_text("host=db.example port=5432 user=app password=hunter2pw dbname=x")
    assert shown == "host=db.example port=5432 user=app password=*** dbname=x"


def test_libpq_dsn_quoted_password() -> None:
    shown = redact_text(r"host=db password='two words \' and a quote' dbname=x")
    assert shown == "host=db password='***' dbname=x"
    _hidden(redact_text("password = 'spaced out' host=h"), "spaced out")


def test_url_password_holding_an_at_sign() -> None:
    # The user part ends at the LAST @ before the host.
    shown = redact_text("connecting to postgresql://app:p@ss@w0rd@db.example:5432/x now")
    assert shown == "connecting to postgresql://app:***@db.example:5432/x now"
    # A user holding @ (user@server, as some clouds name users) keeps it.
    assert redact_text("postgresql://app@srv:s3cret@db/x") == "postgresql://app@srv:***@db/x"
    # Two URLs on a line: each masked, no text between them eaten.
    assert (
        redact_text("a https://u:p1@h1/x b https://u:p2@h2/y")
        == "a https://u:***@h1/x b https://u:***@h2/y"
    )


def test_dict_key_named_pwd() -> None:
    assert redact({"uid": "sa", "pwd": "hunter2pw"}) == {"uid": "sa", "pwd": MASK}
    _hidden(redact_text("Driver=x;Server=h;Uid=sa;Pwd=hunter2pw;"), "hunter2pw")


def test_json_in_a_string() -> None:
    text = json.dumps({"user": "u", "password": "hunter2pw", "nested": {"api_key": "ak-1"}})
    shown = redact_text(text)
    _hidden(shown, "hunter2pw", "ak-1")
    assert json.loads(shown) == {"user": "u", "password": MASK, "nested": {"api_key": MASK}}
    compact = '{"password":"hunter2pw","n":1}'
    assert json.loads(redact_text(compact)) == {"password": MASK, "n": 1}
    # JSON encoded inside a JSON string.
    _hidden(redact_text(json.dumps({"body": text})), "hunter2pw")


def test_keyword_arguments_and_yaml_like_lines() -> None:
    _hidden(redact_text('connect(host="h", password="hunter2pw")'), "hunter2pw")
    _hidden(redact_text("--password=hunter2pw"), "hunter2pw")
    _hidden(redact_text("DB_PASSWORD=hunter2pw"), "hunter2pw")
    _hidden(redact_text("password: hunter2pw"), "hunter2pw")
    _hidden(redact_text("Cookie: session=abc123; theme=dark"), "abc123")


# -- key names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "password", "Password", "PASSWORD", "db_password", "passwd", "pwd", "passphrase",
        "secret", "client_secret", "token", "access_token", "Refresh-Token", "api_key",
        "apikey", "apiKey", "api-key", "X-Api-Key", "x_api_key", "Api-Key",
        "Ocp-Apim-Subscription-Key", "ocp_apim_subscription_key", "private_key", "privateKey",
        "authorization", "Authorization", "credentials", "cookie", "Set-Cookie", "auth",
        "basic_auth", "sentry_dsn", "aws_secret_access_key", "AWS_ACCESS_KEY_ID",
    ],
)  # fmt: skip
def test_sensitive_key_names_in_any_case_and_separator(key: str) -> None:
    assert masking.is_sensitive_key(key)
    assert redact({key: "value-12345"}) == {key: MASK}
    # ... and the same name in text.
    _hidden(redact_text(f"{key}=value-12345"), "value-12345")


@pytest.mark.parametrize(
    "key", ["author", "bypass", "keyboard", "key", "name", "monkey", "passenger", "region"]
)
def test_ordinary_key_names_are_left_alone(key: str) -> None:
    assert not masking.is_sensitive_key(key)
    assert redact({key: "value-12345"}) == {key: "value-12345"}


def test_prose_is_left_alone() -> None:
    line = "job 7 passed: 512 rows, monkey=3, token count: 12, author=bob, key: 2026-01-01"
    assert redact_text(line) == line
    assert (
        redact_text("https://example.com:8443/path@x?q=1") == "https://example.com:8443/path@x?q=1"
    )


# -- nested values -----------------------------------------------------------------------------


def test_nested_values_are_walked() -> None:
    value = {
        "conn": {"url": "postgresql://u:pw-1234@h/d", "options": ["-c", "x"]},
        "headers": [("Authorization", "Bearer abc"), ("Accept", "json")],
        "env": [{"name": "DB_PASSWORD", "value": "pw-5678"}, {"name": "HOME", "value": "/h"}],
        "credentials": {"user": "u", "key": "k-999", "ttl": 5},
        "count": 3,
        "none": None,
        "secret": None,
    }
    assert redact(value) == {
        "conn": {"url": "postgresql://u:***@h/d", "options": ["-c", "x"]},
        "headers": [("Authorization", MASK), ("Accept", "json")],
        "env": [{"name": "DB_PASSWORD", "value": MASK}, {"name": "HOME", "value": "/h"}],
        "credentials": {"user": MASK, "key": MASK, "ttl": MASK},
        "count": 3,
        "none": None,
        "secret": None,
    }
    # The input is not changed.
    assert value["conn"] == {"url": "postgresql://u:pw-1234@h/d", "options": ["-c", "x"]}
    # A value found under a sensitive key.
    assert redact("anything", key="api_token") == MASK


# -- registered secrets ------------------------------------------------------------------------


def test_a_registered_secret_is_masked_everywhere() -> None:
    masking.register_secret("Vault-Fetched-9f8e7d")
    assert redact_text("got Vault-Fetched-9f8e7d!") == f"got {MASK}!"
    assert redact({"note": ["x Vault-Fetched-9f8e7d y"]}) == {"note": [f"x {MASK} y"]}
    # ... also as written in a URL and in JSON text.
    masking.register_secret('p@ss/w"rd-42')
    _hidden(redact_text("https://h/x?v=p%40ss%2Fw%22rd-42"), "p%40ss")
    _hidden(redact_text(json.dumps({"v": 'p@ss/w"rd-42'})), 'w\\"rd')


def test_registration_api_rules() -> None:
    masking.register_secret("abcd")  # too short: masking it would garble text
    masking.register_secret("postgres")  # a development default that is in every URL
    assert redact_text("abcd postgres") == "abcd postgres"
    masking.register_secret("region-value-1", name="region")  # not a sensitive name
    assert not masking.is_registered("region-value-1")
    masking.register_secret("token-value-1", name="api_token")
    assert masking.is_registered("token-value-1")
    masking.register_secret({"user": "someone", "password": "from-a-dict-1"})
    assert masking.is_registered("from-a-dict-1")
    assert not masking.is_registered("someone")
    masking.register_secret([b"from-bytes-1", 42, None])
    assert masking.is_registered("from-bytes-1")


def test_url_passwords_and_the_environment_are_registered() -> None:
    masking.register_url_password("postgresql://app:p@ss@w0rd@db/x")
    assert masking.is_registered("p@ss@w0rd")
    masking.register_url_password("host=h password='quoted pw 1' dbname=x")
    assert masking.is_registered("quoted pw 1")
    masking.register_environment(
        {
            "DEFERRAL_CONN_JOBS_API": "https://svc:conn-secret-1@jobs.example",
            "DEFERRAL_DATABASE_URL": "postgresql://u:db-secret-1@h/d",
            "DEFERRAL_FERNET_KEY": "key-number-one,key-number-two",
            "OTHER_URL": "https://u:not-ours-1@h",
        }
    )
    for value in ("conn-secret-1", "db-secret-1", "key-number-one", "key-number-two"):
        assert masking.is_registered(value), value
        assert value not in redact_text(f"bare {value} in text")
    assert not masking.is_registered("not-ours-1")


# -- never raises ------------------------------------------------------------------------------


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_masking_never_raises_on_odd_input() -> None:
    cyclic: dict[str, Any] = {"a": 1}
    cyclic["self"] = cyclic
    deep: Any = "password=deep-1"
    for _ in range(200):
        deep = [deep]
    shown = redact({"cyclic": cyclic, "deep": deep, "bytes": b"token=abc-123\xff", "set": {1}})
    assert "deep-1" not in repr(shown)
    assert "abc-123" not in repr(shown)
    assert redact(_Unprintable()) == MASK_FAILED
    assert redact({"x": _Unprintable()}) == MASK_FAILED
    assert redact_text(None) == "None"  # type: ignore[arg-type]
    for odd in ["", "=", ":", "password=", "password='unterminated", "a://@", "\x00\udcff", "==::"]:
        assert isinstance(redact_text(odd), str)
    assert redact({1: "x", None: "y", ("t",): "z"}) == {1: "x", None: "y", ("t",): "z"}


# -- logs --------------------------------------------------------------------------------------


def _record(message: str, *args: Any, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("failed with password=in-traceback-1")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("myproj", logging.WARNING, __file__, 1, message, args, exc_info)


def test_process_log_lines_are_masked_as_text_and_json() -> None:
    masking.register_secret("registered-in-log-1")
    args = ("registered-in-log-1", "postgresql://u:url-pw-1@h/d")
    text = logs._TextFormatter().format(_record("using %s on %s", *args, exc=True))
    doc = json.loads(logs._JsonFormatter().format(_record("using %s on %s", *args, exc=True)))
    for shown in (text, doc["msg"] + doc["exc"]):
        _hidden(shown, "registered-in-log-1", "url-pw-1", "in-traceback-1")


def test_the_secrets_filter_masks_records_for_handlers_of_your_own() -> None:
    masking.register_secret("registered-in-log-2")
    record = _record("token=%s", "registered-in-log-2", exc=True)
    assert masking.SecretsFilter().filter(record)
    shown = logging.Formatter().format(record)
    _hidden(shown, "registered-in-log-2", "in-traceback-1")


def test_key_names_are_judged_the_same_every_time_and_the_memo_is_bounded() -> None:
    """is_sensitive_key remembers its answers (a triggerer masks every event's payload): the
    same answer again, for any key, and no more than a bounded number of names kept."""
    from engine.masking.rules import _sensitive_name, is_sensitive_key

    for _ in range(2):
        assert is_sensitive_key("api_key")
        assert is_sensitive_key("X-Auth-Token")
        assert is_sensitive_key("basic_auth")
        assert not is_sensitive_key("author")
        assert not is_sensitive_key("fired")
        assert not is_sensitive_key("")
        assert not is_sensitive_key(("password",))  # not a string: not a name
        assert redact({"password": "x", "fired": 1.5}) == {"password": MASK, "fired": 1.5}
    for i in range(10_000):
        is_sensitive_key(f"field_{i}")
    maxsize = _sensitive_name.cache_info().maxsize
    assert maxsize is not None
    assert _sensitive_name.cache_info().currsize <= maxsize
