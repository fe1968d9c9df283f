"""Least privilege (issue 20): `refill db roles` makes the read-only role people query the
ledger with. A login role made its member runs every query of docs/sql.md and can change
nothing: no writes, no new objects, no role's secrets.

Roles belong to the whole server, so this runs on the fault suite's own PostgreSQL (a
throwaway server), never on one the session was given."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.models.tables import Base, Run
from tests.acceptance.test_cli_inspect import DOCS_SQL
from tests.support.chaos_fleet import FAULT_POSTGRES

pytestmark = pytest.mark.faults

runner = CliRunner()


@pytest.fixture
def person(faults_db: str) -> Iterator[tuple[str, Engine]]:
    """A login role for one person, and an engine that connects as that person."""
    name = f"analyst_{uuid.uuid4().hex[:8]}"
    admin = create_engine(FAULT_POSTGRES.admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{name}" LOGIN'))
    engine = create_engine(make_url(faults_db).set(username=name))
    try:
        yield name, engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP OWNED BY "{name}"'))
            conn.execute(text(f'DROP ROLE "{name}"'))
        admin.dispose()


def roles(faults_db: str, *args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["db", "roles", "--database-url", faults_db, *args])


def refused(engine: Engine, statement: str) -> str:
    """The error `statement` fails with (a test failure if it succeeds)."""
    with pytest.raises(DBAPIError) as error, engine.begin() as conn:
        conn.execute(text(statement))
    return str(error.value.orig)


def test_the_read_only_role(faults_db: str, fault_ledger, person) -> None:
    name, engine = person
    first = roles(faults_db, "--grant-to", name)
    assert first.exit_code == 0, first.output
    assert "refill_reader created" in first.output or "refill_reader already there" in first.output
    again = roles(faults_db, "--grant-to", name)  # idempotent
    assert again.exit_code == 0 and "already there" in again.output, again.output

    # Every query people are shown runs (on the fault suite's runs, or none: they must run).
    with fault_ledger.session() as session:
        run_id = session.query(Run.id).order_by(Run.id).limit(1).scalar() or 1
    blocks = re.findall(r"```sql\n(.*?)```", DOCS_SQL.read_text(), re.S)
    assert len(blocks) >= 10
    with engine.connect() as conn:
        for block in blocks:
            params = {k: v for k, v in {"run": run_id, "step": 1, "slot": 0}.items() if f":{k}" in block}
            conn.execute(text(block), params).all()
        for table in Base.metadata.sorted_tables:
            conn.execute(text(f"SELECT * FROM {table.name} LIMIT 1")).all()

    # And it can change nothing.
    assert "permission denied" in refused(engine, "UPDATE runs SET status = status")
    assert "permission denied" in refused(engine, "DELETE FROM attempts")
    assert "permission denied" in refused(engine, "INSERT INTO rejected_results (reason, detail) VALUES ('unknown', 'x')")
    assert "permission denied" in refused(engine, "TRUNCATE outbox")
    assert "permission denied" in refused(engine, "SELECT * FROM runs FOR UPDATE")
    assert "permission denied" in refused(engine, "CREATE TABLE mine (x int)")
    assert "must be owner" in refused(engine, "DROP VIEW step_summary")
    assert "permission denied" in refused(engine, "SELECT rolname, rolpassword FROM pg_authid")


def test_roles_refuses_bad_input(faults_db: str, tmp_path) -> None:
    missing = roles(faults_db, "--grant-to", "nobody_here_at_all")
    assert missing.exit_code == 2 and "no role nobody_here_at_all" in missing.output, missing.output
    bad = roles(faults_db, "--reader", 'x"; DROP TABLE runs; --')
    assert bad.exit_code == 2 and "is not a role name" in bad.output, bad.output
    lite = roles(f"sqlite:///{tmp_path}/ledger.db")
    assert lite.exit_code == 2 and "need a PostgreSQL ledger" in lite.output, lite.output
