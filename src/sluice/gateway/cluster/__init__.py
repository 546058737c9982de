"""What gateway replicas share (`shared.py` builds it from `[shared]`): Redis clients, the Lua
scripts of the shared ledger, slots and fairness (`redis_scripts.py`), pub/sub (`pubsub.py`), cache
invalidations (`invalidation.py`), and a replica's drain on SIGTERM (`drain.py`)."""
