"""A script job's working directory (a zip) on the service host: checked at submit before a
byte is unpacked (declared sizes, count of files, compression ratio, paths), unpacked counting
the real bytes written (a zip's declared sizes can lie), removed when the job ends; and no
trial outlives its job."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipette.errors import SpecError
from service.driver import JobDriver
from service.leasekeeper import LeaseKeeper
from service.migrations import upgrade
from service.models import Job, Trial
from service.repositories import trials
from service.settings import Settings
from tests.service.conftest import JOB_BODY, Api, make_api
from tests.service.script_access import python_open_to_others
from tests.service.test_service_scripts import _allow
from workers.host.workdir import MAX_MEMBERS, unpack

MiB = 1024**2
TRAIN = b"print('train')\n"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    """The API on SQLite with room for a large working directory in a body (its zip's checks are
    what is tested, not the body's limit)."""
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    yield from make_api(url, "sqlite", tmp_path, max_body_bytes=8 * MiB)


def _zip(members: dict[str, bytes], level: int = 9) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _bomb(members: int = 7, size: int = 100 * MiB) -> bytes:
    """``members`` files of ``size`` zeros, deflated (7 x 100 MiB: ~700 KB), streamed in."""
    buffer = io.BytesIO()
    zeros = bytes(MiB)
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("train.py", TRAIN)
        for i in range(members):
            with archive.open(f"data{i}.bin", "w", force_zip64=True) as f:
                for _ in range(size // MiB):
                    f.write(zeros)
    return buffer.getvalue()


def _lying(real: int, declared: int) -> bytes:
    """A zip whose one data file holds ``real`` bytes of random data (compresses 1:1) while its
    directory and local header declare ``declared``."""
    data = bytearray(_zip({"train.py": TRAIN, "data.bin": os.urandom(real)}, level=1))
    central = data.rfind(b"PK\x01\x02")  # the last entry of the directory: data.bin
    struct.pack_into("<I", data, central + 24, declared)
    local = data.rfind(b"PK\x03\x04")
    struct.pack_into("<I", data, local + 22, declared)
    return bytes(data)


def _job(files: bytes) -> dict[str, Any]:
    return {**JOB_BODY, "script": {"argv": ["python", "train.py"], "kind": "deepspeed",
                                   "files": base64.b64encode(files).decode()}}


def _submit(api: Api, home: Path, files: bytes) -> Any:
    tenant = f"t{os.urandom(5).hex()}"
    headers = api.token(tenant)
    api.local_cluster(headers)
    assert _allow(str(api.db.engine.url), home, tenant, "local").returncode == 0
    return api.client.post("/v1/jobs", json=_job(files), headers=headers)


def _jobs(api: Api) -> int:
    with api.db.read() as session:
        return session.query(Job).count()


def test_a_zip_bomb_is_refused_at_submit_with_nothing_unpacked(api: Api, tmp_path: Path) -> None:
    bomb = _bomb()
    assert len(bomb) < 800_000  # the report's bomb: ~714 KB of 7 x 100 MiB
    r = _submit(api, tmp_path, bomb)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "script.files"
    assert error["message"] == "unpacks to 700 MiB, more than the limit of 256 MiB"
    assert _jobs(api) == 0
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(("members", "says"), [
    ({"train.py": TRAIN, **{f"f{i}.py": b"" for i in range(MAX_MEMBERS)}},
     f"holds {MAX_MEMBERS + 1} files, more than the limit of {MAX_MEMBERS}"),
    ({"train.py": TRAIN, "zeros.bin": bytes(20 * MiB)}, "more than the limit of 200 to 1"),
    ({"train.py": TRAIN, "../../etc/cron.d/x": b"x"}, "a path outside the working directory"),
    ({"train.py": TRAIN, "/etc/passwd": b"x"}, "a path outside the working directory"),
])
def test_a_suspicious_zip_is_refused_at_submit(api: Api, tmp_path: Path, members: dict[str, bytes],
                                               says: str) -> None:
    r = _submit(api, tmp_path, _zip(members))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "script.files" and says in error["message"], error
    assert _jobs(api) == 0


def test_unpack_stops_at_the_limit_counting_real_bytes(tmp_path: Path) -> None:
    dest = tmp_path / "workdir"
    with pytest.raises(SpecError, match=r"unpacks to more than 2 MiB") as e:
        unpack(_zip({"a.bin": os.urandom(3 * MiB), "train.py": TRAIN}, level=1), dest, max_bytes=2 * MiB)
    assert e.value.field == "script.workdir"
    assert not dest.exists()


def test_a_zip_whose_sizes_lie_is_refused_mid_unpack_and_removed(tmp_path: Path) -> None:
    dest = tmp_path / "workdir"
    with pytest.raises(SpecError, match=r"is not a readable zip \(Bad CRC-32 for file 'data.bin'\)"):
        unpack(_lying(4 * MiB, 1024), dest)
    assert not dest.exists()


def test_a_job_whose_zip_lies_fails_with_its_folder_removed(api: Api, tmp_path: Path) -> None:
    """Accepted at submit (its declared sizes are small), refused while the driver unpacks it:
    the job fails with one line, and its folder under the service's home is gone."""
    r = _submit(api, tmp_path, _lying(4 * MiB, 1024))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    settings = Settings(database_url=str(api.db.engine.url), home=tmp_path)
    keeper = LeaseKeeper(api.db, "local:test", "test-holder", 30.0)
    with python_open_to_others():  # the script user is checked before the folder is unpacked
        JobDriver(api.db, settings, job_id, keeper, threading.Event()).run()
    with api.db.read() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.state == "failed"
        assert job.error is not None and job.error["field"] == "script.workdir"
        assert "Bad CRC-32" in job.error["message"]
    assert not (tmp_path / "jobs" / job_id).exists()


def test_no_trial_is_left_running_after_its_job_ended(api: Api, tmp_path: Path) -> None:
    """A runner that raised mid-trial (the report's job: its working directory refused while
    shipped) ends the job; its trial, never reported ended, ends with it."""
    r = _submit(api, tmp_path, _zip({"train.py": TRAIN}))
    job_id = r.json()["id"]
    with api.db.write() as session:
        trials.start_trial(session, job_id, 0, label="tp1-pp1-dp2", config={}, predicted_step_time=0.1)
    settings = Settings(database_url=str(api.db.engine.url), home=tmp_path)
    keeper = LeaseKeeper(api.db, "local:test", "test-holder", 30.0)
    driver = JobDriver(api.db, settings, job_id, keeper, threading.Event())
    driver._finish("failed", error={"message": "the working directory is too big", "field": "script.workdir",
                                    "fix": None}, stop_reason="error")
    with api.db.read() as session:
        rows = session.query(Trial).filter(Trial.job_id == job_id).all()
        assert [(t.state, t.error) for t in rows] == [
            ("failed", "the job ended failed: the working directory is too big")]
        assert rows[0].ended_at is not None
