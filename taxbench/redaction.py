"""Keep credentials out of everything taxbench writes: manifests, reports, wandb config and summaries.

Two rules, applied to any nested JSON-like value:
- a mapping key that names a secret (API_KEY, TOKEN, SECRET, PASSWORD, ...) has its value replaced;
- inside strings (setup lines, sbatch arguments, command lines): `NAME=value`, `NAME: value` and `--name value`
  where NAME names a secret, the argument of `... login <key>`, passwords in URLs (`https://user:pw@host`), and
  values shaped like well-known tokens (wandb, GitHub, Hugging Face, OpenAI, Slack, AWS).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

# A name is secret when one of its parts (split at non-alphanumerics, any case) is one of these, or ends in
# one of them (accessToken -> "accesstoken"); "tokens" or "max_tokens" are not.
_SECRET_PARTS = frozenset({"token", "secret", "password", "passwd", "passphrase", "credential", "credentials", "apikey",
                           "auth", "authorization", "cookie"})
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")})
_SECRET_SUFFIXES = ("token", "apikey", "password", "secret")
# NAME=value, NAME: value, "NAME": "value"
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<sep>[\"']?\s*[=:]\s*[\"']?)(?P<value>[^\s\"',;}]+)")
# --name value, --name=value
_OPTION = re.compile(r"(?P<name>--[A-Za-z0-9_.-]+)(?P<sep>\s+|=)(?P<value>[^\s\"',;}]+)")
# `wandb login <key>`, `huggingface-cli login <token>`: the argument after login (options aside)
_LOGIN = re.compile(r"(?P<head>\blogin(?:\s+--?[A-Za-z-]+(?:=\S+)?)*\s+)(?P<value>(?!--?)[^\s;&|]+)")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/\s:@]+:)(?P<value>[^@\s/]+)(?P<tail>@)", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(
    r"\b(?:"
    r"gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-[A-Za-z0-9_-]{20,}"  # OpenAI-style
    r"|xox[abpr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|local-[0-9a-f]{40}"  # wandb local-server key
    r")\b"
)


def is_secret_name(name: str) -> bool:
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    return (
        any(p in _SECRET_PARTS or p.endswith(_SECRET_SUFFIXES) for p in parts)
        or any(pair in _SECRET_PAIRS for pair in zip(parts, parts[1:], strict=False))
    )


def redact_text(text: str) -> str:
    def assignment(match: re.Match[str]) -> str:
        if not is_secret_name(match["name"]) or match["value"] == REDACTED:
            return match[0]
        return f"{match['name']}{match['sep']}{REDACTED}"

    text = _ASSIGNMENT.sub(assignment, text)
    text = _OPTION.sub(assignment, text)
    text = _LOGIN.sub(lambda m: m["head"] + REDACTED, text)
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}{m['tail']}", text)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with secrets replaced by REDACTED; other values are returned unchanged."""
    if isinstance(value, Mapping):
        return {
            key: (REDACTED if isinstance(key, str) and is_secret_name(key) and item not in (None, "") else redact(item))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(item) for item in value)
    if isinstance(value, str):
        return redact_text(value)
    return value
