"""The service's settings: environment variables in, one-line errors for bad values, and the
lease key that makes every spelling of one Ray cluster's address meet on one lease."""

from __future__ import annotations

import pytest

from pipette.errors import SpecError
from service.settings import Settings, resource_key, split_ray_address


def test_every_spelling_of_a_ray_head_is_one_lease() -> None:
    # the scheduler's Ray Client address, the GCS address users register, and the bare host
    keys = {resource_key("ray", a) for a in ("ray://127.0.0.1:10001", "127.0.0.1:6380", "127.0.0.1", "localhost:6380")}
    assert keys == {"ray:127.0.0.1"}
    assert resource_key("ray", "ray://10.0.0.1:10001") != resource_key("ray", "10.0.0.2:6380")
    assert resource_key("local", "box") == "local:box"


def test_a_scheduler_on_ray_client_serves_the_cluster_registered_by_gcs_address() -> None:
    settings = Settings.from_env({"RAY_ADDRESS": "ray://127.0.0.1:10001", "PIPETTE_HOME": "/tmp/x"})
    assert settings.resource_key == resource_key("ray", "127.0.0.1:6380")


def test_an_unresolvable_head_keeps_its_name() -> None:
    assert resource_key("ray", "no-such-host.invalid:6380") == "ray:no-such-host.invalid"


@pytest.mark.parametrize(("name", "value"), [("PIPETTE_NODE_WAIT_S", "soon"), ("PIPETTE_NODE_WAIT_S", "-1"),
                                             ("PIPETTE_TRIAL_TIMEOUT_S", "0"), ("PIPETTE_SCHEDULER", "maybe"),
                                             ("PIPETTE_DATABASE_URL", "mysql://db/x"), ("RAY_ADDRESS", "head:abc"),
                                             ("RAY_ADDRESS", "0[")])
def test_a_bad_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(SpecError) as e:
        Settings.from_env({name: value, "PIPETTE_HOME": "/tmp/x"})
    assert e.value.field == name


def test_node_wait_is_read() -> None:
    assert Settings.from_env({"PIPETTE_NODE_WAIT_S": "30", "PIPETTE_HOME": "/tmp/x"}).node_wait_s == 30.0


def test_a_malformed_ray_address_is_a_spec_error_naming_it() -> None:
    # found by Schemathesis: "0[" made urlsplit raise ValueError, a 500 at registration
    with pytest.raises(SpecError) as e:
        resource_key("ray", "0[")
    assert e.value.field == "address"


def test_ray_addresses_split_into_host_and_port() -> None:
    assert split_ray_address("ray://10.0.0.1:10001") == ("10.0.0.1", 10001)
    assert split_ray_address("head:6380") == ("head", 6380)
    assert split_ray_address("head") == ("head", None)
    for bad in ("head:abc", "0[", "head:99999"):
        with pytest.raises(SpecError) as e:
            split_ray_address(bad)
        assert e.value.field == "address" and "HOST:PORT" in e.value.fix
