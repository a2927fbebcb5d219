#!/usr/bin/env python
"""The reference model's compiled forward + backward as text, source metadata stripped, to
diff two versions of the model code (docs/hf_models.md: the Llama-2 reference unchanged).

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old python benchmarks/model_hlo.py configs/tiny.yaml > old.txt
    PYTHONPATH=$PWD    python benchmarks/model_hlo.py configs/tiny.yaml > new.txt
    diff old.txt new.txt && echo identical

XLA:CPU, 8 host devices, remat dots, batch 2 x 128, real params (tiny configs only).
"""

import re
import sys

import jax
import jax.numpy as jnp


def main(path: str) -> int:
    jax.config.update("jax_num_cpu_devices", 8)
    from fsdp_jax.app.models.decoder import cross_entropy
    from fsdp_jax.app.trainer.build import trainer_model
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(path).model
    m = trainer_model(cfg, "dots")
    params = m.init(jax.random.key(0))
    tok = jnp.zeros((2, 129), jnp.int32)

    def loss(p):
        return cross_entropy(m.apply(p, tok[:, :-1]), tok[:, 1:])

    text = jax.jit(jax.value_and_grad(loss)).lower(params).compile().as_text()
    for line in text.splitlines():
        if re.match(r"^\s*\d+ [\"{]", line) or line.strip() in (
            "FileNames",
            "FunctionNames",
            "FileLocations",
            "StackFrames",
        ):
            continue  # the source-location tables
        print(re.sub(r",? ?stack_frame_id=\d+", "", re.sub(r", metadata=\{[^}]*\}", "", line)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
