"""Thin controllers of the OpenAI-compatible routes and the system routes (health, ready, metrics).

A controller parses and authenticates through its guards and dependencies, calls a service
(generation/, streams/, quotas/) and shapes the answer. It holds no request state of its own.
"""
