"""Admin API: tenants, keys, quotas, usage, live queues/workers and the audit log."""
