"""Gateway persistence: SQLAlchemy 2 async models, sessions and Alembic migrations."""
