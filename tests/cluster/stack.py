"""deploy/docker-compose.yml's processes, run as plain processes in the shaped cluster.

No container engine runs here, so the compose file's wiring (commands, environment variables,
ports, the migration step) is proven by running what its services run, read from the file
itself, with the hosts the compose network would resolve mapped to the shaped cluster's:

=============  =========================================================================
postgres       a PostgreSQL server of its own in host 0 (``initdb`` + ``postgres``), with
               the compose file's user, database and password (scram), like the image's
migrate        the file's command and environment, run to completion before the others
api            the file's command and environment (``PIPETTE_SCHEDULER=0``), in host 0
scheduler      the file's command and environment (Ray Client ``ray://HEAD:10001``, the
               auth token), in host 0: it is not a Ray node, as in the compose file
ray-head/-wor  the shaped cluster's own Ray nodes; the test asserts they use the compose
               file's ports (``ShapedCluster`` starts them with per-host resources)
=============  =========================================================================

Each process gets only the compose environment plus ``PATH``, ``HOME``, ``PYTHONPATH`` (the
repository), ``TMPDIR`` (its host's) and ``LANG``: nothing leaks from the test's environment.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tests.cluster.shaped import REPO, ShapedCluster
from tests.deploy.compose import load, service_env

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), Path("/usr/bin"))
#: the compose network's host names, and the shaped cluster's host each one is in
HOST_OF = {"postgres": 0, "ray-head": 0, "migrate": 0, "api": 0, "scheduler": 0}


class StackError(RuntimeError):
    pass


def parse_json(out: subprocess.CompletedProcess[str]) -> Any:
    """The JSON document a CLI command printed (after any warnings on earlier lines)."""
    assert out.returncode == 0, out.stdout[-3000:]
    text = out.stdout
    starts = [i for i, line in enumerate(text.splitlines(keepends=True)) if line.startswith(("{", "["))]
    assert starts, text[-3000:]
    offset = sum(len(line) for line in text.splitlines(keepends=True)[:starts[0]])
    return json.JSONDecoder().raw_decode(text[offset:])[0]


@dataclass
class ComposeStack:
    cluster: ShapedCluster
    work: Path
    password: str = field(default_factory=lambda: secrets.token_hex(12))
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    compose: dict[str, Any] = field(default_factory=dict)
    pg_dir: Path | None = None

    def __post_init__(self) -> None:
        token = self.cluster.token_path.read_text().strip() if self.cluster.token_path.exists() else "0" * 64
        self.compose = load({"POSTGRES_PASSWORD": self.password, "RAY_AUTH_TOKEN": token})

    # ---- what the compose file says -------------------------------------------------------
    def service(self, name: str) -> dict[str, Any]:
        return dict(self.compose["services"][name])

    def address_of(self, name: str) -> str:
        return self.cluster.address(HOST_OF[name])

    def env(self, name: str) -> dict[str, str]:
        """The service's compose environment with the compose network's names resolved to the
        shaped cluster's addresses, plus the bare minimum to run a Python process here."""
        env = service_env(self.service(name))
        for key, value in env.items():
            for host in ("postgres", "ray-head"):
                value = value.replace(f"@{host}:", f"@{self.address_of(host)}:")
                value = value.replace(f"//{host}:", f"//{self.address_of(host)}:")
            env[key] = value
        base = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.work / "home"),
                "PYTHONPATH": str(REPO), "TMPDIR": str(self.cluster.host_tmp(HOST_OF[name])), "LANG": "C.UTF-8"}
        return base | env

    def argv(self, name: str) -> list[str]:
        command = [str(x) for x in self.service(name)["command"]]
        return [sys.executable if command[0] == "python" else command[0], *command[1:]]

    # ---- life cycle -------------------------------------------------------------------------
    def up(self) -> ComposeStack:
        try:
            (self.work / "home").mkdir(parents=True, exist_ok=True)
            self._postgres()
            migrate = self.run("migrate", self.argv("migrate"), timeout=180)
            if migrate.returncode != 0:
                raise StackError(f"migrate exited {migrate.returncode}:\n{migrate.stdout[-3000:]}")
            self.start("api")
            self.start("scheduler")
            self.wait_healthy("api", timeout_s=120)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.procs.pop(name)
        if self.pg_dir is not None:
            shutil.rmtree(self.pg_dir, ignore_errors=True)
            self.pg_dir = None

    def start(self, name: str) -> subprocess.Popen[str]:
        return self._spawn(name, self.argv(name), self.env(name))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[str]:
        """``argv`` in the host of ``name``, its output in ``WORK/NAME.log``, kept until ``down``."""
        log = self.work / f"{name}.log"
        self.logs[name] = log
        out: TextIO = log.open("w")
        proc: subprocess.Popen[str] = subprocess.Popen(
            self.cluster.command(HOST_OF[name], argv), env=env, cwd=REPO, text=True, stdout=out,
            stderr=subprocess.STDOUT)
        out.close()
        self.procs[name] = proc
        return proc

    def run(self, name: str, argv: list[str], *, timeout: float,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` in the host of ``name`` with that service's environment (plus ``env``)."""
        return subprocess.run(self.cluster.command(HOST_OF[name], argv), env={**self.env(name), **(env or {})},
                              cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)

    def log(self, name: str) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-4000:] if path and path.exists() else ""

    def wait_healthy(self, name: str, timeout_s: float) -> None:
        """Run the service's compose healthcheck in its host until it passes."""
        test = [str(x) for x in self.service(name)["healthcheck"]["test"]]
        argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
        argv = [sys.executable if a == "python" else a for a in argv]
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise StackError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            out = self.run(name, argv, timeout=30)
            if out.returncode == 0:
                return
            last = out.stdout
            time.sleep(1)
        raise StackError(f"{name}'s healthcheck still fails after {timeout_s:g} s: {last[-1000:]}\n{self.log(name)}")

    # ---- PostgreSQL, as the postgres image starts it --------------------------------------------
    def _postgres(self) -> None:
        env = service_env(self.service("postgres"))
        user, db, password = env["POSTGRES_USER"], env["POSTGRES_DB"], env["POSTGRES_PASSWORD"]
        # the server runs as postgres, which cannot enter pytest's private temp folders
        self.pg_dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.prefix}-pg-"))
        data = self.pg_dir / "pgdata"
        data.mkdir()
        pwfile = self.pg_dir / "pgpass"
        pwfile.write_text(password + "\n")
        for path in (self.pg_dir, data, pwfile):
            shutil.chown(path, "postgres", "postgres")
        self.pg_dir.chmod(0o700)
        as_pg = ["runuser", "-u", "postgres", "--"]
        init = subprocess.run([*as_pg, str(PG_BIN / "initdb"), "-D", str(data), "-U", user, f"--pwfile={pwfile}",
                               "--auth-local=trust", "--auth-host=scram-sha-256"],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        if init.returncode != 0:
            raise StackError(f"initdb failed:\n{init.stdout[-3000:]}")
        with (data / "pg_hba.conf").open("a") as hba:  # the image's rule: any host, with the password
            hba.write("host all all all scram-sha-256\n")
        self._spawn("postgres", [*as_pg, str(PG_BIN / "postgres"), "-D", str(data), "-k", str(data),
                                 "-h", self.address_of("postgres"), "-p", "5432"], env=None)
        # the compose healthcheck (pg_isready -U USER -d DB), over the network as the others connect
        deadline = time.monotonic() + 60
        ready = ["pg_isready", "-h", self.address_of("postgres"), "-p", "5432", "-U", user, "-d", "postgres"]
        while subprocess.run(self.cluster.command(0, [str(PG_BIN / ready[0]), *ready[1:]]),
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.procs["postgres"].poll() is not None:
                raise StackError(f"PostgreSQL did not start:\n{self.log('postgres')}")
            time.sleep(0.5)
        created = subprocess.run(
            self.cluster.command(0, [str(PG_BIN / "createdb"), "-h", self.address_of("postgres"), "-U", user, db]),
            env={"PGPASSWORD": password, "PATH": os.environ.get("PATH", "")}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        if created.returncode != 0:
            raise StackError(f"createdb {db} failed:\n{created.stdout}")

    # ---- the CLI client and the API, from host 0 ------------------------------------------------
    def get(self, token: str, path: str) -> Any:
        """``GET path`` of the API, from host 0 (the test itself is not in the cluster's network)."""
        code = ("import sys, urllib.error, urllib.request\n"
                "r = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + sys.argv[2]})\n"
                "try:\n    sys.stdout.write(urllib.request.urlopen(r, timeout=30).read().decode())\n"
                "except urllib.error.HTTPError as e:\n    sys.exit(f'{e.code}: {e.read().decode()[:1000]}')\n")
        out = self.run("api", [sys.executable, "-c", code, f"http://{self.address_of('api')}:8000{path}", token],
                       timeout=60)
        if out.returncode != 0:
            raise StackError(f"GET {path} failed:\n{out.stdout[-2000:]}")
        return json.loads(out.stdout)

    def pipette(self, token: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``pipette ARGS`` in host 0, pointed at the API with ``token``."""
        return self.run("api", self._pipette_argv(args), timeout=timeout, env=self._client_env(token))

    def popen_pipette(self, token: str, *args: str) -> subprocess.Popen[str]:
        """``pipette ARGS`` in host 0, running on (stdout and stderr in one pipe)."""
        return subprocess.Popen(self.cluster.command(HOST_OF["api"], self._pipette_argv(args)),
                                env={**self.env("api"), **self._client_env(token)}, cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    @staticmethod
    def _pipette_argv(args: tuple[str, ...]) -> list[str]:
        return [str(Path(sys.executable).with_name("pipette")), *args]

    def _client_env(self, token: str) -> dict[str, str]:
        return {"PIPETTE_URL": f"http://{self.address_of('api')}:8000", "PIPETTE_TOKEN": token,
                "PIPETTE_CONFIG": str(self.work / "home" / "pipette.json")}


