"""The OS user a tenant's script runs as in the service: not the service's own.

A script's ranks started as the service's user could read everything the service can: its
processes' environments (``/proc/PID/environ``: the database URL, the metrics token, Ray's
token), Ray's token file, the database file. So the service starts them as an unprivileged user
(``PIPETTE_SCRIPT_USER``; ``nobody`` when the service runs as root and none is set), which needs
root or the capabilities CAP_SETUID, CAP_SETGID and CAP_CHOWN. The files a rank needs (its own
folder, the unpacked working directory, a copy of the DeepSpeed op cache) are handed to that
user; nothing of the service's is. The local CLI runs the user's own script as the caller
(``run_as`` None): there it is no boundary.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipette.errors import SpecError

#: the user scripts run as when the service runs as root and ``PIPETTE_SCRIPT_USER`` is unset
DEFAULT_USER = "nobody"
#: what starting, and stopping, a rank as another user takes (linux/capability.h's bits)
NEEDED_CAPS = {"CAP_CHOWN": 0, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7}
SETTING = "PIPETTE_SCRIPT_USER"


@dataclass(frozen=True)
class ScriptUser:
    name: str
    uid: int
    gid: int


def resolve(name: str) -> ScriptUser:
    """The user named ``name`` on this host; a ``SpecError`` naming the setting when there is
    none, or when it is root (a script as root reads everything)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise SpecError(f"names {name!r}, no user on this host", field=SETTING,
                        fix=f"create it (useradd --system --no-create-home {name}) or name another "
                            "unprivileged user") from None
    if entry.pw_uid == 0 or entry.pw_uid == os.geteuid():
        raise SpecError(f"names {name!r}, which is root or the service's own user", field=SETTING,
                        fix="name an unprivileged user of its own, e.g. nobody")
    return ScriptUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def missing_caps() -> list[str]:
    """The capabilities this process lacks to start a process as another user (none for root)."""
    if os.geteuid() == 0:
        return []
    effective = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
    return [name for name, bit in NEEDED_CAPS.items() if not effective >> bit & 1]


def service_script_user(configured: str | None) -> str:
    """The user a tenant's script runs as, checked before the job runs it: the one configured,
    else ``nobody`` for a service running as root. A service that cannot switch users refuses
    the job (one line, with the fix) instead of running the script as itself."""
    missing = missing_caps()
    if missing:
        raise SpecError(
            f"a tenant's script must run as another user, and this service (uid {os.geteuid()}) cannot switch "
            f"users: it lacks {', '.join(missing)}", field=SETTING,
            fix=f"run pipette-admin serve as root (scripts then run as {DEFAULT_USER}, or as {SETTING}), or give it "
                f"{', '.join(NEEDED_CAPS)} (systemd: AmbientCapabilities=) and set {SETTING} to an unprivileged user")
    user = resolve(configured or DEFAULT_USER)
    check_runs_python(user)
    return user.name


def check_runs_python(user: ScriptUser) -> None:
    """Refuse a user who cannot run this environment's Python (installed under a home of mode
    0700, say): each rank would fail with the same error."""
    try:
        done = subprocess.run([sys.executable, "-c", "pass"], user=user.uid, group=user.gid,
                              extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True,
                              text=True, timeout=120)
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1] if done.returncode else None
    except OSError as e:  # the exec itself was refused
        last = f"{type(e).__name__}: {e.strerror}"
    if last is not None:
        raise SpecError(f"names {user.name!r}, who cannot run this service's Python {sys.executable} ({last})",
                        field=SETTING, fix="install Python and the environment where that user can read them "
                                           "(not under a home of mode 0700), or name a user who can")


def user_home(user: ScriptUser) -> Path:
    """The script user's own folder on this node (its ``HOME``, caches): made, owned by it and
    0700, or refused when something else sits at its path (planted by another local user)."""
    home = Path(tempfile.gettempdir(), f"pipette-script-{user.uid}")
    try:
        home.mkdir(mode=0o700)
        os.chown(home, user.uid, user.gid)
    except FileExistsError:
        st = os.lstat(home)
        if not home.is_dir() or home.is_symlink() or st.st_uid != user.uid:
            raise SpecError(f"{str(home)!r} exists and is not the script user's own folder", field=SETTING,
                            fix=f"remove {home}") from None
    return home


def extensions_copy(user: ScriptUser, source: str) -> str:
    """The DeepSpeed op cache ``source`` (the service's, built before the trials) as the script
    user's own copy: torch writes a lock file in it to load an op, which the service's would not
    let it. Copied once per node (without a build's lock), so no trial builds the op again."""
    dest = user_home(user) / Path(source).name
    if dest.exists() or not Path(source).is_dir():
        return str(dest)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
    shutil.copytree(source, staging / "ext", ignore=shutil.ignore_patterns("lock"), symlinks=True)
    give_to(staging, user)
    try:
        os.rename(staging / "ext", dest)
    except OSError:
        pass  # another rank on this node copied it first
    shutil.rmtree(staging, ignore_errors=True)
    return str(dest)


def give_to(path: str | Path, user: ScriptUser) -> None:
    """Make ``path`` and all under it the user's (symlinks themselves, not what they name)."""
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    for folder, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), user.uid, user.gid, follow_symlinks=False)


def protect_ray_files() -> None:
    """Ray's token file and this node's Ray session folder (logs, sockets): its user's alone.
    Ray writes them with the umask's modes (the token 0644 in ~/.ray), and a script run as
    another user must read neither. Called in the Ray worker that starts the script."""
    import ray

    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    targets = [(token, 0o600)]
    if "RAY_AUTH_TOKEN_PATH" not in os.environ:
        targets.append((token.parent, 0o700))
    node = getattr(ray._private.worker.global_worker, "node", None)
    if node is not None:  # in a Ray process: its node's session folder
        targets.append((Path(node.get_session_dir_path()), 0o700))
    for path, mode in targets:
        try:
            if path.stat().st_uid == os.geteuid():
                path.chmod(mode)
        except OSError:
            pass  # not there: nothing to protect


def as_user_env(env: dict[str, str], user: ScriptUser, home: Path) -> dict[str, str]:
    """``env`` for a process of ``user``: its own home and caches, not the service's."""
    return env | {"HOME": str(home), "USER": user.name, "LOGNAME": user.name,
                  "XDG_CACHE_HOME": str(home / ".cache")}
