"""Who is calling: API keys and the admin token (`service.py`: hashed storage, cached constant-time
lookup, invalidation across replicas) and the route guards built on it (`guards.py`)."""
