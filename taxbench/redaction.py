"""Keep credentials out of everything taxbench writes: manifests, reports, wandb config and summaries.

Two rules, applied to any nested JSON-like value:
- a mapping key that names a secret (API_KEY, TOKEN, SECRET, PASSWORD, MYPASS, GITLAB_PAT, ...) has its value replaced;
- inside strings (setup lines, sbatch arguments, command lines): `NAME=value`, `NAME: value`, `"NAME=value"` and
  `--name value` where NAME names a secret (a quoted value is redacted whole, spaces included; `Authorization: Bearer
  <token>` loses the scheme and the token), `Bearer <token>`, the argument of `... login <key>` and its `-p <pw>`,
  `mysql -p<pw>`, `curl -u user:<pw>`, passwords in URLs (`https://user:pw@host`, `redis://:pw@host`), and values
  shaped like well-known tokens (wandb, GitHub, GitLab, Hugging Face, OpenAI, Stripe, Slack, AWS).
Over-redacting a harmless value is preferred to writing a credential; common non-secrets (max_tokens,
--tokens-per-shard, --keep) are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

# A name is secret when one of its parts (split at non-alphanumerics, any case) is one of these, or ends in
# one of them (accessToken -> "accesstoken", MYPASS -> "mypass"), or its last part is "key" (--key, SSH_KEY);
# "tokens", "max_tokens", "keep" or "bypass" are not.
_SECRET_PARTS = frozenset({"token", "secret", "password", "passwd", "passphrase", "credential", "credentials", "apikey",
                           "auth", "authorization", "cookie", "pat", "pwd"})
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")})
_SECRET_SUFFIXES = ("token", "apikey", "password", "secret", "pass", "pwd")
_NOT_SECRET_PARTS = frozenset({"bypass", "compass", "surpass", "encompass"})

_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
# A value: quoted whole (escapes inside double quotes), an auth scheme with its credential, or one bare word.
_VALUE = (
    r"\"(?:[^\"\\]|\\.)*\"|'[^']*'"
    r"|(?i:bearer|basic|digest|token|bot)\s+[^\s\"',;}]+"
    r"|[^\s\"',;}]+"
)
# "NAME=value with spaces", 'Authorization: Bearer x': the name opens a quoted string, the value runs to its end.
_QUOTED_ASSIGNMENT = re.compile(rf"(?P<quote>[\"'])(?P<name>{_NAME})(?P<sep>\s*[=:]\s*)(?P<value>(?:(?!(?P=quote)).)+)"
                                r"(?=(?P=quote))")
# NAME=value, NAME: value, "NAME": "value"
# The lookbehinds let a name start only where a run of name characters starts: linear time on long words.
_ASSIGNMENT = re.compile(rf"(?<![A-Za-z0-9_.-])(?P<name>{_NAME})(?P<sep>[\"']?\s*[=:]\s*)(?P<value>{_VALUE})")
# --name value, --name=value (a following option is not a value)
_OPTION = re.compile(rf"(?P<name>--[A-Za-z0-9_.-]+)(?P<sep>\s+|=)(?P<value>(?!-)(?:{_VALUE}))")
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?P<value>(?!<redacted>)[^\s\"';&|]+)", re.IGNORECASE)
# `wandb login <key>`, `huggingface-cli login <token>`: the argument after login (options aside)
_LOGIN = re.compile(
    r"(?P<head>\blogin(?:\s+(?:-u|--username)(?:\s+|=)\S+|\s+--?[A-Za-z-]+(?:=\S+)?)*\s+)(?P<value>(?!--?)[^\s;&|]+)"
)
# `docker login -u me -p <pw>`, `mysql -p<pw>` / `mariadb -p <pw>`: -p takes the password in these commands only.
_LOGIN_P = re.compile(r"(?P<head>\blogin\b[^;&|\n]*?\s-p(?:\s+|=)?)(?P<value>(?!-)[^\s;&|]+)")
_MYSQL_P = re.compile(r"(?P<head>\b(?:mysql\w*|mariadb[\w-]*)\b[^;&|\n]*?\s-p)(?P<value>[^\s;&|]+)")
# `curl -u user:<pw>`, `curl --user=user:<pw>`
_CURL_USER = re.compile(
    r"(?P<head>\bcurl\b[^;&|\n]*?\s(?:-u|--user)(?:\s+|=)?(?P<quote>[\"'])?[^\s:;&|\"']*:)"
    r"(?P<value>(?(quote)(?:(?!(?P=quote)).)+|[^\s;&|\"']+))"
)
_URL_PASSWORD = re.compile(r"(?P<head>(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://[^/\s:@]*:)(?P<value>[^@\s/]+)(?P<tail>@)",
                           re.IGNORECASE)
_TOKEN_SHAPES = re.compile(
    r"\b(?:"
    r"gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab personal access token
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-[A-Za-z0-9_-]{20,}"  # OpenAI-style
    r"|[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"  # Stripe secret and restricted keys
    r"|xox[abpr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|local-[0-9a-f]{40}"  # wandb local-server key
    r")\b"
)


def is_secret_name(name: str) -> bool:
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    return bool(parts) and (
        any(p not in _NOT_SECRET_PARTS and (p in _SECRET_PARTS or p.endswith(_SECRET_SUFFIXES)) for p in parts)
        or any(pair in _SECRET_PAIRS for pair in zip(parts, parts[1:], strict=False))
        or parts[-1] == "key"
    )


def _redacted_value(value: str) -> str:
    """REDACTED in the value's own quotes, so the surrounding text stays well formed."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return f"{value[0]}{REDACTED}{value[0]}"
    return REDACTED


def _assignment(match: re.Match[str]) -> str:
    value = match["value"]
    if not is_secret_name(match["name"]) or value.strip("\"'") == REDACTED:
        return match[0]
    return f"{match.groupdict().get('quote') or ''}{match['name']}{match['sep']}{_redacted_value(value)}"


def _redact_tail(match: re.Match[str]) -> str:
    return f"{match['head']}{REDACTED}{match.groupdict().get('tail') or ''}"


def redact_text(text: str) -> str:
    text = _QUOTED_ASSIGNMENT.sub(_assignment, text)
    text = _ASSIGNMENT.sub(_assignment, text)
    text = _OPTION.sub(_assignment, text)
    for pattern in (_BEARER, _LOGIN_P, _LOGIN, _MYSQL_P, _CURL_USER, _URL_PASSWORD):
        text = pattern.sub(_redact_tail, text)
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
