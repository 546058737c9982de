"""Console sign-in, sessions, CSRF and the security headers of every console answer.

- Sign-in takes the admin token (checked by `AuthService.verify_admin`) and starts a session: a
  random 256-bit value in an HttpOnly, SameSite=Strict cookie scoped to /console (Secure on https or
  when `admin.console_secure_cookie` is set). Only its SHA-256 is stored (table console_session), so
  sessions hold across gateway replicas and restarts, and sign-out ends one everywhere.
- Sessions expire `admin.console_session_ttl_s` after sign-in; expired rows are purged on sign-in.
  A session is bound to the admin token it was signed in with (the stored hash covers the cookie
  value and a fingerprint of the admin token in force): a new admin token ends every session.
  "Sign out everywhere" deletes every session row.
- CSRF: every state-changing console request must carry `X-CSRF-Token`, an HMAC of the session
  value (it reveals nothing about the session). htmx sends it on every request from the page's
  `hx-headers`; a cross-site form can neither read it nor set a header. The sign-in form, before
  any session exists, is a double submit: a random value in a SameSite=Strict cookie and in the form.
- Headers: a strict Content-Security-Policy (scripts and styles from this origin only, no inline
  script, no eval), no framing, no referrer, no caching of pages that show data or secrets.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie, MutableScopeHeaders
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.gateway.auth.service import hash_secret
from sluice.gateway.db.base import utcnow
from sluice.gateway.db.models import ConsoleSession
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.services import services

SESSION_COOKIE = "sluice_console"
LOGIN_COOKIE = "sluice_console_login"
CSRF_HEADER = "x-csrf-token"
COOKIE_PATH = "/console"
LOGIN_COOKIE_TTL_S = 600
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
}


class SignInRequired(Exception):
    """No valid session: pages redirect to the sign-in form, htmx requests get HX-Redirect."""


def csrf_token(session_value: str) -> str:
    return hmac.new(session_value.encode(), b"sluice-console-csrf", hashlib.sha256).hexdigest()


def new_login_nonce() -> str:
    return secrets.token_urlsafe(32)


class ConsoleSessions:
    """Creates, checks and ends console sessions (rows keyed by the SHA-256 of the cookie value)."""

    def __init__(self, session_factory: async_sessionmaker[AsyncSession], ttl_s: float,
                 binding: Callable[[], str] = lambda: "") -> None:
        self._sessions = session_factory
        self.ttl_s = ttl_s
        self._binding = binding  # the admin token's fingerprint (AuthService.admin_binding)

    def _hash(self, value: str) -> str:
        return hash_secret(f"{value}\n{self._binding()}")

    async def start(self) -> str:
        value = secrets.token_urlsafe(32)
        now = utcnow()
        async with self._sessions() as session, session.begin():
            await session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
            session.add(ConsoleSession(hash=self._hash(value), created_at=now,
                                       expires_at=now + dt.timedelta(seconds=self.ttl_s)))
        return value

    async def valid(self, value: str | None) -> bool:
        if not value:
            return False
        async with self._sessions() as session:
            expires = await session.scalar(
                select(ConsoleSession.expires_at).where(ConsoleSession.hash == self._hash(value)))
        return expires is not None and expires > utcnow()

    async def end(self, value: str | None) -> None:
        if value:
            async with self._sessions() as session, session.begin():
                await session.execute(delete(ConsoleSession).where(ConsoleSession.hash == self._hash(value)))

    async def end_all(self) -> int:
        """Ends every session; returns how many there were."""
        async with self._sessions() as session, session.begin():
            result = await session.execute(delete(ConsoleSession))
        return int(getattr(result, "rowcount", 0) or 0)


def session_cookie(value: str, *, secure: bool, max_age: int) -> Cookie:
    return Cookie(key=SESSION_COOKIE, value=value, path=COOKIE_PATH, httponly=True, samesite="strict",
                  secure=secure, max_age=max_age)


def login_cookie(value: str, *, secure: bool) -> Cookie:
    return Cookie(key=LOGIN_COOKIE, value=value, path=COOKIE_PATH, httponly=True, samesite="strict",
                  secure=secure, max_age=LOGIN_COOKIE_TTL_S)


def cleared(key: str) -> Cookie:
    return Cookie(key=key, value="", path=COOKIE_PATH, httponly=True, samesite="strict", max_age=0)


def secure_cookies(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    return bool(services(connection).settings.admin.console_secure_cookie) or connection.url.scheme == "https"


async def console_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A valid session for every console route; and the CSRF header for every state change."""
    sessions: ConsoleSessions = services(connection).console_sessions
    value = connection.cookies.get(SESSION_COOKIE)
    if value is None or not await sessions.valid(value):
        raise SignInRequired()
    if connection.scope.get("method", "GET") not in SAFE_METHODS:
        sent = connection.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(sent.encode(), csrf_token(value).encode()):
            raise OpenAIError(403, "Missing or invalid CSRF token (X-CSRF-Token).", type="permission_error",
                              code="csrf_failed")
    connection.state.console_session = value


def security_headers(app: ASGIApp) -> ASGIApp:
    """Middleware: the security headers on every console answer (errors and static files too)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        static = scope["path"].startswith(f"{COOKIE_PATH}/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableScopeHeaders.from_message(message)
                for name, value in _HEADERS.items():
                    headers[name] = value
                if not static:
                    headers["cache-control"] = "no-store"
            await send(message)

        await app(scope, receive, send_with_headers)

    return wrapped
