"""The `offload:` settings as data, no JAX: which parts of the train state rest off the device
between steps, and where. `fsdp_jax.sharding.offload` (host memory) and `fsdp_jax.nvme` (local
disks) re-export and run them; the run config's checks read them before JAX loads
(`fsdp_jax.app.config.early_checks`), as `plan --offload` does (`fsdp_jax.app.planner.flag_values`).

- `OFFLOADS`: host memory (`pinned_host`), run by the jitted step of `fsdp_jax.train.build`.
- `NVME_OFFLOADS`: local disks (`fsdp_jax.nvme`): nothing of the state rests in host memory,
  and the jitted step of `build` does not run them.
- `ALL_OFFLOADS`: both, in that order (what `offload:` and `plan --offload` take).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which parts of the train state live in host memory between steps."""

    name: str
    params: bool
    opt_state: bool
    stream: bool = False  # the update fetches stacked leaves layer by layer (train.stream_update)
    layers: bool = False  # the model's layer loop fetches stacked params layer by layer (train.layer_gather)

    @property
    def any(self) -> bool:
        return self.params or self.opt_state


OFFLOADS: dict[str, Offload] = {
    o.name: o
    for o in (
        Offload("none", params=False, opt_state=False),
        Offload("optimizer", params=False, opt_state=True),
        Offload("optimizer+params", params=True, opt_state=True),
        Offload("optimizer:streamed", params=False, opt_state=True, stream=True),
        Offload("optimizer+params:streamed", params=True, opt_state=True, stream=True, layers=True),
        Offload("optimizer+params:streamed-update", params=True, opt_state=True, stream=True),
    )
}
NVME_OFFLOADS: dict[str, Offload] = {
    "optimizer:nvme": Offload("optimizer:nvme", params=False, opt_state=False, stream=True),
    # the f32 master params of the scanned layers (and their grads) in the layer files too, the
    # forward / backward fed a layer at a time from them (`fsdp_jax.nvme.layerwise`; planned by
    # `app.planner.nvme_plan`, run by `app.trainer.params_nvme`)
    "optimizer+params:nvme": Offload("optimizer+params:nvme", params=False, opt_state=False, stream=True),
}
PARAMS_NVME = "optimizer+params:nvme"
ALL_OFFLOADS: dict[str, Offload] = {**OFFLOADS, **NVME_OFFLOADS}
