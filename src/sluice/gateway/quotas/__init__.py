"""Quotas and usage: admission and settlement (`service.py`) over a ledger in this process
(`ledger.py`) or shared by replicas in Redis (`redis_ledger.py`), and the usage rows (`usage.py`).
May import edge/, auth/ (the tenant context) and cluster/."""
