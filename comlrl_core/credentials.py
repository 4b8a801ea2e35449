"""Credentials never travel inside run specs or URIs: where one appears it is refused, and every
message that echoes a URI shows it redacted. The supported ways to pass secrets are the services'
own: the AWS credential chain and environment, W&B's login or ``WANDB_API_KEY``, Prefect Secret
blocks for deployments."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]*@")
# The same rule as a JSON-schema pattern, so a Prefect server refuses such a parameter before a run exists.
NO_URL_CREDENTIALS = r"^(?![\s\S]*[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]*@)"
CREDENTIAL_KEYS = frozenset({"api_key", "apikey", "key", "token", "access_token", "auth_token", "hf_token",
                             "secret", "secret_key", "password", "passwd", "credentials", "aws_access_key_id",
                             "aws_secret_access_key", "aws_session_token", "wandb_api_key"})


def redact(text: str) -> str:
    """``text`` with the user information of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def find_credentials(value: object, where: str) -> str | None:
    """Where in ``value`` (a spec's JSON-like data) a credential sits: a URL with user information, or
    a mapping key that names a secret; None when there is none. The secret itself is never returned."""
    if isinstance(value, str):
        return f"{where} ({redact(value)!r})" if _USERINFO.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and key.lower() in CREDENTIAL_KEYS:
                return path
            if (found := find_credentials(item, path)) is not None:
                return found
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if (found := find_credentials(item, f"{where}[{i}]")) is not None:
                return found
    return None
