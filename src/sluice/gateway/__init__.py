"""The gateway: an OpenAI-compatible front for many tenants, in front of durable queues and workers.

Laid out by what each part does; a folder's `__init__` says what it owns and what it may import.

  app.py       builds the Litestar application: the services, their dependency injection, the routes
  api/         thin controllers of the OpenAI routes (chat, completions, models, usage, tokenize, health)
  edge/        the HTTP edge every route shares: OpenAI errors, strict JSON bodies, OpenAPI, schemas
  auth/        API keys and the admin token (service) and the route guards
  generation/  from a request body to an accepted request, the one record of its state, its end
  streams/     streamed answers: SSE framing, the pump and its followers, the resumable stream log,
               and the takeover of a stream whose replica died (holder, resumer)
  queueing/    Kafka: topics and clients, accepting requests durably, running batch lines
  dispatch/    the fair scheduler, worker slots, the dispatcher and its worker links (tcp, in-process,
               upstream HTTP servers)
  quotas/      quota admission and settlement (ledger in-process or in Redis), usage records
  cluster/     the state gateway replicas share (Redis): leases, pub/sub, invalidations, drain
  admin/ batches/ console/ db/   the admin API, the Batch API, the admin console, the database
  launch/      processes: `sluice serve`, `sluice gateway`, replicas, local workers, the CLI
"""
