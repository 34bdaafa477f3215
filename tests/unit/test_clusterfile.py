"""Cluster files: both forms, units, slow links, and every malformed input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipette.clusterfile import cluster_from_dict, homogeneous_cluster, load_cluster
from pipette.errors import ClusterFileError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    c = load_cluster(path)
    assert c.world >= 1 and c.bandwidth.shape == (c.world, c.world)


def test_two_level_cluster_with_units() -> None:
    c = load_cluster(EXAMPLES / "a100-2x8.yaml")
    assert c.world == 16 and len(c.nodes) == 2
    assert c.bandwidth[0, 1] == 300e9 and c.bandwidth[0, 8] == 25e9  # 200 Gbit/s
    assert c.latency[0, 1] == pytest.approx(3e-6) and c.is_homogeneous_links is False


def test_slow_links_are_2_to_4_times_slower() -> None:
    c = load_cluster(EXAMPLES / "h100-4x8-slow-links.yaml")
    assert c.bandwidth[0, 8] == 50e9  # same rack
    assert c.bandwidth[0, 16] == pytest.approx(20e9)  # across racks: 2.5x slower
    assert c.bandwidth[16, 24] == pytest.approx(12.5e9)  # degraded NIC: 4x
    assert c.bandwidth[8, 12] == pytest.approx(450e9 / 4) and c.bandwidth[12, 8] == c.bandwidth[8, 12]
    assert c.nodes[3].address == "10.0.1.11"


def test_measured_matrix() -> None:
    c = load_cluster(EXAMPLES / "measured-4.yaml")
    assert c.bandwidth[1, 3] == 4e9 and c.latency[1, 3] == pytest.approx(20e-6)
    assert np.isinf(c.bandwidth[2, 2])
    assert [d.node for d in c.devices] == [0, 0, 1, 1]


def test_round_trip_of_the_probe_form() -> None:
    c = load_cluster(EXAMPLES / "measured-4.yaml")
    again = cluster_from_dict(c.to_dict())
    assert np.array_equal(again.bandwidth, c.bandwidth) and again.devices == c.devices


BASE = {"device": "A100-80GB", "nodes": 1, "devices_per_node": 2, "intra_node": {"bandwidth": "100 GB/s"}}


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"device": "Z80"}, "cluster.device", "unknown device preset"),
        ({"nodes": 0}, "cluster.nodes", "not positive"),
        ({"devices_per_node": None}, "cluster.devices_per_node", "None"),
        ({"intra_node": {"bandwidth": "-5 GB/s"}}, "cluster.intra_node.bandwidth", "cannot read"),
        ({"intra_node": {"bandwidth": 0}}, "cluster.intra_node.bandwidth", "not positive"),
        ({"intra_node": {"bandwidth": "5 parsecs"}}, "cluster.intra_node.bandwidth", "unknown unit"),
        ({"links": {"bandwidth": [[0, 1, 2], [1, 0, 2]]}}, "cluster.links.bandwidth", "not square"),
        ({"links": {"bandwidth": [[0, -1], [1, 0]]}}, "cluster.links.bandwidth", "not positive"),
        ({"links": {"bandwidth": [[0, 1], [1, 0]], "latency": [[0, -1], [1, 0]]}}, "cluster.links.latency", "negative"),
        ({"links": {"bandwidth": [[0, "x"], [1, 0]]}}, "cluster.links.bandwidth", "not a number"),
        ({"slow_links": [{"nodes": [0, 5], "factor": 2}]}, "cluster.slow_links[0].nodes", "pair"),
        ({"colour": "red"}, "cluster", "unknown key"),
    ],
)
def test_bad_cluster_files_name_the_field(change: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(ClusterFileError) as e:
        cluster_from_dict({**BASE, **change})
    assert e.value.field == field and words in e.value.message and e.value.fix


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ClusterFileError, match="no such file"):
        load_cluster(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1, 2\n")
    with pytest.raises(ClusterFileError, match="not valid YAML"):
        load_cluster(bad)
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    with pytest.raises(ClusterFileError, match="not a mapping"):
        load_cluster(listy)


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [("node", "x", "cluster.devices[0].node"), ("node", 9, "cluster.devices[0].node"),
     ("node", -1, "cluster.devices[0].node"), ("local_index", 1.5, "cluster.devices[0].local_index"),
     ("local_index", None, "cluster.devices[0].local_index")],
)
def test_a_measured_profile_with_a_wrongly_typed_device_field_names_it(where: str, value: object, field: str) -> None:

    data = homogeneous_cluster("a100-80gb", nodes=2, devices_per_node=2, intra_bandwidth=1e11,
                               inter_bandwidth=1e10).to_dict()
    data["devices"][0][where] = value
    with pytest.raises(ClusterFileError) as e:
        cluster_from_dict(data)
    assert e.value.field == field


def test_a_measured_profile_whose_node_is_not_a_mapping_names_it() -> None:

    data = homogeneous_cluster("a100-80gb", nodes=2, devices_per_node=1, intra_bandwidth=1e11,
                               inter_bandwidth=1e10).to_dict()
    data["nodes"][1] = "n1"
    with pytest.raises(ClusterFileError) as e:
        cluster_from_dict(data)
    assert e.value.field == "cluster.nodes[1]"
