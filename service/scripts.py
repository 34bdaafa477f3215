"""A job's own training script: checked at submit, allowed only where an operator said so, and
unpacked for the driver.

The script runs as the user's code on the cluster's nodes. So a tenant's job may name one only
on a cluster whose operator enabled scripts for that tenant (``pipette-admin cluster
allow-scripts``; a 403 naming the tenant and the cluster otherwise), it runs as an argument list
(never through a shell), as another OS user (``workers.host.script_user``), and its ranks get none
of the service's credentials (``workers.host.script_env``).
"""

from __future__ import annotations

import base64
import binascii
import io
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipette.errors import SpecError
from pipette.registry import TrialKind
from pipette.script import ScriptSpec
from service.errors import ForbiddenError
from service.models import Cluster
from service.schemas import ScriptIn
from workers.host.workdir import check_archive


def check_allowed(cluster: Cluster, tenant: str, kind: TrialKind) -> None:
    """Refuse a job whose trials run the tenant's own code on a cluster not enabled for it."""
    if kind.runs_user_code and not cluster.allow_scripts:
        raise ForbiddenError(
            f"scripts are not enabled for tenant {tenant!r} on cluster {cluster.name!r}", field="script",
            fix=f"ask an operator to run: pipette-admin cluster allow-scripts --tenant {tenant} "
                f"--cluster {cluster.name}",
        )


def script_parts(body: ScriptIn | None) -> tuple[ScriptSpec | None, bytes | None]:
    """The ``ScriptSpec`` (without a working directory: the driver sets it) and the zipped
    working directory; a bad one is a 422 naming the field. None for a job without a script."""
    if body is None:
        return None, None
    spec = ScriptSpec(argv=tuple(body.argv), knobs=dict(body.knobs), autotp=body.autotp, pipeline=body.pipeline,
                      base_config=body.base_config, kind=body.kind, unsupported=tuple(body.unsupported))
    if not body.files:
        if spec.is_python and not spec.program.startswith("/"):
            raise SpecError(f"names {spec.program!r} relative to a working directory, and none was sent",
                            field="script.files", fix="send the working directory (pipette submit does), or give "
                            "the script's absolute path on the nodes")
        return spec, None
    try:
        data = base64.b64decode(body.files, validate=True)
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())
            check_archive(archive)  # sizes, count, ratio, paths: before anything is unpacked
    except (binascii.Error, ValueError, zipfile.BadZipFile) as e:
        raise SpecError(f"is not a base64-encoded zip ({e})", field="script.files",
                        fix="send the working directory as pipette submit does (zip, base64)") from None
    program = spec.program.removeprefix("./")
    if (spec.is_python or "/" in spec.program) and not spec.program.startswith("/") and program not in names:
        raise SpecError(f"the working directory sent has no {program!r}", field="script.argv",
                        fix="give the script's path relative to the working directory")
    return spec, data


def stored(spec: ScriptSpec | None) -> dict[str, Any] | None:
    """The script as a job row keeps it (None: the job runs Pipette's runner)."""
    if spec is None:
        return None
    out = spec.to_dict()
    out.pop("workdir", None)
    return out


def unpack_for_job(script: dict[str, Any] | None, files: bytes | None, home: Path, job_id: str,
                   configured_user: str | None) -> ScriptSpec | None:
    """The job's ``ScriptSpec``, its working directory unpacked under the service's home, run as
    the script user (``workers.host.script_user``: refused here when the service cannot switch).
    None for a job without a script (its row keeps none)."""
    if script is None:
        return None
    from workers.host.script_user import service_script_user
    from workers.host.workdir import unpack

    run_as = service_script_user(configured_user)
    workdir = None
    if files is not None:
        workdir = unpack(files, home / "jobs" / job_id / "workdir")
    return replace(ScriptSpec.from_dict({**script, "workdir": workdir}), run_as=run_as)


def remove_job_files(home: Path, job_id: str) -> None:
    """Remove what the job unpacked under the service's home (its working directory)."""
    shutil.rmtree(home / "jobs" / job_id, ignore_errors=True)
