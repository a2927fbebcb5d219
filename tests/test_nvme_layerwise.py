"""`fsdp_jax.nvme.layerwise`: the layer-wise step of `optimizer+params:nvme` (params, state and
grads in layer files) against the project's scanned train step without offload.

Parity runs in a child process with no FMA (tests/test_nvme.py's `parity_env`), as test_nvme's does."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_nvme import parity_env

import fsdp_jax as fj
from fsdp_jax.nvme import LayerFiles, Layout
from helpers import json_child

# The child: benchmarks/nvme_layerwise_step.py (3 AdamW steps of `build(...).train_step`, full_shard,
# and of `LayerwiseStep` from the same init, the same param shardings and batch layout)
_CHILD = "import sys; sys.path.insert(0, 'benchmarks'); import nvme_layerwise_step as b; sys.exit(b.main(sys.argv[1:]))"


def layerwise(*args):
    return json_child(_CHILD, *args, env=parity_env())


@pytest.mark.slow  # a child compiling the scanned step and the layer-wise programs: 21-110 s loaded
def test_layerwise_step_equals_the_scanned_step_bit_for_bit_on_one_device():
    """f32, no remat, one microbatch, AdamW, 3 steps, no clipping: the loss, every param and every
    optimizer-state leaf bit for bit, the state gathered and put back into the files before the
    last step (as a restore would); the files: params, state, grads per layer; a non-finite step
    skipped by both."""
    r = layerwise("--devices", "1", "--nan-step")
    (loss, norm), (ref_loss, ref_norm) = np.transpose(r["got"]), np.transpose(r["ref"])
    assert list(loss) == list(ref_loss) and ref_loss[-1] < ref_loss[0]
    # the grad norm sums a stacked leaf's squares per layer, then over layers: not the scanned
    # step's order (measured: 1 ulp at step 1); without clipping it only decides `ok`
    np.testing.assert_allclose(norm, ref_norm, rtol=2 * np.finfo(np.float32).eps, atol=0)
    assert r["leaves"] == 12 and r["params"] == {} and r["state"] == {}
    kinds = ("grads", "params", "state")
    claims = [f"fsdp_jax_nvme.{k}.p0.json" for k in kinds]
    assert r["files"] == sorted(claims + [f"{k}{i:05d}.p0.bin" for k in kinds for i in range(2)])
    # then a NaN in the embedding: both steps skip; the files' params and state are left as they were
    assert r["nan_step"] == {"skipped": [1, 1], "changed": {}}


def stacked():
    s = NamedSharding(fj.make_mesh(fsdp=8), P(None, "fsdp"))
    return [jax.ShapeDtypeStruct((2, 64, 8), np.float32, sharding=s)]


def test_kinds_of_files_share_a_dir_each_with_its_own_claim(tmp_path):
    lay = Layout.of(stacked())
    a = LayerFiles.open([tmp_path], lay, owner="r", kind="params")
    b = LayerFiles.open([tmp_path], lay, owner="r", kind="grads")
    buf = a.buffer()
    buf[:] = 7
    a.write(0, buf)
    b.write(0, np.zeros_like(buf))
    np.testing.assert_array_equal(a.read(0, a.buffer()), buf)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fsdp_jax_nvme.grads.p0.json", "fsdp_jax_nvme.params.p0.json", "grads00000.p0.bin", "params00000.p0.bin",
    ]  # fmt: skip
    assert a.claim_name() != LayerFiles.open([tmp_path], lay, owner="r").claim_name()  # the default kind: as before


def test_an_optimizer_that_reduces_over_a_leaf_is_refused_before_any_file(tmp_path):
    import optax

    from fsdp_jax.errors import OffloadError
    from fsdp_jax.nvme import LayerwiseStep, Pieces

    (layers,) = stacked()
    abstract = {
        "layers": {"w": layers},
        "rest": {"b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(layers.sharding.mesh, P()))},
    }
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    with pytest.raises(OffloadError, match="updates one layer at a time from disk, but the optimizer update uses"):
        LayerwiseStep(Pieces(None, None, None), opt, abstract, [tmp_path], owner="r")
    assert list(tmp_path.iterdir()) == []
