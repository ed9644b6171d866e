"""``serve``'s ``--llm-max-*``, ``--header-timeout-s`` and ``--keep-alive-s`` flags: parsed into the
server settings the app is built from, their defaults those of ``LLMLimits`` / ``ServerConfig``, and
values outside their bounds refused at start-up with the flag named."""

from __future__ import annotations

import pytest

from batchpilot.cli import build_parser
from batchpilot.server.cli import LIMITS, flag, server_config
from batchpilot.server.config import ServerConfig
from batchpilot.server.llm.schemas import CAP, LLMLimits
from batchpilot.settings import spec_from_args


def settings(*argv: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return server_config(args, spec_from_args(args))


def test_the_defaults_are_llm_limits_and_the_header_deadline_defaults() -> None:
    s = settings()
    assert s.llm_limits == LLMLimits() and s.header_timeout_s == ServerConfig.header_timeout_s == 10.0
    # idle connections outlive httpx's and the openai client's pool expiry (5 s): the client closes first
    assert s.keep_alive_s == ServerConfig.keep_alive_s > 5.0


def test_every_limit_has_a_flag_that_reaches_the_server_settings() -> None:
    values = {name: 3 + i for i, name in enumerate(LIMITS)}
    argv = [part for name, v in values.items() for part in (flag(name), str(v))]
    assert settings(*argv, "--header-timeout-s", "2.5").llm_limits == LLMLimits(**values)
    assert settings("--header-timeout-s", "2.5").header_timeout_s == 2.5
    assert settings("--keep-alive-s", "7").keep_alive_s == 7.0


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_a_limit_below_one_is_refused_naming_the_flag(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        settings(flag(name), "0")
    assert exit_.value.code == 2
    assert f"argument {flag(name)}: must be >= 1, got 0" in capsys.readouterr().err


def test_a_count_limit_over_the_schema_cap_is_refused_and_a_character_limit_is_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, (_, cap) in LIMITS.items():
        if cap is None:
            assert getattr(settings(flag(name), str(CAP * 1000)).llm_limits, name) == CAP * 1000
            continue
        assert getattr(settings(flag(name), str(CAP)).llm_limits, name) == CAP
        with pytest.raises(SystemExit):
            settings(flag(name), str(CAP + 1))
        assert f"argument {flag(name)}: must be at most {CAP}, got {CAP + 1}" in capsys.readouterr().err


def test_a_limit_that_is_not_a_whole_number_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings("--llm-max-stop", "2.5")
    assert "argument --llm-max-stop: expected a whole number, got '2.5'" in capsys.readouterr().err


def test_a_header_timeout_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"server.header_timeout_s must be > 0 seconds, got 0.0"):
        settings("--header-timeout-s", "0")


def test_a_keep_alive_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"server.keep_alive_s must be > 0 seconds, got -1.0"):
        settings("--keep-alive-s", "-1")
