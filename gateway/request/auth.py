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


# The 401 of a gateway left open by its config (``exposed_without_keys``): fail closed, never open to anyone.
NO_KEYS = ("no virtual API key is configured (auth.keys), and this gateway listens on a non-loopback address: "
           "every request is refused until a key is configured (or server.insecure says an open gateway is meant)")


def exposed_without_keys(compiled, host: str | None, insecure: bool = False) -> bool:
    """Whether ``compiled`` (a ``Compiled`` config) leaves a gateway listening on ``host`` open to anyone: no
    virtual key loaded (a key from an unset environment variable is not loaded), a non-loopback address, and
    neither ``--insecure`` (``insecure``) nor ``server.insecure`` saying that is meant. ``host`` None: not
    listening (an in-process gateway)."""
    return bool(host) and not is_loopback(host) and _keyless(compiled, insecure)


def serves_this_machine_only(compiled, host: str | None, insecure: bool = False) -> bool:
    """Whether a gateway listening on ``host`` serves anyone on this machine without a key: as
    ``exposed_without_keys`` but on a loopback address. Browsers reach such a gateway too, so ``foreign_caller``
    judges its requests."""
    return bool(host) and is_loopback(host) and _keyless(compiled, insecure)


def _keyless(compiled, insecure: bool) -> bool:
    """No virtual key loaded, and no ``--insecure`` nor ``server.insecure`` saying an open gateway is meant."""
    return not compiled.key_hashes and not insecure and not compiled.config.server.insecure


def foreign_caller(host: str | None, origin: str | None, cors_origins: tuple[str, ...]) -> str | None:
    """Why a gateway that ``serves_this_machine_only`` refuses a request (None: it may serve it). ``host`` and
    ``origin``: the request's ``Host`` and ``Origin`` headers (None: not sent); ``cors_origins``: the origins
    ``server.cors`` allows. Without keys any local caller is served, so two callers that are not local are told
    apart by what browsers send (the attacks that Ollama's CVE-2024-28224 fix closes):

    - a ``Host`` that is no loopback name (``localhost``, ``*.localhost`` (RFC 6761), ``127.0.0.0/8``, ``::1``):
      a page of another site that reached the port by DNS rebinding, and reads the answers;
    - an ``Origin`` other than the gateway's own (``http://<Host>``) and not allowed by ``server.cors``: a page of
      another site posting to it blind (a request a browser sends without a preflight), spending the upstreams'
      keys. Clients other than browsers send no ``Origin``."""
    if host:
        name = host.rpartition(":")[0] if not host.endswith("]") and ":" in host else host
        name = name.strip("[]").lower()
        if not (is_loopback(name) or name.endswith(".localhost")):
            return (f"Host {host!r} is not a loopback name: this gateway has no virtual keys (auth.keys) and serves "
                    "this machine only (a page of another site can reach it through DNS rebinding)")
    if origin is not None and origin.partition("://")[2] != host and origin not in cors_origins \
            and "*" not in cors_origins:
        return (f"a page of {origin} may not call this gateway: it has no virtual keys (auth.keys), so another "
                "site's page would spend its upstreams' keys; allow the origin in server.cors.allow_origins")
    return None


# How a request sends its key, named by a 401: OpenAI's header, and Anthropic's on /v1/messages
SEND_KEY = {"openai": "Authorization: Bearer <key>", "anthropic": "x-api-key: <key> (or Authorization: Bearer <key>)"}


def authenticate(header: str | None, key_hashes: dict[str, str], closed: bool = False, api: str = "openai") -> str:
    """The tenant of the request's virtual key ("" when no keys are configured: anonymous mode, loopback only).
    ``closed``: the running config left the gateway ``exposed_without_keys`` (a reload, a rollback or another
    replica's change took its keys away): every request is refused rather than served to anyone. ``api``: whose
    header the 401 names (``SEND_KEY``).

    Raises:
        ClientError: 401 for a missing or unknown key, or ``closed``."""
    if not key_hashes:
        if closed:
            raise ClientError(401, NO_KEYS, code="invalid_api_key")
        return ""
    token = bearer(header)
    if token is None:
        raise ClientError(401, f"missing API key: send {SEND_KEY[api]}", code="invalid_api_key")
    tenant = key_hashes.get(hashlib.sha256(token.encode()).hexdigest())
    if tenant is None:
        raise ClientError(401, "invalid API key", code="invalid_api_key")
    return tenant


def check_admin(header: str | None, admin_token: str | None, token_env: str) -> None:
    """Raises ClientError(401, with ``WWW-Authenticate: Bearer`` as RFC 6750 has it) unless the bearer token
    equals the admin token (constant-time compare). With the token variable unset, admin is closed."""
    challenge = {"www-authenticate": 'Bearer realm="tandem-admin"'}
    admin_token = (admin_token or "").strip()   # a secret file's trailing newline made the token unusable
    if not admin_token:
        raise ClientError(401, f"admin API disabled: environment variable {token_env} is unset",
                          code="admin_disabled", headers=challenge)
    token = bearer(header)
    if token is None:
        raise ClientError(401, f"missing admin token: send Authorization: Bearer <the value of {token_env}>",
                          code="invalid_api_key", headers=challenge)
    if not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise ClientError(401, "invalid admin token", code="invalid_api_key", headers=challenge)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
