"""Security of issue 6: database and broker passwords are never printed, by the CLI or by a
worker's log, whether the password is right (a run goes through) or wrong (errors say so
without it).

The broker password is real: a Redis ACL user made for the test. The database password rides
in the URL to the test PostgreSQL, whose local connections are `trust` in CI (the password is
sent and ignored), so it is checked for leaks, not for authentication.

JSON only on the wire is tests/acceptance/test_wire_format.py; payload size limits and
results for attempts the ledger does not hold are in test_bad_input.py."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from urllib.parse import urlparse

import pytest
import yaml
from sqlalchemy import select
from sqlalchemy.engine import make_url

from refill.models.tables import Run
from tests.support.chaos_fleet import (
    FAULT_RUN,
    REDIS_URL,
    assert_nothing_lost,
    fault_facts,
    redis_client,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults


@pytest.fixture
def secrets(fleet):  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:10]
    user, broker_secret, db_secret = f"refill-faults-{tag}", f"brokerpw-{tag}", f"dbpw-{tag}"
    client = redis_client()
    client.execute_command("ACL", "SETUSER", user, "on", f">{broker_secret}", "~*", "&*", "+@all")
    parsed = urlparse(REDIS_URL)
    broker = f"redis://{user}:{broker_secret}@{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"
    database = make_url(fleet.database_url).set(password=db_secret).render_as_string(hide_password=False)
    try:
        yield {"user": user, "broker": broker, "database": database, "secrets": (broker_secret, db_secret)}
    finally:
        client.execute_command("ACL", "DELUSER", user)
        client.close()


def _assert_secret_free(text: str, secrets: tuple[str, ...], where: str) -> None:
    for secret in secrets:
        assert secret not in text, f"{where} printed a password:\n{text[-3000:]}"


def test_passwords_never_printed(fleet, fault_ledger, secrets) -> None:
    env = {"REFILL_DATABASE_URL": secrets["database"], "REFILL_BROKER_URL": secrets["broker"]}
    hidden = secrets["secrets"]
    config = fleet.write_config(merged(FAULT_RUN, {"grpo": {"max_num_steps": 3}}), name="secrets")

    # `refill config check`, URLs from the environment...
    checked = fleet.cli("config", "check", str(config), env=env)
    assert checked.returncode == 0, checked.stderr
    _assert_secret_free(checked.stdout + checked.stderr, hidden, "refill config check")
    assert f"{secrets['user']}:***@" in checked.stderr
    # ...and written into the file.
    inline = yaml.safe_load(config.read_text())
    inline["infra"].update(database_url=secrets["database"], broker_url=secrets["broker"])
    inline_path = config.with_name("secrets-inline.yaml")
    inline_path.write_text(yaml.safe_dump(inline))
    checked = fleet.cli("config", "check", str(inline_path), env={"REFILL_DATABASE_URL": "", "REFILL_BROKER_URL": ""})
    assert checked.returncode == 0, checked.stderr
    _assert_secret_free(checked.stdout + checked.stderr, hidden, "refill config check (inline)")

    # A worker's startup lines and everything it logs while it serves a run.
    worker = fleet.fresh_name("generate-secret")
    fleet.start("generate", name=worker, env=env)
    assert f"{secrets['user']}:***@" in fleet.log(worker)  # refill's own startup line
    assert f"{secrets['user']}:**@" in fleet.log(worker)  # Celery's banner

    # `refill run start` with both passwords, driving a run on the fleet to the end.
    started = time.monotonic()
    ran = fleet.cli("run", "start", str(config), "--quiet", env=env, timeout=180)
    seconds = time.monotonic() - started
    assert ran.returncode == 0, ran.stdout + ran.stderr
    _assert_secret_free(ran.stdout + ran.stderr, hidden, "refill run start")
    fleet.stop(worker)
    _assert_secret_free(fleet.log(worker), hidden, f"refill worker generate ({worker})")
    with fault_ledger.session() as session:
        run_id = session.scalar(select(Run.id).order_by(Run.id.desc()).limit(1))
        stored = str(session.get(Run, run_id).config)
        facts = fault_facts(session, run_id)
    _assert_secret_free(stored, hidden, "the run's config in the ledger")
    print(facts.line("passwords-in-urls", seconds))
    assert_nothing_lost(facts, steps=3)


def test_wrong_broker_password_is_reported_without_it(fleet, secrets) -> None:
    wrong = f"wrongpw-{uuid.uuid4().hex[:10]}"
    broker = secrets["broker"].replace(secrets["secrets"][0], wrong)
    env = {"REFILL_DATABASE_URL": secrets["database"], "REFILL_BROKER_URL": broker}
    process = fleet.spawn_cli("wrong-password-worker", "worker", "consume", "--hostname", "wrong@test", env=env)
    try:
        deadline = time.monotonic() + 30
        while "invalid username-password pair" not in fleet.log("wrong-password-worker"):
            assert time.monotonic() < deadline, fleet.log("wrong-password-worker")
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    output = fleet.log("wrong-password-worker")
    _assert_secret_free(output, (wrong, *secrets["secrets"]), "refill worker consume (wrong password)")
    assert f"{secrets['user']}:**@" in output
