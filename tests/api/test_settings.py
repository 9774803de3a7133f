"""Settings from the environment, and the refusal to serve on a non-loopback address without a token."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from distbelief.api import Settings, create_app
from distbelief.api.cli import main
from distbelief.api.settings import check_exposure, is_loopback, tokens_equal
from distbelief.errors import InvalidOptionError


def test_settings_come_from_distbelief_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTBELIEF_STORE", "/srv/store")
    monkeypatch.setenv("DISTBELIEF_SCHEDULER", "tcp://10.0.0.5:8786")
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", "t" * 32)
    monkeypatch.setenv("DISTBELIEF_MAX_UPLOAD_BYTES", "4096")
    monkeypatch.setenv("DISTBELIEF_MAX_CONCURRENT_JOBS", "3")
    monkeypatch.setenv("DISTBELIEF_REGISTER_SCHEMES", "s3, GS")
    s = Settings()
    assert (s.store, s.scheduler, s.max_upload_bytes, s.max_concurrent_jobs) == (
        "/srv/store",
        "tcp://10.0.0.5:8786",
        4096,
        3,
    )
    assert s.api_token is not None and s.api_token.get_secret_value() == "t" * 32
    assert "t" * 32 not in repr(s)  # the token never shows in logs
    assert s.register_schemes == ["s3", "gs"]
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", "")
    monkeypatch.setenv("DISTBELIEF_SCHEDULER", " ")
    assert Settings().api_token is None and Settings().scheduler is None


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("api_token", "short", "at least 16 characters"),
        ("max_concurrent_jobs", 0, "greater than or equal to 1"),
        ("max_upload_bytes", 10, "greater than or equal to 1024"),
        ("port", 70000, "less than or equal to 65535"),
    ],
)
def test_bad_settings_say_what_to_fix(field: str, value: Any, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Settings(**{field: value})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("example.org", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_no_token_no_public_address() -> None:
    with pytest.raises(InvalidOptionError, match=r"refusing to listen on 0\.0\.0\.0 without a token"):
        create_app(Settings(host="0.0.0.0"))
    check_exposure(Settings(host="0.0.0.0", api_token=SecretStr("k" * 20)))
    check_exposure(Settings(host="127.0.0.1"))


def test_serve_refuses_a_public_address_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DISTBELIEF_API_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2  # a setting to fix: the usage exit code
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", "short")
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(secrets, "compare_digest", spy)  # the module api.settings calls it from
    assert tokens_equal("é" * 16, SecretStr("é" * 16)) and not tokens_equal("a" * 16, SecretStr("b" * 16))
    assert calls == [(("é" * 16).encode(), ("é" * 16).encode()), (b"a" * 16, b"b" * 16)]
