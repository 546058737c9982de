"""Every service of one gateway process, built once (app.py), and how handlers reach them.

Route handlers receive services by Litestar's dependency injection, by name and type: a handler
that declares `generation: Injected[GenerationService]` gets this process's one
`GenerationService` (`dependencies` maps each field of `Services` to a provider; `Injected` marks
the parameter as a dependency Litestar hands over as it is, without converting it). What Litestar does not inject into,
guards, hooks and exception handlers, asks `services(connection)` for the same typed object: the
one thing the app keeps on its `state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, TypeVar

from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.params import Dependency

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from sluice.gateway.admin.service import AdminService
    from sluice.gateway.auth.service import AuthService
    from sluice.gateway.batches.service import BatchService
    from sluice.gateway.cluster.drain import Drain
    from sluice.gateway.cluster.shared import SharedState
    from sluice.gateway.console.security import ConsoleSessions
    from sluice.gateway.edge.body_decode import BodyJudge
    from sluice.gateway.generation.service import GenerationService
    from sluice.gateway.generation.tokenization import TokenizerRegistry
    from sluice.gateway.queueing.backend import GenerationBackend
    from sluice.gateway.quotas.service import QuotaService
    from sluice.gateway.quotas.usage import UsageService
    from sluice.gateway.streams.hub import StreamHub
    from sluice.settings import Settings


T = TypeVar("T")
Injected: TypeAlias = Annotated[T, Dependency(skip_validation=True)]


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    backend: GenerationBackend
    session_factory: async_sessionmaker[AsyncSession]
    shared: SharedState  # what replicas share (cluster/shared.py)
    auth: AuthService
    usage: UsageService
    quotas: QuotaService
    tokenizers: TokenizerRegistry
    generation: GenerationService
    streams: StreamHub
    drain: Drain
    body_judge: BodyJudge
    admin: AdminService
    console_sessions: ConsoleSessions
    batches: BatchService | None  # None: the Batch API is not served by this app
    started_at: int  # unix s: the `created` of /v1/models' cards


def services(of: ASGIConnection[Any, Any, Any, Any] | Litestar) -> Services:
    """The services of an app (or of a connection's app), for a guard, hook or exception handler,
    or a startup hook (handlers get them injected)."""
    app = of if isinstance(of, Litestar) else of.app
    found: Services = app.state.services
    return found


def dependencies(built: Services) -> dict[str, Provide | Callable[..., Any]]:
    """A provider per service, by its field name (the handler parameter that receives it), and
    `services` for a handler that needs several."""

    def constant(value: Any) -> Provide:
        def provide() -> Any:
            return value

        return Provide(provide, use_cache=True, sync_to_thread=False)

    provided = {field.name: constant(getattr(built, field.name)) for field in fields(built)}
    return {"services": constant(built), **provided}
