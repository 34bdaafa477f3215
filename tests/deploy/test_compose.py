"""deploy/docker-compose.yml: it parses, interpolates like Compose does, and is wired right
(migrations before the API and the scheduler, the database URL pointing at the database, every
Ray participant on the same port and token, Ray never on 6379, the same image everywhere)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.deploy.compose import (
    COMPOSE,
    ENV_EXAMPLE,
    FILLED,
    PIPETTE,
    REPO,
    VARIABLE,
    MissingVariable,
    flags,
    interpolate,
    load,
    service_env,
)


def test_it_parses_and_has_every_part() -> None:
    compose = load()
    services = compose["services"]
    assert set(services) == {"postgres", *PIPETTE}
    assert "pgdata" in compose["volumes"]
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    for name in PIPETTE:  # one image for the service and every Ray node
        assert services[name]["image"] == "pipette:cpu"
        assert services[name]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile",
                                           "args": {"VARIANT": "cpu"}}
        assert (COMPOSE.parent / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).exists()
    assert int(services["ray-worker"]["deploy"]["replicas"]) == 3


def test_migrations_run_once_before_the_api_and_the_scheduler() -> None:
    services = load()["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["python", "-m", "service.admin", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    for name in ("api", "scheduler"):
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}


def test_the_database_url_points_at_the_database() -> None:
    services = load()["services"]
    pg = service_env(services["postgres"])
    for name in ("migrate", "api", "scheduler"):
        url = urlsplit(service_env(services[name])["PIPETTE_DATABASE_URL"])
        assert url.scheme == "postgresql" and url.hostname == "postgres" and url.port == 5432
        assert url.username == pg["POSTGRES_USER"] and url.password == pg["POSTGRES_PASSWORD"] == "pw"
        assert url.path == "/" + pg["POSTGRES_DB"]


def test_ray_wiring() -> None:
    services = load()["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    head_flags, worker_flags = flags(head["command"]), flags(worker["command"])
    assert head["command"][:3] == ["ray", "start", "--head"] and "--block" in head["command"]
    assert "--block" in worker["command"] and "--head" not in worker["command"]
    port = head_flags["port"]
    assert port != "6379"  # Redis's port; Ray always gets another
    assert worker_flags["address"] == f"ray-head:{port}"
    assert head["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
    client = head_flags["ray-client-server-port"]
    for name in ("scheduler", "api"):
        assert service_env(services[name])["RAY_ADDRESS"] == f"ray://ray-head:{client}"
    assert services["scheduler"]["depends_on"]["ray-head"] == {"condition": "service_healthy"}
    assert worker["depends_on"]["ray-head"] == {"condition": "service_healthy"}
    for name in ("ray-head", "ray-worker", "scheduler"):  # every Ray participant: the same token
        env = service_env(services[name])
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "0" * 64
        assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    for node in (head, worker):
        assert node["shm_size"] and int(flags(node["command"])["num-cpus"]) >= 1


def test_api_port_and_health() -> None:
    services = load()["services"]
    api = services["api"]
    port = api["command"][api["command"].index("--port") + 1]
    assert api["command"][api["command"].index("--host") + 1] == "0.0.0.0"
    assert api["ports"] == [f"8000:{port}"]
    assert f"127.0.0.1:{port}/healthz" in " ".join(api["healthcheck"]["test"])
    assert service_env(api)["PIPETTE_SCHEDULER"] == "0"  # the scheduler is its own service


def test_required_secrets_are_enforced_and_documented() -> None:
    for missing in FILLED:
        env = {k: v for k, v in FILLED.items() if k != missing}
        with pytest.raises(MissingVariable, match=missing):
            load(env)
    documented = {line.split("=", 1)[0].lstrip("# ") for line in ENV_EXAMPLE.read_text().splitlines() if "=" in line}
    used = {m.group(1) or m.group(4) for m in VARIABLE.finditer(COMPOSE.read_text())}
    assert used <= documented, used - documented


def test_settings_read_the_variables_the_compose_file_sets() -> None:
    settings = REPO / "service" / "settings.py"
    if not settings.exists():
        pytest.skip("the service is not on this branch yet: its settings cannot be checked")
    source = settings.read_text()
    services = load()["services"]
    for name in ("migrate", "api", "scheduler"):
        for var in service_env(services[name]):
            if var.startswith("PIPETTE_") or var == "RAY_ADDRESS":
                assert f'"{var}"' in source, f"{name} sets {var}, which service/settings.py never reads"


def test_interpolation_follows_compose() -> None:
    env = {"A": "a", "E": ""}
    assert interpolate("${A}-${B:-b}-${E:-e}-${E-e}-$$x", env) == "a-b-e--$x"
    with pytest.raises(MissingVariable):
        interpolate("${E:?need E}", env)
