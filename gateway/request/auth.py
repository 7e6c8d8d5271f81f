"""Virtual API keys -> tenants, and the admin token."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from gateway.errors import ClientError


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(header: str | None, key_hashes: dict[str, str]) -> str:
    """The tenant of the request's virtual key ("" when no keys are
    configured: anonymous mode, loopback only).

    Raises:
        ClientError: 401 for a missing or unknown key."""
    if not key_hashes:
        return ""
    token = bearer(header)
    if token is None:
        raise ClientError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
    tenant = key_hashes.get(hashlib.sha256(token.encode()).hexdigest())
    if tenant is None:
        raise ClientError(401, "invalid API key", code="invalid_api_key")
    return tenant


def check_admin(header: str | None, admin_token: str | None, token_env: str) -> None:
    """Raises ClientError(401) unless the bearer token equals the admin token
    (constant-time compare). With the token variable unset, admin is closed."""
    if not admin_token:
        raise ClientError(401, f"admin API disabled: environment variable {token_env} is unset",
                          code="admin_disabled")
    token = bearer(header)
    if token is None:
        raise ClientError(401, f"missing admin token: send Authorization: Bearer <the value of {token_env}>",
                          code="invalid_api_key")
    if not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise ClientError(401, "invalid admin token", code="invalid_api_key")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
