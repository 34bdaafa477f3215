"""Reading deploy/docker-compose.yml as Compose does: anchors and merges, variable
substitution, a service's environment and flags. Used by tests/deploy (the file's wiring) and
tests/cluster (its processes run as plain processes in the shaped cluster)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
PIPETTE = ("migrate", "api", "scheduler", "ray-head", "ray-worker")
FILLED = {"POSTGRES_PASSWORD": "pw", "RAY_AUTH_TOKEN": "0" * 64}

VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


class MissingVariable(ValueError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ``${X}``, ``${X:-default}``, ``${X-default}``,
    ``${X:?error}``, ``${X?error}``; ``$$`` is a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3) or ""
        have = name in env and (env[name] != "" or op not in (":-", ":?"))
        if have:
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise MissingVariable(f"{name}: {arg}")
        return ""

    return VARIABLE.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def load(env: dict[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())  # resolves the x-* anchors and << merges
    return dict(interpolate(raw, FILLED if env is None else env))


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


