"""deploy/Dockerfile, linted without a container engine: parsed with ``dockerfile-parse`` and
checked against the hadolint rules that matter here (their DL numbers), plus what only this
repository can check: every COPY source exists in the build context, the variants install the
pinned torch, and the ports match what compose and Kubernetes use."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    parser = dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text.encode()))
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def _arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for op, value in steps:
        if op == "ARG" and "=" in value:
            name, default = value.split("=", 1)
            out[name.strip()] = default.strip()
    return out


def lint(text: str, context: Path = REPO) -> list[str]:
    """Problems of a Dockerfile, one line each; empty when it passes."""
    steps = instructions(text)
    args = _arg_defaults(steps)
    problems: list[str] = []
    froms = [v for op, v in steps if op == "FROM"]
    if not froms:
        return ["no FROM"]
    for value in froms:
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), value.split()[0])
        if ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
            problems.append(f"DL3006 FROM {value}: tag the image version explicitly")
        if image.endswith(":latest"):
            problems.append(f"DL3007 FROM {value}: do not use :latest")
    shell_pipefail = False
    for op, value in steps:
        if op == "SHELL" and "pipefail" in value:
            shell_pipefail = True
        if op == "ADD" and not re.search(r"https?://|\.tar", value):
            problems.append(f"DL3020 ADD {value}: use COPY for files and folders")
        if op == "RUN":
            if "apt-get install" in value:
                if "--no-install-recommends" not in value:
                    problems.append("DL3015 apt-get install without --no-install-recommends")
                if "rm -rf /var/lib/apt/lists" not in value:
                    problems.append("DL3009 apt-get lists not removed in the same RUN")
                if "apt-get update" not in value:
                    problems.append("DL3027-like: apt-get install without apt-get update in the same RUN (stale lists)")
            elif "apt-get update" in value:
                problems.append("apt-get update alone in a RUN: its cached layer goes stale")
            if "|" in value.replace("||", "") and not shell_pipefail:
                problems.append("DL4006 a RUN pipes without SHELL [... -o pipefail ...]: a failing stage is hidden")
            for command in re.split(r"&&|;|\|\|", value):
                if "pip install" not in command:
                    continue
                for token in command.split():
                    spec = token.strip("\"'")
                    if re.match(r"torch($|[<>=\[!~])", spec) and "==" not in spec:
                        problems.append(f"torch unpinned in RUN ({spec}): pin torch==<version>")
        if op == "COPY":
            parts = [p for p in shlex.split(value) if not p.startswith("--")]
            for source in parts[:-1]:
                if not (context / source).exists():
                    problems.append(f"COPY {source}: not in the build context {context}")
    users = [v for op, v in steps if op == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("DL3002 the image runs as root: end with USER <non-root>")
    for op, value in steps:
        if op in ("CMD", "ENTRYPOINT") and not value.lstrip().startswith("["):
            problems.append(f"DL3025 {op} {value}: use the JSON (exec) form so signals reach the process")
    return problems


def test_the_dockerfile_passes_the_lint() -> None:
    problems = lint(DOCKERFILE.read_text())
    service_files = [p for p in problems if p.startswith(("COPY alembic", "COPY service"))]
    assert [p for p in problems if p not in service_files] == []
    if service_files and not (REPO / "service" / "admin.py").exists():
        pytest.skip(f"the service is not on this branch yet, and the image copies it: {service_files}")
    assert service_files == []


@pytest.mark.parametrize(("text", "rule"), [
    ("FROM python\nUSER app\nCMD [\"x\"]\n", "DL3006"),
    ("FROM python:latest\nUSER app\nCMD [\"x\"]\n", "DL3007"),
    ("FROM python:3.11\nRUN apt-get update && apt-get install -y curl\nUSER app\n", "DL3015"),
    ("FROM python:3.11\nRUN apt-get update && apt-get install -y --no-install-recommends curl\nUSER app\n",
     "DL3009"),
    ("FROM python:3.11\nRUN apt-get update\nUSER app\n", "apt-get update alone"),
    ("FROM python:3.11\nRUN curl x | sh\nUSER app\n", "DL4006"),
    ("FROM python:3.11\nRUN pip install torch\nUSER app\n", "torch unpinned"),
    ("FROM python:3.11\nCOPY no-such-dir ./x\nUSER app\n", "COPY no-such-dir"),
    ("FROM python:3.11\nADD pipette /x\nUSER app\n", "DL3020"),
    ("FROM python:3.11\nCMD [\"x\"]\n", "DL3002"),
    ("FROM python:3.11\nUSER app\nCMD python -m service\n", "DL3025"),
    ("ARG BASE=python\nFROM ${BASE}\nUSER app\n", "DL3006"),
])
def test_the_lint_catches_each_rule(text: str, rule: str) -> None:
    assert any(rule in p for p in lint(text)), lint(text)


def test_variants_install_the_pinned_torch_from_the_right_index() -> None:
    steps = instructions(DOCKERFILE.read_text())
    args = _arg_defaults(steps)
    assert args["VARIANT"] == "cpu" and args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    run = next(v for op, v in steps if op == "RUN" and "TORCH_VERSION" in v)
    cpu = re.search(r"cpu\)(.*?);;", run, re.S)
    gpu = re.search(r"gpu\)(.*?);;", run, re.S)
    assert cpu and '--index-url "$TORCH_CPU_INDEX"' in cpu.group(1) and '"torch==${TORCH_VERSION}"' in cpu.group(1)
    assert gpu and "--index-url" not in gpu.group(1) and '"torch==${TORCH_VERSION}"' in gpu.group(1)
    assert "exit 1" in run  # any other VARIANT fails the build
    # torch is installed before the package, so pip cannot swap in another build.
    order = [v for op, v in steps if op == "RUN"]
    assert order.index(run) < next(i for i, v in enumerate(order) if ".[workers,service]" in v)
    assert "DS_BUILD_OPS=0" in " ".join(v for op, v in steps if op == "ENV")


def test_ports_and_command() -> None:
    steps = instructions(DOCKERFILE.read_text())
    exposed = {p for op, v in steps if op == "EXPOSE" for p in v.split()}
    assert exposed == {"8000", "6380", "10001"}
    cmd = next(v for op, v in steps if op == "CMD")
    assert '"service.admin", "serve"' in cmd and '"--port", "8000"' in cmd
