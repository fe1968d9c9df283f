"""A ledger URL or server the CLI cannot use ends the command with one line naming what is
wrong (exit 2), never a traceback, and never prints a password: every command that reads the
ledger (`refill.admin.ledger_access`), `refill db upgrade` and `refill db current`.

Before: an unknown scheme, a driver not installed, a string that is not a URL, a port that is
not a number, a bad connection option or a file that is not a database each printed a
traceback and exited 1 (the code for "checked and wrong"); `refill db` printed one for any
server it could not reach; a server that accepted and never answered held the command forever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.models.db import CONNECT_TIMEOUT_SECONDS
from tests.support.services import free_port

SECRET = "s3cret-pw"
runner = CliRunner()


def refill(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env={"REFILL_DATABASE_URL": None})


def with_password(url: str) -> str:
    """`url` (PostgreSQL, trust auth) with SECRET as its password: ignored by the server."""
    parts = urlsplit(url)
    netloc = parts.netloc.replace("@", f":{SECRET}@", 1) if "@" in parts.netloc else f"postgres:{SECRET}@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"foo://u:{SECRET}@h/x", "no database of scheme 'foo'"),
        (f"postgresql+psycopg2://u:{SECRET}@h/x", "its driver 'psycopg2' is not installed"),
        (f"not a url {SECRET}", "the URL given (not shown: it has no scheme://) is not a database URL"),
        (f"u:{SECRET}@h/x", "is not a database URL"),
        (f"postgresql+psycopg://u:{SECRET}@h:abc/x", "invalid literal for int()"),
        # SQLAlchemy took the password's tail for the host, and every error named it
        (f"postgresql+psycopg://u:pw@{SECRET}@127.0.0.1:1/x", "has '@' in its user or password: write it as %40"),
    ],
)
@pytest.mark.parametrize("command", [("runs",), ("db", "current"), ("db", "upgrade"), ("check", "1")])
def test_a_url_that_is_not_a_ledgers_is_one_line(url: str, says: str, command: tuple[str, ...]) -> None:
    result = refill(*command, "--database-url", url)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert says in result.stderr
    assert "postgresql+psycopg://USER@HOST:PORT/DATABASE or sqlite:///PATH" in result.stderr
    assert SECRET not in result.output
    assert "Traceback" not in result.output


def test_a_server_that_refuses_or_lacks_the_database_is_one_line(pg_url: str) -> None:
    closed = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{free_port()}/x"
    no_database = with_password(pg_url.rsplit("/", 1)[0] + "/refill_no_such_database")
    bad_option = with_password(pg_url) + "?bogus_option=1"
    for url, says in (
        (closed, "Connection refused"),
        (no_database, 'database "refill_no_such_database" does not exist'),
        (bad_option, 'invalid connection option "bogus_option"'),
    ):
        for command in (("runs",), ("db", "current"), ("db", "upgrade")):
            result = refill(*command, "--database-url", url)
            assert result.exit_code == 2, (command, url, result.output)
            assert "error: cannot reach the ledger at " in result.stderr and says in result.stderr, result.stderr
            assert SECRET not in result.output and "***" in result.stderr


def test_a_file_that_is_not_a_database_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "notes.txt"
    path.write_text("not a database, but long enough to be read as one's header\n" * 4)
    result = refill("runs", "--database-url", f"sqlite:///{path}")
    assert result.exit_code == 2, result.output
    assert "cannot reach the ledger at" in result.stderr and "file is not a database" in result.stderr


def test_db_upgrade_creates_a_new_embedded_ledgers_folder_and_names_a_bad_revision(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path}/new/folder/refill.db"
    assert refill("db", "upgrade", "--database-url", url).exit_code == 0
    current = refill("db", "current", "--database-url", url)
    assert current.exit_code == 0 and current.stdout.split()[0] != "none"
    bad = refill("db", "upgrade", "--database-url", f"sqlite:///{tmp_path}/other.db", "--revision", "bogus")
    assert bad.exit_code == 2 and "--revision bogus: Can't locate revision identified by 'bogus'" in bad.stderr


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never says a word (a hung host, a half-open proxy)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def test_a_server_that_never_answers_times_out(silent_server: int) -> None:
    url = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{silent_server}/x"
    # The URL's own timeout wins over refill's default (which this test would wait out).
    started = time.monotonic()
    result = refill("runs", "--database-url", url + "?connect_timeout=2")
    waited = time.monotonic() - started
    assert result.exit_code == 2, result.output
    assert "connection timeout expired" in result.stderr and SECRET not in result.output
    assert 1.5 < waited < CONNECT_TIMEOUT_SECONDS, waited


def test_run_ids_past_the_ledgers_integers_are_refused_before_any_read() -> None:
    """PostgreSQL refused to compare an `integer` column with 2**31 ("integer out of range",
    a traceback, exit 1); an id that large names nothing."""
    for args in (
        ("steps", "2147483648"),
        ("run", "show", "2147483648"),
        ("run", "stop", "0"),
        ("slot", "1", "2147483648", "0"),
        ("runs", "--limit", "99999999999999999999"),
        ("workers", "--since", "1e300"),
    ):
        result = refill(*args, "--database-url", "sqlite:////nonexistent/refill.db")
        assert result.exit_code == 2, (args, result.output)
        assert "Invalid value for" in result.output, (args, result.output)


def test_every_ledger_connection_has_a_connect_timeout_unless_its_url_sets_one(pg_url: str) -> None:
    from refill.models.db import Ledger

    for url, expected in ((pg_url, str(CONNECT_TIMEOUT_SECONDS)), (pg_url + "?connect_timeout=3", "3")):
        ledger = Ledger(url)
        try:
            with ledger.engine.connect() as connection:
                parameters = connection.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
        finally:
            ledger.dispose()
        assert parameters["connect_timeout"] == expected
