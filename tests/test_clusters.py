"""Rented clusters as --targets (fsdp_jax/targets/clusters.json): each compiles for its GPU and
is costed with its own network table; `plan --list-targets` lists them with the TPU slices."""

import json

import pytest

from fsdp_jax.errors import TargetError
from fsdp_jax.targets.clusters import clusters
from fsdp_jax.targets.gpu import make_target
from fsdp_jax.targets.perf_tables import perf_table
from helpers import TINY_MODEL_OVERRIDES, call

NETS = {"a3-high": 11.5e9, "a3-mega": 23e9, "p5": 46e9, "ndr-h100": 46e9}  # bus bytes/s per GPU across hosts


@pytest.mark.parametrize("name, across", sorted(NETS.items()))
def test_a_cluster_is_its_gpu_with_its_own_sourced_network(name, across):
    t = make_target(name, devices=128, hosts=16)
    assert (t.name, t.hosts, t.gpus_per_host, t.cluster) == ("h100", 16, 8, name)
    slow = perf_table(t.table)["links"]["slow"]
    assert slow["bus_bytes_per_s"] == across and slow["source"]
    assert perf_table(t.table)["gemm"] == perf_table("h100")["gemm"]  # the same GPUs: only the network differs
    assert t.as_dict()["cluster"] == name and name in t.describe()


def test_a_cluster_refuses_another_host_size_and_the_plain_gpu_stays_itself():
    with pytest.raises(TargetError, match=r"^--gpus-per-host: a3-high hosts hold 8 GPUs, not 4"):
        make_target("a3-high", hosts=2, gpus_per_host=4)
    t = make_target("h100", devices=16, hosts=2)
    assert t.cluster is None and t.table == "h100"
    assert set(NETS) <= set(clusters())


def test_list_targets_names_every_gpu_cluster_and_tpu_slice(capsys):
    rc, out, err = call("plan", "--list-targets", capsys=capsys)
    assert rc == 0, err
    first = {ln.split()[0].rstrip(",") for ln in out.splitlines()[1:] if ln and not ln.startswith(" ")}
    assert {"h100", "h200", "a100", "a3-high", "a3-mega", "p5", "ndr-h100", "v5p", "v6e"} <= first, first
    a3 = next(ln for ln in out.splitlines() if ln.startswith("a3-high "))
    assert "11.5 GB/s" in a3 and "316.0 GB/s" in a3
    assert "cloud.google.com/compute/docs/gpus" in out and "aws.amazon.com/ec2/instance-types/p5" in out


@pytest.mark.slow
def test_plan_on_a3_high_costs_gcps_network_not_infiniband(capsys):
    """The same compiled program, 2 hosts x 8: on a3-high the gradient reduction across hosts
    runs over 12.5 GB/s per GPU (TCPX) where h100 / ndr-h100 has 50 (NDR): a longer step."""
    steps = {}
    for target in ("a3-high", "h100"):
        rc, out, err = call(
            "plan", "--config", "configs/tiny.yaml", "--target", target, "--devices", "16", "--hosts", "2",
            "--strategies", "hybrid_shard", "--json", *TINY_MODEL_OVERRIDES, "train.global_batch=32", capsys=capsys,
        )  # fmt: skip
        assert rc == 0, err[-2000:]
        doc = json.loads(out)
        steps[target] = doc["strategies"]["hybrid_shard"]["predicted"]
        assert doc["target"]["cluster"] == (target if target == "a3-high" else None)
    assert steps["a3-high"]["breakdown"]["exposed_comm"] > steps["h100"]["breakdown"]["exposed_comm"]
    assert steps["a3-high"]["step_s"] > steps["h100"]["step_s"]
