"""One file per revision; Alembic loads them by path."""
