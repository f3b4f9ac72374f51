"""A shared MLflow tracking server on 127.0.0.1, backed by PostgreSQL, with a local artifact root.

    python -m harness.records.server --postgres-dir results/postgres            # a local PostgreSQL too
    python -m harness.records.server --backend-store-uri postgresql://user@dbhost:5432/mlflow   # password: ~/.pgpass

then point runs at it: `python run.py ... tracking.uri=http://127.0.0.1:5000`. The server proxies
artifacts (--serve-artifacts), so clients need no access to the artifact folder.

Why PostgreSQL rather than the default SQLite file: many sweeps on many machines write at once, and a
database server handles concurrent writers (SQLite serializes them behind one lock, and its file lock
is unreliable on network filesystems). `--postgres-dir` starts a single-user cluster on 127.0.0.1 for one
box or for tests; a team uses a managed PostgreSQL.

Secrets: the cluster asks for a password (scram-sha-256 on every pg_hba.conf line). Trust auth would make
every local user its superuser, able to run shell commands as the cluster's system user through
`COPY ... PROGRAM`. The password is generated at initdb and kept in `<postgres-dir>/quantbench.pgpass`
(libpq's pgpass format, mode 0600); clients (psql, the MLflow server) find it through PGPASSFILE, so the
database URI carries no password. A URI is never put on a command line, where `ps` shows it to every
user: the MLflow server gets it as MLFLOW_BACKEND_STORE_URI, and printed URIs have their password masked.

PostgreSQL refuses to run as root: as root, the cluster runs as the `postgres` system user that
Debian's package creates (`runuser`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.errors import QuantbenchError
from harness.secret_uri import has_password, redact

PG_USER = "quantbench"  # the cluster's superuser (a role name, not a system user)
PASSWORD_FILE = "quantbench.pgpass"  # in the data dir: `127.0.0.1:*:*:quantbench:<password>`, mode 0600
URI_ENV = "MLFLOW_BACKEND_STORE_URI"  # `mlflow server` reads its --backend-store-uri from here too
# every MLflow server quantbench starts (this module's, `make ui`'s): job execution (GenAI evaluation jobs)
# spawns ~6 extra worker processes; tracking needs none
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str:
    """A PostgreSQL server binary: Debian keeps them in /usr/lib/postgresql/<version>/bin, off PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4])
                   if p.split("/")[4].isdigit() else 0)
    path = found[-1] if found else shutil.which(name)
    if not path:
        raise QuantbenchError(f"PostgreSQL's {name} not found; install it (apt-get install postgresql, or "
                              "scripts/setup.sh --all) or pass --backend-store-uri of an existing server")
    return path


def _run_as() -> str | None:
    """The system user the cluster runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise QuantbenchError("PostgreSQL refuses to run as root and there is no 'postgres' user; create "
                              "one (useradd --system postgres) or run as a normal user") from None
    return "postgres"


def _cmd(args: list[str], user: str | None) -> list[str]:
    return ["runuser", "-u", user, "--", *args] if user else args


@dataclass
class Postgres:
    """A local PostgreSQL cluster in `data_dir`, listening on 127.0.0.1:`port` only."""

    data_dir: Path
    port: int
    user: str | None = None  # system user it runs as (None: this process's user)

    def uri(self, database: str = "mlflow") -> str:
        """No password in it: clients read it from `password_file` (`client_env`)."""
        return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{self.port}/{database}"

    @property
    def password_file(self) -> Path:
        return self.data_dir / PASSWORD_FILE

    def client_env(self) -> dict[str, str]:
        """What a libpq client (psql, psycopg2 under MLflow) needs to log in: the password file's path."""
        return {"PGPASSFILE": str(self.password_file)}

    def start(self, database: str = "mlflow") -> Postgres:
        self.user = _run_as()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)
        os.chmod(self.data_dir, 0o700)
        trust_cluster = False
        if not (self.data_dir / "PG_VERSION").exists():
            password = secrets.token_urlsafe(32)
            with self._secret_for_initdb(password) as pwfile:
                self._check([pg_bin("initdb"), "-D", str(self.data_dir), "-U", PG_USER, "--auth=scram-sha-256",
                             f"--pwfile={pwfile}", "-E", "UTF8", "--no-instructions"], "initdb")
            self._write_password(password)
        elif not self.password_file.exists():
            trust_cluster = True  # made by an older quantbench with --auth=trust: locked below, data kept
        # listen on loopback only; the socket lives in the data dir (no /var/run/postgresql needed)
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.data_dir}"
        self._check([pg_bin("pg_ctl"), "-D", str(self.data_dir), "-l", str(self.data_dir / "server.log"),
                     "-o", opts, "-w", "-t", "60", "start"], "pg_ctl start")
        if trust_cluster:
            self._lock_trust_cluster()
        env = {**os.environ, **self.client_env()}
        exists = subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-w",
                                 "-d", "postgres", "-tAc", f"SELECT 1 FROM pg_database WHERE datname='{database}'"],
                                capture_output=True, text=True, check=False, env=env)
        if exists.stdout.strip() != "1":
            self._check([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-w", database],
                        "createdb", as_user=False, env=env)
        return self

    @contextlib.contextmanager
    def _secret_for_initdb(self, password: str) -> Iterator[Path]:
        """initdb reads the superuser's password from a file (never argv); a private temporary one, readable
        by the system user initdb runs as, deleted right after."""
        folder = Path(tempfile.mkdtemp(prefix="qb-initdb-"))
        path = folder / "pw"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(password + "\n")
            if self.user:
                pw = pwd.getpwnam(self.user)
                for p in (folder, path):
                    os.chown(p, pw.pw_uid, pw.pw_gid)
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _write_password(self, password: str) -> None:
        """The password in libpq's pgpass format, created 0600 (never readable by anyone else, not even
        for a moment), owned by this process's user: the one whose clients connect."""
        tmp = self.password_file.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"127.0.0.1:*:*:{PG_USER}:{password}\n")
        os.replace(tmp, self.password_file)

    def _lock_trust_cluster(self) -> None:
        """Give a trust-auth cluster a password and switch every pg_hba.conf line to scram-sha-256."""
        password = secrets.token_urlsafe(32)
        # the statement goes through stdin: a password in `psql -c` would be on the command line
        sql = f"SET password_encryption = 'scram-sha-256'; ALTER ROLE {PG_USER} PASSWORD '{password}';\n"
        proc = subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-w",
                               "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "-f", "-"],
                              input=sql, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise QuantbenchError(f"could not set a password on the trust-auth cluster in {self.data_dir}: "
                                  f"{proc.stderr.strip()[-300:]}; delete the folder to start a new cluster")
        self._write_password(password)
        hba = self.data_dir / "pg_hba.conf"
        lines = [re.sub(r"\btrust\s*$", "scram-sha-256", ln) if ln.strip() and not ln.lstrip().startswith("#")
                 else ln for ln in hba.read_text().splitlines()]
        hba.write_text("\n".join(lines) + "\n")
        self._check([pg_bin("pg_ctl"), "-D", str(self.data_dir), "reload"], "pg_ctl reload")

    def stop(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            subprocess.run(_cmd([pg_bin("pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "30",
                                 "stop"], self.user), capture_output=True, check=False)

    def _check(self, args: list[str], what: str, as_user: bool = True, env: dict | None = None) -> None:
        proc = subprocess.run(_cmd(args, self.user if as_user else None), capture_output=True, text=True,
                              check=False, env=env)
        if proc.returncode != 0:
            log = self.data_dir / "server.log"
            tail = log.read_text()[-1500:] if log.exists() and os.access(log, os.R_OK) else ""
            raise QuantbenchError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}"
                                  + (f"\n{tail}" if tail else ""))


def backend_uri_for(uri: str) -> str:
    """SQLAlchemy 2.1 maps plain postgresql:// to psycopg 3; the pinned driver is psycopg2(-binary)."""
    if uri.startswith("postgresql://"):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "postgresql+psycopg2://" + uri[len("postgresql://"):]
    return uri


def mlflow_launch(backend_uri: str, artifacts_dir: Path, port: int, workers: int = 2,
                  client_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command line and environment: loopback only, artifacts proxied from a local folder.

    The backend URI travels in the environment (MLflow reads MLFLOW_BACKEND_STORE_URI for
    --backend-store-uri), which only the process's own user can read; a command line any user can.
    """
    cmd = [sys.executable, "-m", "mlflow", "server", "--artifacts-destination", str(Path(artifacts_dir).resolve()),
           "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    env = {**os.environ, **(client_env or {}), URI_ENV: backend_uri_for(backend_uri), **SERVER_ENV}
    return cmd, env


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path and log_path.exists() else ""
            raise QuantbenchError(f"mlflow server exited with code {proc.returncode} before answering\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise QuantbenchError(f"mlflow server at {url} did not answer /health within {timeout_s:.0f}s")


@dataclass
class MlflowServer:
    backend_uri: str
    artifacts_dir: Path
    port: int
    log_path: Path
    workers: int = 2
    proc: subprocess.Popen | None = None
    client_env: dict[str, str] | None = None  # e.g. PGPASSFILE of a local cluster

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # own session: stop() ends the server and all its workers by process group, nothing else
            cmd, env = mlflow_launch(self.backend_uri, self.artifacts_dir, self.port, self.workers, self.client_env)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            wait_healthy(self.url, self.proc, timeout_s, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(8)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@contextlib.contextmanager
def tracking_server(artifacts_dir: Path, log_path: Path, port: int = 0, backend_uri: str = "",
                    postgres_dir: Path | None = None, pg_port: int = 0) -> Iterator[MlflowServer]:
    """Start (PostgreSQL and) the MLflow server; stop everything on exit, also on failure."""
    pg = None
    server = None
    try:
        client_env = None
        if postgres_dir is not None:
            pg = Postgres(Path(postgres_dir), pg_port or free_port()).start()
            backend_uri, client_env = pg.uri(), pg.client_env()
        if not backend_uri:
            raise QuantbenchError("give --backend-store-uri postgresql://... or --postgres-dir DIR")
        server = MlflowServer(backend_uri, Path(artifacts_dir), port or free_port(), Path(log_path),
                              client_env=client_env).start()
        yield server
    finally:
        if server is not None:
            server.stop()
        if pg is not None:
            pg.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.records.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend-store-uri", default="",
                    help=f"postgresql://user@host:port/db, without a password (put it in ~/.pgpass or PGPASSFILE); "
                         f"default ${URI_ENV}, which may hold one")
    ap.add_argument("--postgres-dir", default=None,
                    help="start a local PostgreSQL with its data here (created if empty) and use it")
    ap.add_argument("--postgres-port", type=int, default=5432)
    ap.add_argument("--artifacts-dir", default="results/mlartifacts-server")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--log", default="results/mlflow-server.log")
    args = ap.parse_args(argv)
    if args.backend_store_uri and has_password(args.backend_store_uri):
        print(f"error: --backend-store-uri {redact(args.backend_store_uri)!r} holds a password, which `ps` shows to "
              f"every user; give the URI without it and put the password in ~/.pgpass (or PGPASSFILE), or pass the "
              f"URI in ${URI_ENV}", file=sys.stderr)
        return 2
    if not args.backend_store_uri and not args.postgres_dir:
        args.backend_store_uri = os.environ.get(URI_ENV, "")
    if args.backend_store_uri and args.postgres_dir:
        print("error: give either --backend-store-uri or --postgres-dir, not both", file=sys.stderr)
        return 2
    if args.backend_store_uri and not args.backend_store_uri.startswith(("postgresql", "mysql", "sqlite")):
        print(f"error: --backend-store-uri {redact(args.backend_store_uri)!r} is not a database URI "
              "(postgresql://user@host:port/db)", file=sys.stderr)
        return 2
    def on_term(signum, frame):  # SIGTERM stops like Ctrl-C: the finally blocks stop server and database
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        with tracking_server(Path(args.artifacts_dir), Path(args.log), args.port, args.backend_store_uri,
                             Path(args.postgres_dir) if args.postgres_dir else None, args.postgres_port) as srv:
            print(f"MLflow server ready: {srv.url}  (backend {redact(srv.backend_uri)}, artifacts {srv.artifacts_dir}, "
                  f"log {srv.log_path})\nuse it with: python run.py ... tracking.uri={srv.url}\nCtrl-C stops it.",
                  flush=True)
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1.0)
            print(f"error: mlflow server exited ({srv.proc.returncode if srv.proc else '?'}); see {args.log}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
