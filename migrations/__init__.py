"""Alembic migrations of the ledger (`refill db upgrade`); see refill.models.migrate."""
