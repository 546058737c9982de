"""Files and batches: storage, validation, enqueue, cancellation, finalization.

`create_batch` answers only once every line is durably in Kafka: the batch row is committed
first (status `validating`), then each line is appended to the batch topic (acks=all), then the
status moves to `in_progress`. If the broker fails midway the batch is marked `failed` and the
client gets a 503; lines that did reach Kafka are skipped when consumed (their batch is failed).
Every line gets exactly one `batch_result` row; once all `total` rows exist the batch is
finalized (output and error files written in one transaction).

With several gateway replicas each runs the lines of its own batch-topic partitions (a batch's
lines share its tenant's key, so one partition), whichever replica created the batch: so stopping
a batch (cancelled, its tenant disabled) is announced on the invalidation bus and every replica
ends the lines it holds; a `validating` batch belongs to the replica creating it (`created_by`)
and is failed by another only once that replica's lease has run out; finalization is a
conditional update, so two replicas finishing lines at once finalize once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import undefer

from sluice.gateway.admin.service import tenant_with_quota
from sluice.gateway.auth.service import TenantContext, tenant_context
from sluice.gateway.batches.models import Batch, BatchResult, FileObject
from sluice.gateway.batches.validation import ENDPOINTS, InvalidBatchFile, parse_batch_file
from sluice.gateway.batches.views import (
    batch_of_request,
    batch_view,
    file_view,
    line_request_id,
    not_found,
    page,
)
from sluice.gateway.cluster.invalidation import Change
from sluice.gateway.cluster.shared import SharedState
from sluice.gateway.db.base import new_id, utcnow
from sluice.gateway.edge.errors import OpenAIError, bad_request, service_unavailable
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.queueing.backend import BackendUnavailable
from sluice.gateway.queueing.batch_lines import HeldLines
from sluice.protocol import GenerateRequest, Priority

log = logging.getLogger(__name__)

RUNNABLE = ("validating", "in_progress")
FINAL = ("completed", "failed", "cancelled", "expired")
COMPLETION_WINDOWS = {"24h": dt.timedelta(hours=24)}
ENQUEUE_CONCURRENCY = 64
MAX_METADATA_KEYS = 16
TENANT_DISABLED = "tenant_disabled"
TENANT_DISABLED_MESSAGE = "The tenant was disabled; this request was not run and not billed."
TENANT_DISABLED_ERROR = {"code": TENANT_DISABLED, "param": None, "line": None,
                         "message": "The tenant was disabled; lines that had not run were not run and not billed."}


class BatchService:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        generation: GenerationService,
        backend: Any,
        *,
        max_file_bytes: int,
        max_storage_bytes: int = 2**30,
        shared: SharedState | None = None,
    ) -> None:
        self.sessions = sessions
        self.generation = generation
        self.backend = backend  # KafkaBackend: enqueue_batch_line(), dispatcher
        self.max_file_bytes = max_file_bytes
        self.max_storage_bytes = max_storage_bytes  # per tenant: its uploads and batch outputs together
        # The app's shared state: its replica id, lease (the ledger) and bus.
        self.shared: SharedState = shared if shared is not None else backend.shared
        self._tasks: set[asyncio.Task[None]] = set()
        self.shared.bus.subscribe(self._on_change)

    # ---- files ---------------------------------------------------------------------------------

    async def create_file(
        self, tenant_id: str, filename: str, purpose: str, content: bytes
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise OpenAIError(400, f"purpose must be 'batch', got '{purpose}'.", param="purpose")
        if len(content) > self.max_file_bytes:
            raise OpenAIError(
                400,
                f"The file has {len(content)} bytes; at most {self.max_file_bytes} are allowed.",
                param="file",
            )
        async with self.sessions() as session:
            stored = await session.scalar(select(func.coalesce(func.sum(FileObject.size_bytes), 0))
                                          .where(FileObject.tenant_id == tenant_id))
        if int(stored or 0) + len(content) > self.max_storage_bytes:
            raise OpenAIError(
                400,
                f"Your files take {stored} bytes; with this one ({len(content)} bytes) they would pass your "
                f"storage limit of {self.max_storage_bytes} bytes. Delete files you no longer need.",
                param="file", code="file_storage_exceeded",
            )
        try:
            lines = await asyncio.to_thread(parse_batch_file, content)  # seconds for a large file
        except InvalidBatchFile as exc:
            raise OpenAIError(400, str(exc), param="file", code="invalid_file") from None
        return await self._store_file(tenant_id, filename or "input.jsonl", purpose, content, len(lines))

    async def _store_file(
        self,
        tenant_id: str,
        filename: str,
        purpose: str,
        content: bytes,
        line_count: int,
        session: AsyncSession | None = None,
    ) -> dict[str, Any]:
        row = FileObject(
            id=new_id("file"),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename[:255],
            size_bytes=len(content),
            line_count=line_count,
            created_at=utcnow(),
            content=content,
        )
        if session is not None:
            session.add(row)
            return file_view(row)
        async with self.sessions() as s, s.begin():
            s.add(row)
        return file_view(row)

    async def file_row(self, tenant_id: str, file_id: str, *, content: bool = False) -> FileObject:
        """A tenant's file; its `content` loaded only when asked for."""
        async with self.sessions() as session:
            row = await session.get(FileObject, file_id, options=[undefer(FileObject.content)] if content else [])
        if row is None or row.tenant_id != tenant_id:  # another tenant's file does not exist for you
            raise not_found("file", file_id)
        return row

    async def list_files(
        self,
        tenant_id: str,
        purpose: str | None,
        after: str | None,
        limit: int,
    ) -> dict[str, Any]:
        query = select(FileObject).where(FileObject.tenant_id == tenant_id)
        if purpose:
            query = query.where(FileObject.purpose == purpose)
        rows, has_more = await self._page(query, FileObject, tenant_id, after, limit)
        return page([file_view(r) for r in rows], has_more)

    async def delete_file(self, tenant_id: str, file_id: str) -> dict[str, Any]:
        async with self.sessions() as session, session.begin():
            row = await session.get(FileObject, file_id)
            if row is None or row.tenant_id != tenant_id:
                raise not_found("file", file_id)
            await session.delete(row)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _page(
        self,
        query: Any,
        model: Any,
        tenant_id: str,
        after: str | None,
        limit: int,
    ) -> tuple[list[Any], bool]:
        async with self.sessions() as session:
            if after:
                anchor = await session.get(model, after)
                if anchor is None or anchor.tenant_id != tenant_id:
                    raise not_found(model.__tablename__.replace("batch_", ""), after)
                query = query.where(
                    or_(
                        model.created_at < anchor.created_at,
                        and_(model.created_at == anchor.created_at, model.id < anchor.id),
                    )
                )
            rows = list(
                (
                    await session.scalars(
                        query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)
                    )
                ).all()
            )
        return rows[:limit], len(rows) > limit

    # ---- batches -------------------------------------------------------------------------------

    async def counts(self, batch_id: str, session: AsyncSession | None = None) -> tuple[int, int]:
        query = (
            select(BatchResult.ok, func.count())
            .where(BatchResult.batch_id == batch_id)
            .group_by(BatchResult.ok)
        )
        if session is None:
            async with self.sessions() as s:
                rows = (await s.execute(query)).all()
        else:
            rows = (await session.execute(query)).all()
        by = {bool(ok): n for ok, n in rows}
        return by.get(True, 0), by.get(False, 0)

    async def view(self, row: Batch) -> dict[str, Any]:
        return batch_view(row, *await self.counts(row.id))

    async def batch_row(self, tenant_id: str, batch_id: str) -> Batch:
        async with self.sessions() as session:
            row = await session.get(Batch, batch_id)
        if row is None or row.tenant_id != tenant_id:
            raise not_found("batch", batch_id)
        return row

    async def list_batches(self, tenant_id: str, after: str | None, limit: int) -> dict[str, Any]:
        rows, has_more = await self._page(
            select(Batch).where(Batch.tenant_id == tenant_id), Batch, tenant_id, after, limit
        )
        return page([await self.view(r) for r in rows], has_more)

    async def recent_batches(self, limit: int = 20) -> list[dict[str, Any]]:
        """Every tenant's newest batches with their counts (for admins), in two queries."""
        async with self.sessions() as session:
            rows = list((await session.scalars(
                select(Batch).order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit))).all())
            counts = (await session.execute(
                select(BatchResult.batch_id, BatchResult.ok, func.count())
                .where(BatchResult.batch_id.in_([r.id for r in rows]))
                .group_by(BatchResult.batch_id, BatchResult.ok))).all() if rows else []
        by: dict[tuple[str, bool], int] = {(b, bool(ok)): n for b, ok, n in counts}
        return [{**batch_view(r, by.get((r.id, True), 0), by.get((r.id, False), 0)), "tenant_id": r.tenant_id}
                for r in rows]

    async def tenant_of(self, batch_id: str) -> str:
        """The tenant owning a batch (admins address batches by id alone)."""
        async with self.sessions() as session:
            row = await session.get(Batch, batch_id)
        if row is None:
            raise not_found("batch", batch_id)
        return row.tenant_id

    def _line_request(self, tenant: TenantContext, batch_id: str, line: Any) -> GenerateRequest:
        body = line.body
        if body.n is not None and body.n > 1:  # a line's result holds one request's answer
            raise bad_request("n above 1 is not supported in a batch line: write one line per choice.", "n")
        if line.url == "/v1/chat/completions":
            prepared = self.generation.preparer.prepare_chat(tenant, body)
        else:
            prepared = self.generation.preparer.prepare_completion(tenant, body)
        return msgspec.structs.replace(
            prepared.request,
            request_id=line_request_id(batch_id, line.line_no),
            priority=Priority.BATCH,
            batch_id=batch_id,
            custom_id=line.custom_id,
        )

    def _line_requests(self, tenant: TenantContext, batch_id: str, endpoint: str,
                       content: bytes) -> tuple[list[GenerateRequest], list[dict[str, Any]]]:
        """Every line of an input file as a request, or the errors that fail the batch (CPU only)."""
        errors: list[dict[str, Any]] = []
        requests: list[GenerateRequest] = []
        try:
            lines = parse_batch_file(content)
        except InvalidBatchFile as exc:
            lines = []
            errors = [
                {"code": "invalid_line", "message": m, "param": None, "line": n or None}
                for n, m in exc.errors
            ]
        for line in lines:
            if line.url != endpoint:
                errors.append(
                    {
                        "code": "mismatched_endpoint",
                        "line": line.line_no,
                        "param": "url",
                        "message": f"the line's url {line.url} differs from the batch endpoint {endpoint}",
                    }
                )
                continue
            try:
                requests.append(self._line_request(tenant, batch_id, line))
            except OpenAIError as exc:
                errors.append(
                    {
                        "code": exc.code or "invalid_request",
                        "message": exc.message,
                        "param": exc.param,
                        "line": line.line_no,
                    }
                )
        return requests, errors

    async def create_batch(
        self,
        tenant: TenantContext,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise OpenAIError(
                400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got '{endpoint}'.", param="endpoint"
            )
        window = COMPLETION_WINDOWS.get(completion_window)
        if window is None:
            raise OpenAIError(
                400, f"completion_window must be '24h', got '{completion_window}'.", param="completion_window"
            )
        if metadata is not None and (
            len(metadata) > MAX_METADATA_KEYS
            or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise OpenAIError(
                400,
                "metadata must be at most 16 string pairs (keys up to 64 characters, values up to 512).",
                param="metadata",
            )
        source = await self.file_row(tenant.id, input_file_id, content=True)
        if source.purpose != "batch":
            raise OpenAIError(
                400,
                f"File {input_file_id} has purpose '{source.purpose}', not 'batch'.",
                param="input_file_id",
            )
        batch_id = new_id("batch")
        # Parsing and tokenizing thousands of lines takes seconds: off the event loop.
        requests, errors = await asyncio.to_thread(self._line_requests, tenant, batch_id, endpoint, source.content)
        now = utcnow()
        row = Batch(
            id=batch_id,
            tenant_id=tenant.id,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata_=metadata,
            total=len(requests),
            created_at=now,
            expires_at=now + window,
            status="validating",
            created_by=self.shared.replica,
        )
        if errors:  # OpenAI semantics: the batch exists, failed at validation, with the errors listed
            row.status, row.failed_at, row.errors, row.total = "failed", now, errors[:100], 0
        async with self.sessions() as session, session.begin():
            session.add(row)
        if errors:
            return batch_view(row, 0, 0)
        await self._enqueue_all(batch_id, requests)
        async with self.sessions() as session, session.begin():
            await session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.status == "validating")
                .values(status="in_progress", in_progress_at=utcnow())
            )
            fresh = await session.get(Batch, batch_id)
            assert fresh is not None  # just inserted; internal invariant
            return batch_view(fresh, *await self.counts(batch_id, session))

    async def _enqueue_all(self, batch_id: str, requests: list[GenerateRequest]) -> None:
        # A fixed set of senders takes the lines in turn: one task per line (20,000 of them) would
        # hold the event loop for a second just to create them and take their first steps.
        lines = iter(requests)

        async def sender() -> None:
            for request in lines:
                await self.backend.enqueue_batch_line(request)

        try:
            await asyncio.gather(*(sender() for _ in range(min(ENQUEUE_CONCURRENCY, len(requests)))))
        except BackendUnavailable as exc:
            async with self.sessions() as session, session.begin():
                await session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id)
                    .values(
                        status="failed",
                        failed_at=utcnow(),
                        errors=[
                            {
                                "code": "queue_unavailable",
                                "message": "The request queue was unavailable while the batch was queued.",
                                "param": None,
                                "line": None,
                            }
                        ],
                    )
                )
            log.warning("batch %s could not be queued: %s", batch_id, exc)
            raise service_unavailable("the batch") from exc

    async def cancel_batch(self, tenant_id: str, batch_id: str) -> dict[str, Any]:
        row = await self.batch_row(tenant_id, batch_id)
        if row.status in RUNNABLE:
            async with self.sessions() as session, session.begin():
                await session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id, Batch.status.in_(RUNNABLE))
                    .values(status="cancelling", cancelling_at=utcnow())
                )
            await self._announce_stopped({batch_id})
            await self.maybe_finalize(batch_id)
        elif row.status not in ("cancelling", "cancelled"):
            raise OpenAIError(
                400, f"Cannot cancel a batch whose status is '{row.status}'.", code="invalid_state"
            )
        return await self.view(await self.batch_row(tenant_id, batch_id))

    async def _announce_stopped(self, batch_ids: set[str]) -> None:
        """These batches are cancelling (committed): every replica, this one included, ends the
        lines of them it holds (`_stop_lines`, through the bus)."""
        for batch_id in sorted(batch_ids):
            await self.shared.bus.publish(Change("batch_stopped", batch_id))

    def _on_change(self, change: Change) -> None:
        if change.kind == "batch_stopped":
            self._stop_lines({change.ident})
        elif change.kind == "everything":  # the bus may have missed announcements: ask the database
            task = asyncio.get_running_loop().create_task(self._stop_cancelling())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _stop_cancelling(self) -> None:
        try:
            async with self.sessions() as session:
                ids = set((await session.scalars(select(Batch.id).where(Batch.status == "cancelling"))).all())
        except Exception as exc:  # the database is down too: lines of a missed cancel run to the end
            log.warning("could not look for cancelling batches (%r)", exc)
            return
        if ids:
            self._stop_lines(ids)

    def _stop_lines(self, batch_ids: set[str]) -> None:
        """Lines of these (cancelling) batches queued or running here end now (ABORT → an error
        result row, nothing billed for a line that never ran); lines still in Kafka are answered
        without running when consumed, wherever."""
        dispatcher = self.backend.dispatcher
        jobs = [p.payload for p in dispatcher.scheduler.items()]
        jobs += [j for w in dispatcher.workers.values() for j in w.inflight.values()]
        for job in jobs:
            if job.request.batch_id in batch_ids:
                dispatcher.cancel(job.request_id)

    async def stop_tenant(self, tenant_id: str) -> None:
        """The tenant was disabled: its runnable batches stop now. Lines that have not run are not
        run (nor billed) and are answered `tenant_disabled`; the batch ends `failed` with that error.
        Idempotent."""
        async with self.sessions() as session, session.begin():
            ids = set((await session.scalars(
                select(Batch.id).where(Batch.tenant_id == tenant_id, Batch.status.in_(RUNNABLE))
            )).all())
            if ids:
                await session.execute(
                    update(Batch).where(Batch.id.in_(ids), Batch.status.in_(RUNNABLE))
                    .values(status="cancelling", cancelling_at=utcnow(), errors=[TENANT_DISABLED_ERROR])
                )
        if not ids:
            return
        log.info("tenant %s disabled: stopping %d batch(es)", tenant_id, len(ids))
        await self._announce_stopped(ids)
        for batch_id in ids:
            await self.maybe_finalize(batch_id)

    # ---- results -------------------------------------------------------------------------------

    async def maybe_finalize(self, batch_id: str) -> None:
        """When every line has its result: write the output/error files and end the batch."""
        with contextlib.suppress(_LostRace):
            await self._finalize(batch_id)

    async def _finalize(self, batch_id: str) -> None:
        async with self.sessions() as session, session.begin():
            row = await session.get(Batch, batch_id)
            if row is None or row.status not in (*RUNNABLE, "cancelling", "finalizing"):
                return
            done = await session.scalar(select(func.count()).where(BatchResult.batch_id == batch_id))
            if (done or 0) < row.total:
                return
            target = "cancelled" if row.status == "cancelling" or row.cancelling_at else "completed"
            if target == "cancelled" and stopped_by_tenant_disabled(row):
                target = "failed"
            results = (
                await session.scalars(
                    select(BatchResult).where(BatchResult.batch_id == batch_id).order_by(BatchResult.line_no)
                )
            ).all()
            ok = [r.line for r in results if r.ok]
            bad = [r.line for r in results if not r.ok]
            now = utcnow()
            if target == "completed" and bad and now > row.expires_at:
                target = "expired"  # lines answered `batch_expired` after the completion window
            values: dict[str, Any] = {"status": target, "finalizing_at": row.finalizing_at or now}
            ended_at = {"cancelled": "cancelled_at", "expired": "expired_at", "failed": "failed_at"}
            values[ended_at.get(target, "completed_at")] = now
            if ok:
                values["output_file_id"] = (
                    await self._store_file(
                        row.tenant_id,
                        f"{batch_id}_output.jsonl",
                        "batch_output",
                        ("\n".join(ok) + "\n").encode(),
                        len(ok),
                        session,
                    )
                )["id"]
            if bad:
                values["error_file_id"] = (
                    await self._store_file(
                        row.tenant_id,
                        f"{batch_id}_error.jsonl",
                        "batch_output",
                        ("\n".join(bad) + "\n").encode(),
                        len(bad),
                        session,
                    )
                )["id"]
            # Conditional: two finishing lines racing here finalize once (the loser rolls back).
            result = await session.execute(
                update(Batch).where(Batch.id == batch_id, Batch.status == row.status).values(**values)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                raise _LostRace
        log.info("batch %s %s: %d ok, %d failed", batch_id, target, len(ok), len(bad))

    async def lost_lines(self, settled: Callable[[], Awaitable[HeldLines | None]]) -> list[GenerateRequest]:
        """Lines of running (or cancelling) batches with no result that the gateway does not hold
        once its partitions of the batch queue were read to the end: the queue lost them (a broker
        restarted with memory storage, a topic recreated). Only batches whose lines lie in a
        partition this replica reads are audited (all lines of a batch share its tenant's key, so
        its partition): another replica answers for the rest, and may be running them. Built again
        from the batch's input file, with their original request ids, so a line that was not lost
        after all is answered once anyway.

        The database is read before `settled()` is awaited: every line of a batch that was running
        then had been written to the queue before, so once the queue is read to its end each such
        line is answered, held, or lost."""
        active = ("in_progress", "cancelling")
        async with self.sessions() as session:
            batches = (await session.execute(
                select(Batch.id, Batch.total, Batch.tenant_id).where(Batch.status.in_(active)))).all()
            if not batches:
                return []
            answered = dict((await session.execute(
                select(BatchResult.batch_id, func.count())
                .where(BatchResult.batch_id.in_([b for b, _, _ in batches])).group_by(BatchResult.batch_id)
            )).all())
        settlement = await settled()
        if settlement is None:
            return []
        held = settlement.ids
        held_per_batch = Counter(batch_of_request(r) for r in held)
        lost: list[GenerateRequest] = []
        for batch_id, total, tenant_id in batches:
            if settlement.owns(tenant_id) and answered.get(batch_id, 0) + held_per_batch[batch_id] < total:
                lost += await self._unanswered(batch_id, held)
        return lost

    async def _unanswered(self, batch_id: str, held: frozenset[str]) -> list[GenerateRequest]:
        async with self.sessions() as session:
            batch = await session.get(Batch, batch_id)
            if batch is None or batch.status not in ("in_progress", "cancelling"):
                return []
            done = set((await session.scalars(
                select(BatchResult.custom_id).where(BatchResult.batch_id == batch_id))).all())
            source = await session.get(FileObject, batch.input_file_id, options=[undefer(FileObject.content)])
            found = await tenant_with_quota(session, batch.tenant_id)
        if source is None or found is None:
            log.error("batch %s lost queued lines but its input file or tenant is gone", batch_id)
            return []
        tenant = tenant_context(*found)
        out = []
        for line in parse_batch_file(source.content):
            if line.custom_id in done or line_request_id(batch_id, line.line_no) in held:
                continue
            try:
                out.append(self._line_request(tenant, batch_id, line))
            except OpenAIError:  # valid when the batch was created; e.g. a model since removed
                log.error("batch %s line %d can no longer be prepared", batch_id, line.line_no)
        return out

    async def recover(self) -> None:
        """At start-up: fail batches whose queueing a crash interrupted, and finish batches whose
        results were all stored before a crash."""
        await self.fail_orphaned()
        async with self.sessions() as session:
            ids = (
                await session.scalars(
                    select(Batch.id).where(Batch.status.in_((*RUNNABLE, "cancelling", "finalizing")))
                )
            ).all()
        for batch_id in ids:
            await self.maybe_finalize(batch_id)

    async def fail_orphaned(self) -> int:
        """Fails the `validating` batches whose creating replica is dead (their creator never got
        an answer, and some lines may never have reached Kafka); a live replica's are left to it.
        Returns how many were failed."""
        async with self.sessions() as session:
            rows = (await session.execute(
                select(Batch.id, Batch.created_by).where(Batch.status == "validating"))).all()
        dead = [batch_id for batch_id, creator in rows if not await self._alive(creator)]
        if not dead:
            return 0
        async with self.sessions() as session, session.begin():
            await session.execute(update(Batch).where(Batch.id.in_(dead), Batch.status == "validating").values(
                status="failed", failed_at=utcnow(),
                errors=[{"code": "interrupted", "param": None, "line": None,
                         "message": "The gateway restarted while queueing this batch; submit it again."}]))
        log.warning("failed %d batch(es) whose creating gateway died while queueing them", len(dead))
        return len(dead)

    async def _alive(self, replica: str | None) -> bool:
        """Whether a batch's creator lives: this replica, or one whose lease runs (a row from before
        creators were recorded has none: one gateway made it, now gone). Unknown (the shared store
        unreachable) counts as alive: a batch is never failed on a guess."""
        if replica is None:
            return False
        if replica == self.shared.replica:
            return True
        try:
            return await self.shared.ledger.alive(replica)
        except Exception as exc:
            log.warning("could not tell whether replica %s lives (%r); leaving its batches", replica, exc)
            return True


def stopped_by_tenant_disabled(batch: Batch) -> bool:
    return any(e.get("code") == TENANT_DISABLED for e in batch.errors or ())


class _LostRace(Exception):
    """Another task finalized the batch first."""
