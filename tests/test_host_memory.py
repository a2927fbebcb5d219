"""Host memory for offloaded state (issue 43, item 6): the bytes a process rests in host
memory, this node's host memory (FSDP_JAX_HOST_MEMORY, /proc/meminfo, os.sysconf), and
the bad input around them: offloaded state over the node's host memory in `train` and in
`plan`, a bad FSDP_JAX_HOST_MEMORY, and a streamed offload a model without a layer stack
cannot honour -- one line naming the need, exit 2, nothing written."""

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.app import host_memory as hm
from fsdp_jax.app.models import DecoderConfig
from fsdp_jax.sharding import offload as ol
from fsdp_jax.train.build import build
from helpers import TINY_MODEL_OVERRIDES, TINY_RUN_OVERRIDES, call, one_line
from helpers import tiny_llama as _tiny_llama

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
CFG = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)


@pytest.mark.parametrize(
    "text,n", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("1.5T", 1.5e12), ("4096", 4096), (" 2 MiB ", 2 * 2**20)]
)
def test_parse_size(text, n):
    assert hm.parse_size(text, "x") == n


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "1e400GB", ""])
def test_parse_size_refuses_with_the_name(text):
    with pytest.raises(ValueError, match="^FOO: "):
        hm.parse_size(text, "FOO")


def test_host_memory_sources(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert hm.host_memory({}, str(meminfo)) == (8000000 * 1024, f"MemAvailable in {meminfo}")
    assert hm.host_memory({hm.HOST_MEMORY_ENV: "2TB"}, str(meminfo)) == (2 * 10**12, hm.HOST_MEMORY_ENV)
    have, source = hm.host_memory({}, str(tmp_path / "absent"))  # no meminfo: the kernel's page counts
    assert source == "os.sysconf available pages" and have > 0
    with pytest.raises(fj.errors.ConfigError, match=f"^{hm.HOST_MEMORY_ENV}: 'plenty' is not a size"):
        hm.host_memory({hm.HOST_MEMORY_ENV: "plenty"})


def test_host_bytes_per_process_counts_each_devices_shard():
    """Against the arrays themselves: the bytes of every addressable shard in host memory."""
    mesh = fj.make_mesh(fsdp=8)
    host = lambda spec: NamedSharding(mesh, spec, memory_kind=ol.HOST)  # noqa: E731
    tree = {
        "sharded": jax.device_put(np.ones((16, 4), np.float32), host(P("fsdp"))),
        "replicated": jax.device_put(np.ones((3,), np.int32), host(P())),
        "on_device": jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("fsdp"))),
    }
    want = sum(s.data.nbytes for k in ("sharded", "replicated") for s in tree[k].addressable_shards)
    assert want == 16 * 4 * 4 + 8 * 3 * 4  # the replicated leaf once per device
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    assert ol.host_bytes_per_process(tree) == ol.host_bytes_per_process(abstract) == want


@pytest.mark.parametrize("offload,strategy", [("optimizer", "full_shard"), ("optimizer+params", "no_shard")])
@pytest.mark.fast_cases("optimizer-full_shard")
def test_host_bytes_of_a_built_state_equal_its_host_shards(offload, strategy):
    m, loss_fn = _tiny_llama(CFG)
    b = build(m, optax.adamw(1e-3), fj.make_mesh(fsdp=8), strategy, loss_fn=loss_fn, offload=offload)
    state = b.init_state(jax.random.key(0))
    want = sum(
        s.data.nbytes for x in jax.tree.leaves(state) if x.sharding.memory_kind == ol.HOST for s in x.addressable_shards
    )
    assert want > 0 and ol.host_bytes_per_process(b.abstract_state) == want
    hm.check_host_memory(want, offload, {hm.HOST_MEMORY_ENV: str(want)})  # exactly enough
    with pytest.raises(fj.errors.ConfigError, match="^offload: ") as e:
        hm.check_host_memory(want, offload, {hm.HOST_MEMORY_ENV: str(want - 1)})
    assert hm.fmt_size(want) in str(e.value) and hm.HOST_MEMORY_ENV in str(e.value)


def test_train_over_host_memory_is_one_line_and_writes_nothing(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--config", TINY_YAML, *TINY_RUN_OVERRIDES, f"data.path={corpus}", f"run_dir={run_dir}"]
    rc, _, err = call("train.py", *args, "offload=optimizer", capsys=capsys, env={hm.HOST_MEMORY_ENV: "1KB"})
    line = one_line(rc, err, "offload: 'optimizer' rests", "per node", "0.00 MB (FSDP_JAX_HOST_MEMORY)")
    assert " MB of state in host memory" in line
    assert not run_dir.exists()
    for offload in ("optimizer", "none"):  # a bad value is refused whether or not it is needed
        rc, _, err = call("train.py", *args, f"offload={offload}", capsys=capsys, env={hm.HOST_MEMORY_ENV: "many"})
        one_line(rc, err, hm.HOST_MEMORY_ENV, "'many' is not a size")
        assert not run_dir.exists()


def test_streamed_offload_without_a_layer_stack_is_refused(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, _, err = call(
        "train.py",
        "--config",
        TINY_YAML,
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        f"run_dir={run_dir}",
        "offload=optimizer:streamed",
        "model.scan_layers=false",
        capsys=capsys,
    )
    one_line(rc, err, "offload: 'optimizer:streamed'", "model.scan_layers=false", "use offload: optimizer")
    assert not run_dir.exists()


PLAN = ["--config", TINY_YAML, "--devices", "8", "--strategies", "full_shard,no_shard", *TINY_MODEL_OVERRIDES]


@pytest.mark.slow
def test_plan_checks_the_offloaded_state_per_host(capsys, tmp_path):
    """--host-memory (or FSDP_JAX_HOST_MEMORY) under every strategy's need: one line, exit 2,
    no plot written; over one strategy's: that one does not fit, with a note; unstated: this
    machine's figure, a note only."""
    import json

    plot = tmp_path / "p.png"
    rc, out, err = call("plan.py", *PLAN, "--offload", "optimizer", "--json", capsys=capsys)
    assert rc == 0, err
    doc = json.loads(out)
    need = {n: r["analytic"]["host_per_host"] for n, r in doc["strategies"].items()}
    assert need["no_shard"] > need["full_shard"] > 0  # no_shard replicates the optimizer state
    assert all(r["fits_host"] for r in doc["strategies"].values())
    assert any("this machine's MemAvailable" in n for n in doc["notes"])

    between = str((need["no_shard"] + need["full_shard"]) // 2)
    rc, out, err = call("plan.py", *PLAN, "--offload", "optimizer", "--host-memory", between, "--json", capsys=capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["strategies"]["full_shard"]["fits_host"] and not doc["strategies"]["no_shard"]["fits_host"]
    assert any("--host-memory" in n and "no_shard" in n and "full_shard" not in n for n in doc["notes"])

    below = str(need["full_shard"] - 1)
    for extra, env in ((["--host-memory", below], {}), ([], {hm.HOST_MEMORY_ENV: below})):
        rc, out, err = call("plan.py", *PLAN, "--offload", "optimizer", "--plot", plot, *extra, capsys=capsys, env=env)
        one_line(rc, err, "least: full_shard with offload optimizer", hm.fmt_size(need["full_shard"]))
        assert not plot.exists() and out == ""
    rc, _, err = call("plan.py", *PLAN, "--offload", "none,optimizer", "--host-memory", below, capsys=capsys)
    assert rc == 0, err  # offload none needs no host memory: a plan fits
