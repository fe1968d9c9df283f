"""The servers a test session talks to.

`REFILL_TEST_PG_URL` and `REFILL_TEST_REDIS_URL`, when set, name existing servers. When one is
not set, the session starts a throwaway server of its own from the binaries on the machine: a
PostgreSQL (a fresh data directory, trust auth, fsync off) and a Redis (nothing kept on disk),
each on a free port, through pytest-postgresql's and pytest-redis's executors (mirakuru
underneath), and removes it at the end. The session then sets the variable itself, so the tests,
the CLI and the benchmarks they run as subprocesses all find the same servers.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import port_for
import psycopg
from pytest_postgresql.executors import PostgreSQLExecutor
from pytest_redis.executor import RedisExecutor

PG_ENV = "REFILL_TEST_PG_URL"
REDIS_ENV = "REFILL_TEST_REDIS_URL"
HOST = "127.0.0.1"

#: Users the throwaway PostgreSQL runs as when the tests run as root (initdb and postgres
#: refuse root): Debian's postgresql package makes the first, every system has the second.
UNPRIVILEGED_USERS = ("postgres", "nobody")


class MissingBinaries(RuntimeError):
    """A throwaway server is needed and its binary is not on this machine."""


def pg_bindir() -> Path | None:
    """Where pg_ctl, initdb and postgres are: pg_config's answer, then Debian's and other
    distributions' versioned folders (not on PATH), then PATH; None if nowhere."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    # pg_config comes with the client library too: its folder may hold no server.
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin"):
        candidates += sorted(Path("/").glob(pattern.lstrip("/")), key=_version_key, reverse=True)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in ("pg_ctl", "initdb", "postgres")):
            return folder
    return None


def _version_key(folder: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", str(folder)))


def redis_server() -> str | None:
    return shutil.which("redis-server")


def missing_binaries(*, postgresql: bool, redis: bool) -> list[str]:
    """The packages to install for the throwaway servers asked for."""
    missing = []
    if postgresql and pg_bindir() is None:
        missing.append("postgresql")
    if redis and redis_server() is None:
        missing.append("redis-server")
    return missing


def install_line(missing: list[str]) -> str:
    """What a session that lacks `missing` says, in one line."""
    return (
        f"the tests start a throwaway PostgreSQL and Redis: install {' and '.join(missing)} "
        f"(the server binaries), or set {PG_ENV} and {REDIS_ENV} to running servers"
    )


#: Ports this process handed out: the fault suite's Redis takes its port long before it starts.
_handed_out: set[int] = set()


def free_port() -> int:
    """A free port from the ranges IANA leaves unassigned, outside the kernel's ephemeral
    range, so that a client's outgoing connection does not take it before the server binds it;
    never one handed out before in this process, nor by another pytest-xdist worker of the
    session: a worker takes only ports whose remainder by the number of workers is its own
    number. (Each worker names the fault suite's Redis port when it imports the suite and binds
    it minutes later; two workers once drew the same one, and the second worker's fault suite
    found its port taken: eleven errors in one CI run.)"""
    ports = port_for.available_good_ports()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count:
        ports = {port for port in ports if port % int(count) == int(worker.removeprefix("gw"))}
    port = port_for.select_random(ports, exclude_ports=_handed_out)
    _handed_out.add(port)
    return port


def redis_executor(port: int, workdir: Path) -> RedisExecutor:
    """A Redis on 127.0.0.1:`port` that keeps nothing on disk and never drops idle clients."""
    executable = redis_server()
    if executable is None:
        raise MissingBinaries(install_line(["redis-server"]))
    return RedisExecutor(
        executable,
        databases=16,
        redis_timeout=0,
        loglevel="notice",
        host=HOST,
        port=port,
        save="",
        appendonly="no",
        datadir=workdir,
    )


@dataclass
class ThrowawayPostgres:
    """A PostgreSQL cluster in `workdir`, on a free port, with the trust-auth superuser
    `postgres`. As root it runs as an unprivileged user (`run_as`)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    run_as: str | None = None
    executor: PostgreSQLExecutor | None = None
    #: server options on top of initdb's defaults. A throwaway cluster for tests: durability
    #: buys them nothing and costs them time. No autovacuum: a table's statistics are what a
    #: test took (`ANALYZE`), not what a background analyze took at some moment of an earlier
    #: test (a plan test's "no statistics" state was not that in CI). A benchmark that measures
    #: a server as deployed passes "" (`bench scale`).
    options: str = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c autovacuum=off"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/postgres"

    def start(self) -> None:
        bindir = pg_bindir()
        if bindir is None:
            raise MissingBinaries(install_line(["postgresql"]))
        home = self.workdir / "postgresql"
        home.mkdir()
        pg_ctl = str(bindir / "pg_ctl")
        if os.geteuid() == 0:
            self.run_as = unprivileged_user()
            account = pwd.getpwnam(self.run_as)
            os.chmod(self.workdir, 0o711)  # the user must reach its own folder inside
            os.chown(home, account.pw_uid, account.pw_gid)
            pg_ctl = str(as_user_wrapper(self.workdir / "pg_ctl", pg_ctl, self.run_as, home))
        self.executor = PostgreSQLExecutor(
            executable=pg_ctl,
            host=HOST,
            port=self.port,
            datadir=str(home / "data"),
            unixsocketdir=str(home),
            logfile=str(home / "postgresql.log"),
            startparams="-w",
            dbname="postgres",
            user="postgres",
            postgres_options=self.options,
        )
        self.executor.start()
        # The executor returns once pg_ctl reports a server process, which may still be
        # starting up ("the database system is starting up", seen by bench scale's first query).
        self.wait_accepting()

    def restart(self, down_seconds: float) -> float:
        """Stop the server (`pg_ctl stop -m fast`: every connection is dropped at once, as in a
        failover or a minor-version upgrade), stay down `down_seconds`, and start it again on
        the same port and data; returns how long it refused connections."""
        if self.executor is None:
            raise RuntimeError("this PostgreSQL is not running: start() it first")
        started = time.monotonic()
        self.executor.stop()
        time.sleep(down_seconds)
        self.executor.start()  # the data directory is initialised already: only pg_ctl start
        self.wait_accepting()
        return time.monotonic() - started

    def wait_accepting(self, timeout: float = 60) -> None:
        """Until the server accepts connections: the executor returns once pg_ctl reports a
        server process, which may still be starting up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(host=HOST, port=self.port, user="postgres", dbname="postgres", connect_timeout=5).close()
                return
            except psycopg.OperationalError as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL on port {self.port} refused connections for {timeout}s: {error}") from error
                time.sleep(0.1)

    def stop(self) -> None:
        if self.executor is not None:
            # A server that failed to start has nothing to stop (pg_ctl stop would fail).
            if self.executor.running():
                self.executor.stop()
            self.executor.clean_directory()
            self.executor = None

    def log_tail(self, chars: int = 3000) -> str:
        log = self.workdir / "postgresql" / "postgresql.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def unprivileged_user() -> str:
    for name in UNPRIVILEGED_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise MissingBinaries(
        "the tests run as root and PostgreSQL refuses root: create a system user 'postgres' "
        f"(or run the tests as another user), or point {PG_ENV} at a running server"
    )


def as_user_wrapper(path: Path, pg_ctl: str, user: str, home: Path) -> Path:
    """An executable at `path` that runs `pg_ctl` as `user` from `home`, for the executor
    (which runs pg_ctl for initdb, start, status and stop) to use in pg_ctl's place."""
    if shutil.which("setpriv"):
        switch = f"setpriv --reuid={user} --regid={user} --init-groups --"
    elif shutil.which("runuser"):
        switch = f"runuser -u {user} --"
    else:
        raise MissingBinaries(
            "the tests run as root and must start PostgreSQL as another user: install "
            f"util-linux (setpriv), or point {PG_ENV} at a running server"
        )
    # The user may not be allowed into the working directory the tests run from.
    path.write_text(f'#!/bin/sh\ncd "{home}" || exit 1\nexec {switch} "{pg_ctl}" "$@"\n')
    path.chmod(0o755)
    return path


@dataclass
class SessionServices:
    """The servers of one test session: what it was given and what it started."""

    workdir: Path | None = None
    postgres: ThrowawayPostgres | None = None
    redis: RedisExecutor | None = None
    #: the variables this session set, restored when it ends
    set_env: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def start(self) -> None:
        pg_given, redis_given = os.environ.get(PG_ENV), os.environ.get(REDIS_ENV)
        if pg_given:
            self.lines.append(f"PostgreSQL: {PG_ENV} ({_redacted(pg_given)})")
        if redis_given:
            self.lines.append(f"Redis: {REDIS_ENV} ({_redacted(redis_given)})")
        if pg_given and redis_given:
            return
        self.workdir = Path(tempfile.mkdtemp(prefix="refill-test-services-"))
        try:
            self._start_throwaways(start_postgres=not pg_given, start_redis=not redis_given)
        except BaseException:
            self.stop()
            raise

    def _start_throwaways(self, *, start_postgres: bool, start_redis: bool) -> None:
        assert self.workdir is not None
        if start_postgres:
            self.postgres = ThrowawayPostgres(self.workdir)
            try:
                self.postgres.start()
            except MissingBinaries:
                raise
            except Exception as error:  # noqa: BLE001 - re-raised with the server's log
                raise RuntimeError(
                    f"the throwaway PostgreSQL did not start: {error}\n{self.postgres.log_tail()}"
                ) from error
            self._export(PG_ENV, self.postgres.url)
            who = f"; as user {self.postgres.run_as}, since initdb refuses root" if self.postgres.run_as else ""
            self.lines.append(f"PostgreSQL: throwaway on {HOST}:{self.postgres.port}{who}")
        if start_redis:
            port = free_port()
            self.redis = redis_executor(port, self.workdir)
            self.redis.start()
            self._export(REDIS_ENV, f"redis://{HOST}:{port}/0")
            self.lines.append(f"Redis: throwaway on {HOST}:{port}")

    def _export(self, name: str, value: str) -> None:
        os.environ[name] = value
        self.set_env.append(name)

    def stop(self) -> None:
        for name in self.set_env:
            os.environ.pop(name, None)
        self.set_env.clear()
        try:
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
        finally:
            try:
                if self.postgres is not None:
                    self.postgres.stop()
                    self.postgres = None
            finally:
                if self.workdir is not None:
                    shutil.rmtree(self.workdir)
                    self.workdir = None


def _redacted(url: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


__all__ = [
    "MissingBinaries",
    "RedisExecutor",
    "SessionServices",
    "ThrowawayPostgres",
    "free_port",
    "install_line",
    "missing_binaries",
    "pg_bindir",
    "redis_executor",
    "redis_server",
]
