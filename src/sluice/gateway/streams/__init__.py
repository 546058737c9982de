"""Streamed answers that outlive their connection.

`frames.py` turns deltas into SSE events; `hub.py` runs a stream's pump and its followers;
`log.py` keeps every event of a stream (in-process or in Redis) for clients that attach again;
`holder.py` and `resumer.py` are the two halves of a replica takeover: holding a stream's Kafka
record until its log ends, and continuing a stream whose replica died; `response.py` writes the
SSE events to the client. May import generation/, edge/, quotas/ and queueing.backend.
"""
