"""The gateway's Litestar application: OpenAI routes, admin API, admin console, health, metrics.

`create_app` builds every service once (`Services`, gateway/services.py), gives each to the
handlers that declare it (dependency injection by name and type), and runs their start and stop
in order. With `batches` (gateway/batches/__init__.py) it serves the Batch API too: its service
is built here with the others and its line runner joins the Kafka backend.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from litestar import Litestar
from litestar.config.app import AppConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice import telemetry, tracing
from sluice.gateway.admin.controllers import AdminController
from sluice.gateway.admin.seed import seed_tenants
from sluice.gateway.admin.service import AdminService
from sluice.gateway.api.openai import OpenAIController
from sluice.gateway.api.system import health, metrics, ready
from sluice.gateway.api.tokenize import TokenizeController
from sluice.gateway.auth.service import AuthService
from sluice.gateway.cluster.deployment import deployment_id
from sluice.gateway.cluster.drain import Drain
from sluice.gateway.cluster.shared import SharedState, open_shared
from sluice.gateway.console import console_route_handlers, template_config
from sluice.gateway.console.security import ConsoleSessions
from sluice.gateway.db.migrate import migrate
from sluice.gateway.db.session import make_engine, make_session_factory
from sluice.gateway.edge.body_decode import BodyJudge
from sluice.gateway.edge.errors import EXCEPTION_HANDLERS
from sluice.gateway.edge.json_body import strict_json_body
from sluice.gateway.edge.methods import OptionsMiddleware
from sluice.gateway.edge.openapi import COMPONENTS, ContractJsonPlugin
from sluice.gateway.edge.tracing import TracingMiddleware
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
from sluice.gateway.queueing.backend import GenerationBackend
from sluice.gateway.quotas.service import QuotaService
from sluice.gateway.quotas.usage import UsageService
from sluice.gateway.services import Services, dependencies
from sluice.gateway.streams.hub import StreamHub
from sluice.settings import Settings

if TYPE_CHECKING:
    from sluice.gateway.batches import BatchComponents

log = logging.getLogger(__name__)

Hook = Callable[[Litestar], Any]


async def _load_tokenizers(backend: GenerationBackend, registry: TokenizerRegistry) -> None:
    for model in backend.served_models():
        if model.name in registry:
            continue
        shared = getattr(backend, "tokenizer", None)  # LocalEngineBackend shares its engine's tokenizer
        if callable(shared):
            registry.add(ModelTokenizer(model.name, shared(model.name), model.max_model_len,
                                        tool_parser=model.tool_parser))
        else:
            registry.add(await asyncio.to_thread(ModelTokenizer.load, model.name, model.path, model.max_model_len,
                                                 tool_parser=model.tool_parser))


def build_services(settings: Settings, backend: GenerationBackend, *,
                   session_factory: async_sessionmaker[AsyncSession], shared: SharedState,
                   batches: BatchComponents | None) -> Services:
    """Every service of the process, once, in dependency order."""
    gw = settings.gateway
    auth = AuthService(session_factory, cache_ttl_s=gw.key_cache_ttl_s, bus=shared.bus,
                       sign_ins=shared.sign_in_limiter(settings.admin.max_failed_sign_ins))
    usage = UsageService(session_factory)
    quotas = QuotaService(usage.day_total, ledger=shared.ledger)
    tokenizers = TokenizerRegistry()
    generation = GenerationService(backend, tokenizers, quotas, usage, request_timeout_s=gw.request_timeout_s,
                                   max_prompt_chars=gw.max_prompt_chars, max_messages=gw.max_messages,
                                   max_n=gw.max_n, objectives=settings.objectives)
    streams = StreamHub(shared.stream_log, generation.flights, generation.spawn, grace_s=gw.disconnect_grace_s)
    admin = AdminService(session_factory, auth, usage.flush)
    shared.bus.subscribe(streams.on_change)  # a tenant's streams stop on every replica (docs/streams.md)
    batch_service = None
    if batches is not None:
        batch_service = batches.build(settings, session_factory, generation, backend, shared, quotas, usage, admin)
    return Services(
        settings=settings, backend=backend, session_factory=session_factory, shared=shared, auth=auth,
        usage=usage, quotas=quotas, tokenizers=tokenizers, generation=generation, streams=streams,
        drain=Drain(gw.drain_timeout_s), body_judge=BodyJudge(), admin=admin,
        console_sessions=ConsoleSessions(session_factory, settings.admin.console_session_ttl_s, auth.admin_binding),
        batches=batch_service, started_at=int(time.time()),
    )


def _takeover(services: Services) -> None:
    """With the Kafka backend and shared state, streams of lost replicas go on here."""
    holder = getattr(services.backend, "holder", None)
    if holder is None:
        return
    from sluice.gateway.streams.resumer import StreamResumer

    holder.bind(StreamResumer(services.streams, services.generation, services.auth,
                              services.backend, holder))  # type: ignore[arg-type]


def create_app(
    settings: Settings,
    backend: GenerationBackend,
    *,
    session_factory: async_sessionmaker[AsyncSession] | None = None,
    batches: BatchComponents | None = None,
    on_startup: Sequence[Hook] = (),
    on_shutdown: Sequence[Hook] = (),
    announce_secret: Callable[[str, str], None] | None = None,
    shared: SharedState | None = None,
) -> Litestar:
    """Builds the app. Without `session_factory` it opens settings.database.url and migrates it at startup.

    `announce_secret(kind, value)` receives a generated admin token ("admin_token") once, for
    `sluice serve` to show; it is never logged. `shared`: the state replicas share, one per process
    (`sluice serve` passes the one its backend uses, so both file under one replica id); the app
    starts it (before the backend) and stops it (after).
    """
    owned_engine = None
    if session_factory is None:
        owned_engine = make_engine(settings.database.url, echo=settings.database.echo)
        session_factory = make_session_factory(owned_engine)
    if shared is None:
        shared = open_shared(settings.shared, stream_retention_s=settings.gateway.stream_retention_s)
    services = build_services(settings, backend, session_factory=session_factory, shared=shared, batches=batches)
    _takeover(services)

    async def startup(app: Litestar) -> None:
        if owned_engine is not None:
            await migrate(settings.database.url)
        telemetry.configure(settings.gateway.record_log_path, settings.gateway.metrics_max_tenants)
        await services.shared.start(await deployment_id(session_factory))
        generated = await services.auth.ensure_admin_token(settings.admin.token)
        await seed_tenants(services.admin, settings.tenants)
        if generated and announce_secret is not None:
            announce_secret("admin_token", generated)
        await backend.start()
        await _load_tokenizers(backend, services.tokenizers)
        if batches is not None:
            await batches.start()
        # What startup loaded (torch, tokenizers, the ORM) lives as long as the process: out of the
        # collector's sight, a full collection walks only what requests create (it was ~0.5 s, with
        # the GIL held, while a 20,000-line batch was created).
        gc.collect()
        gc.freeze()
        log.info("gateway ready: models %s", ", ".join(services.tokenizers.names()) or "(none)")

    async def shutdown(app: Litestar) -> None:
        if batches is not None:
            await batches.stop()
        await services.streams.stop()
        await backend.stop()
        await services.generation.drain()
        await services.shared.stop()
        await services.usage.close()
        await services.auth.drain()
        services.body_judge.close()
        gc.unfreeze()  # what startup loaded may be collected again (native extensions check at exit)
        if owned_engine is not None:
            await owned_engine.dispose()

    # Tracing is per process: the first app that enables it starts the exporter (sluice/tracing.py).
    traced = settings.tracing.enabled and (tracing.enabled() or tracing.configure(
        True, settings.tracing.otlp_endpoint, "sluice-gateway", settings.tracing.sample_ratio))
    config = AppConfig(
        route_handlers=[
            OpenAIController, TokenizeController, AdminController, *console_route_handlers(), health, ready,
            metrics, *(batches.route_handlers if batches is not None else ()),
        ],
        dependencies=dependencies(services),
        template_config=template_config(),
        on_startup=[startup, *on_startup],
        on_shutdown=[*on_shutdown, shutdown],
        exception_handlers=EXCEPTION_HANDLERS,
        before_request=strict_json_body,
        state=State({"services": services}),
        request_max_body_size=settings.gateway.max_body_bytes,
        middleware=[OptionsMiddleware(), *([TracingMiddleware()] if traced else [])],
        openapi_config=OpenAPIConfig(
            title="sluice gateway",
            version="0.1.0",
            path="/schema",
            components=COMPONENTS,
            # The Swagger UI's scripts come from a CDN onto this origin: only when asked for.
            render_plugins=[*([SwaggerRenderPlugin()] if settings.gateway.swagger_ui else []), ContractJsonPlugin()],
        ),
        debug=False,
    )
    return Litestar.from_config(config)
