"""``serve``'s flags for the LLM request-size limits (``llm_limits.LLMLimits``), named like the
encoder's ``--max-inputs`` / ``--max-input-chars`` with the ``--llm-`` prefix of the other LLM flags:

    --llm-max-prompts N          prompts per completion request                      (default 64)
    --llm-max-prompt-chars N     characters per prompt, and per conversation         (default 1048576)
    --llm-max-messages N         messages per chat request                           (default 512)
    --llm-max-stop N             stop sequences per request                          (default 4)
    --llm-max-stop-chars N       characters per stop sequence                        (default 256)
    --llm-max-stop-token-ids N   stop_token_ids per request                          (default 64)

Like the encoder's limits they are flags of ``serve`` (``ServerConfig.llm_limits``), not keys of the
config file's ``server:`` section. Each is a whole number >= 1. The four that count list items are also
at most ``llm_schemas.CAP`` (4096), the schema's bound on any list in a request body: a longer list is
refused by validation (422) before any limit is looked at, so a limit above it could never apply. A
value outside these bounds stops ``serve`` with a usage error naming the flag and what it accepts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

from batchpilot.server.llm_limits import LLMLimits
from batchpilot.server.llm_schemas import CAP

# LLMLimits field -> (what it bounds, the most a flag may ask for: None when only >= 1)
LIMITS: dict[str, tuple[str, int | None]] = {
    "max_prompts": ("prompts per completion request", CAP),
    "max_prompt_chars": ("characters per prompt, and per conversation (all its messages' text)", None),
    "max_messages": ("messages per chat request", CAP),
    "max_stop": ("stop sequences per request", CAP),
    "max_stop_chars": ("characters per stop sequence", None),
    "max_stop_token_ids": ("stop_token_ids per request", CAP),
}
assert set(LIMITS) == {f.name for f in fields(LLMLimits)}, "every LLM limit has its flag"


def flag(name: str) -> str:
    """The flag of an ``LLMLimits`` field: ``max_prompts`` -> ``--llm-max-prompts``."""
    return "--llm-" + name.replace("_", "-")


def _bounded(cap: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        if cap is not None and value > cap:
            raise argparse.ArgumentTypeError(
                f"must be at most {cap}, got {value}: a request body's lists are capped at {cap} items "
                f"(longer ones are refused by validation first), so a higher limit never applies")
        return value

    return parse


def add_llm_limit_args(p: argparse.ArgumentParser) -> None:
    """The six limit flags, in their own group of ``serve --help``."""
    g = p.add_argument_group("LLM request limits (--llm; a 400 naming the field; docs/reliability.md)")
    for name, (what, cap) in LIMITS.items():
        g.add_argument(flag(name), dest="llm_" + name, type=_bounded(cap), default=getattr(LLMLimits, name),
                       metavar="N", help=f"{what} (default: %(default)s)")


def llm_limits_from_args(args: argparse.Namespace) -> LLMLimits:
    """The ``LLMLimits`` the parsed flags ask for (the defaults where a namespace lacks them)."""
    return LLMLimits(**{name: getattr(args, "llm_" + name, getattr(LLMLimits, name)) for name in LIMITS})
