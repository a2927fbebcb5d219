#!/usr/bin/env python
"""Where an MoE config's verify run leaves one device, and why: the figures of docs/moe.md
("verify and routing flips").

    PYTHONPATH=$PWD python benchmarks/moe_routing_flips.py --config configs/tiny.yaml \\
        [--strategy no_shard] [--devices 8] [--steps 3] [--seed 0] [--json] key=value...

The config's model, loss, optimizer (at its peak lr), precision and verify's batches, exactly
as `fsdp-jax verify` builds them (fsdp_jax/app/cli/run/verify.py), trained `--steps` steps on one
device (the reference) and under `--strategy` on `--devices` devices from the same params.
Per step:
- the loss and grad-norm relative differences and the leaves that differ most after the step
  (||p - p_ref|| / ||p_ref||, the largest element difference); for the worst leaf, how many
  elements differ by over 1e-5 and the reference's gradient at the 3 that differ most;
- the (token, expert) pairs each expert received in that step's own forward (the step's aux
  `expert_load` x the number of pairs), strategy minus reference: nonzero when a token's
  top-k choice differs inside the compiled step;
- the router of every sparse layer on the step's batch, for the params each run starts that
  step from, computed on one device (the router's logits captured by a debug callback): the
  tokens whose top-k experts differ between the two runs' params, with the reference's router
  probabilities there, and the smallest gap p_(k) - p_(k+1) over all tokens and layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--strategy", default="no_shard")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from fsdp_jax.app.config.checks import validate
    from fsdp_jax.app.devices import use_cpu_devices
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    validate(cfg)
    if not cfg.model.n_experts:
        print("error: model.n_experts: the config has no experts", file=sys.stderr)
        return 2
    use_cpu_devices(max(args.devices, 1))
    out = measure(cfg, args.strategy, args.devices, args.steps, args.seed)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print_text(out)
    return 0


def measure(cfg, strategy: str, n: int, steps: int, seed: int) -> dict:
    import jax

    import fsdp_jax.app.models.moe as moe
    from fsdp_jax.app.cli.run.verify import step_options
    from fsdp_jax.app.trainer.build import make_loss_fn, trainer_model
    from fsdp_jax.app.trainer.optim import build_optimizer
    from fsdp_jax.app.verify_batches import verify_batches
    from fsdp_jax.model.fns import adapt_model  # as verify: the shard_model adapter
    from fsdp_jax.sharding import rules
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.train.build import build
    from fsdp_jax.verify.compare import strategy_mesh_shape

    model, _, _ = adapt_model(trainer_model(cfg.model, cfg.remat), jax.random.key(seed))
    optimizer, _ = build_optimizer(dataclasses.replace(cfg.optimizer, warmup_steps=0), cfg.train.steps)
    loss_fn = make_loss_fn(model, cfg.model)
    batches, _ = verify_batches(cfg, steps, seed)
    opts = dict(step_options(cfg), has_aux=True, max_replicated_fraction=None)  # as verify builds them
    key = jax.random.key(seed)
    devs = jax.devices()
    one = make_mesh(1, 1, 1, devices=devs[:1])
    ref_built = build(model, optimizer, one, "no_shard", loss_fn=loss_fn, **opts)
    p0 = jax.device_get(ref_built.init_state(key).params)  # verify's init: one device, the seed

    def train(mesh, name):
        built = build(model, optimizer, mesh, name, loss_fn=loss_fn, **opts)
        state = built.place(p0, None)
        step = built.train_step.lower(state, jax.device_put(batches[0], built.plan.batch)).compile()
        rows = []
        for b in batches:
            state, m = step(state, jax.device_put(b, built.plan.batch))
            load = np.asarray(m["aux"]["expert_load"], np.float64).reshape(-1, cfg.model.n_experts).sum(0)
            rows.append((jax.device_get(state.params), float(m["loss"]), float(m["grad_norm"]), load))
        return rows

    ref = train(one, "no_shard")
    shape = strategy_mesh_shape(strategy, n)
    other = train(make_mesh(*shape, devices=devs[:n]), strategy)
    paths = [rules.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(p0)[0]]

    captured = []
    route = moe.route

    def recording_route(logits, k, norm_topk_prob):
        jax.debug.callback(lambda lg: captured.append(np.asarray(lg)), logits, ordered=True)
        return route(logits, k, norm_topk_prob)

    def router_logits(params, batch):  # (layers, tokens, experts), one device, no mesh
        captured.clear()
        moe.route = recording_route
        try:
            jax.block_until_ready(jax.jit(lambda p, t: model.apply(p, t[:, :-1], router=True)[1])(params, batch))
        finally:
            moe.route = route
        return np.stack(captured)

    grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))  # the reference's, one device

    def worst_elements(path, a, r, start, batch):
        """How many elements of leaf `path` differ by over 1e-5, and the reference's gradient
        (after the step's clipping) at the 3 that differ most: Adam turns rounding on
        gradients far below its eps into lr-sized differences."""
        g = jax.device_get(grad(start, batch))
        norm = float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(g))))
        scale = min(1.0, cfg.optimizer.clip_norm / norm) if cfg.optimizer.clip_norm else 1.0
        leaf = dict((rules.path_str(q), x) for q, x in jax.tree_util.tree_flatten_with_path(g)[0])[path]
        d = np.abs(a - r).ravel()
        top = np.argsort(-d)[:3]
        return int((d > 1e-5).sum()), [float(abs(leaf.ravel()[j]) * scale) for j in top]

    k = cfg.model.experts_per_token
    pairs = k * batches[0].shape[0] * (batches[0].shape[1] - 1) * _sparse_layers(cfg)
    report = {
        "strategy": strategy,
        "mesh": dict(zip(("data", "fsdp", "tensor"), shape)),
        "optimizer": cfg.optimizer.name,
        "lr": cfg.optimizer.lr,
        "pairs_per_step": pairs,
        "steps": [],
    }
    for i in range(steps):
        (pr, lr_, gr, er), (ps, ls, gs, es) = ref[i], other[i]
        leaves = sorted(
            (
                (float(np.linalg.norm(a - r) / np.linalg.norm(r)), path, float(np.max(np.abs(a - r))))
                for path, a, r in zip(paths, jax.tree.leaves(ps), jax.tree.leaves(pr))
            ),
            reverse=True,
        )
        experts = []  # per (stacked layer, expert) of each expert weight: ||d|| / ||ref||
        for path, a, r in zip(paths, jax.tree.leaves(ps), jax.tree.leaves(pr)):
            if path.rsplit("/", 1)[-1] in ("w_gate", "w_up", "w_down"):
                e = cfg.model.n_experts
                d, ref_n = (x.reshape(-1, e, int(np.prod(x.shape[-2:]))) for x in (a - r, r))
                rel = np.linalg.norm(d, axis=-1) / np.linalg.norm(ref_n, axis=-1)
                experts += [(float(rel[l_, e_]), path, int(l_), int(e_)) for l_, e_ in np.ndindex(rel.shape)]
        experts.sort(reverse=True)
        start_r, start_s = (p0, p0) if i == 0 else (ref[i - 1][0], other[i - 1][0])
        lg_r, lg_s = router_logits(start_r, batches[i]), router_logits(start_s, batches[i])
        prob_r, prob_s = _softmax(lg_r), _softmax(lg_s)
        top_r, top_s = _topk_sets(prob_r, k), _topk_sets(prob_s, k)
        srt = -np.sort(-prob_r, axis=-1)
        gap = srt[..., k - 1] - srt[..., k]
        flips = []
        flipped = np.argwhere((top_r != top_s).any(-1))  # (layer, token) pairs, layer-major
        seq = batches[i].shape[1] - 1  # tokens are (row, position) flattened
        for layer, tok in flipped:
            # downstream of an earlier layer's flip in its own row, at or before its position
            # (the residual stream and attention carry that flip's difference to it)
            after = any(l2 < layer and t2 // seq == tok // seq and t2 <= tok for l2, t2 in flipped)
            flips.append(
                {
                    "layer": int(layer),
                    "token": int(tok),
                    "reference_experts": top_r[layer, tok].tolist(),
                    "strategy_experts": top_s[layer, tok].tolist(),
                    "reference_probs": {
                        int(e): float(prob_r[layer, tok, e]) for e in np.argsort(-prob_r[layer, tok])[: k + 1]
                    },
                    "reference_gap": float(gap[layer, tok]),
                    "strategy_gap": float(_gap(prob_s[layer, tok], k)),
                    "after_earlier_flip": bool(after),
                }
            )
        worst = leaves[0][1]
        a, r = (dict(zip(paths, jax.tree.leaves(x)))[worst] for x in (ps, pr))
        over, grads_at = worst_elements(worst, a, r, start_r, batches[i])
        report["steps"].append(
            {
                "worst_leaf_elements_over_1e-5": over,
                "worst_leaf_grad_at_top_elements": grads_at,
                "step": i + 1,
                "loss_rel": abs(ls - lr_) / abs(lr_),
                "grad_norm_rel": abs(gs - gr) / abs(gr),
                "leaves": [{"path": p, "rel": r, "max_abs": m} for r, p, m in leaves[:4]],
                "experts": [{"path": p, "layer": l_, "expert": e_, "rel": r} for r, p, l_, e_ in experts[:4]],
                "experts_median_rel": float(np.median([x[0] for x in experts])) if experts else 0.0,
                "pairs_moved_in_step": np.round((es - er) * pairs).astype(int).tolist(),
                "router_logits_max_abs_diff": float(np.max(np.abs(lg_r - lg_s))),
                "router_logits_max_abs_diff_rows_without_flips": _rows_without(lg_r - lg_s, flipped, seq),
                "reference_min_gap": float(gap.min()),
                "reference_tokens_gap_below_1e-5": int((gap < 1e-5).sum()),
                "topk_flips": flips,
            }
        )
    return report


def _rows_without(d, flipped, seq: int) -> float:
    """max |d| (layers, tokens, experts) over the sequences with no top-k flip in any layer."""
    rows = d.reshape(d.shape[0], -1, seq, d.shape[-1])
    keep = np.ones(rows.shape[1], bool)
    keep[[t // seq for _, t in flipped]] = False
    return float(np.max(np.abs(rows[:, keep]), initial=0.0))


def _sparse_layers(cfg) -> int:
    from fsdp_jax.app.models.stack import sparse_layers

    return sum(bool(s) for s in sparse_layers(cfg.model))


def _softmax(lg):
    e = np.exp(lg - lg.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _topk_sets(p, k):
    return np.sort(np.argsort(-p, axis=-1, kind="stable")[..., :k], axis=-1)


def _gap(p, k):
    s = -np.sort(-p)
    return s[k - 1] - s[k]


def print_text(r: dict) -> None:
    print(
        f"{r['strategy']} on data x fsdp {r['mesh']['data']} x {r['mesh']['fsdp']} vs one device; "
        f"{r['optimizer']} lr {r['lr']:g}; {r['pairs_per_step']} (token, expert) pairs per step"
    )
    for s in r["steps"]:
        print(f"step {s['step']}: loss rel {s['loss_rel']:.2e}, grad-norm rel {s['grad_norm_rel']:.2e}")
        for leaf in s["leaves"]:
            print(f"  {leaf['path']:<44} rel {leaf['rel']:.2e}  max abs {leaf['max_abs']:.2e}")
        print(
            f"  {s['leaves'][0]['path']}: {s['worst_leaf_elements_over_1e-5']} elements differ by over 1e-5; "
            "the reference's |grad| at the 3 that differ most "
            + ", ".join(f"{x:.1e}" for x in s["worst_leaf_grad_at_top_elements"])
        )
        worst = ", ".join(
            f"{x['path'].rsplit('/', 1)[-1]} layer {x['layer']} expert {x['expert']} {x['rel']:.1e}"
            for x in s["experts"]
        )
        print(f"  experts (stacked layer, expert) that differ most: {worst}; median {s['experts_median_rel']:.1e}")
        print(f"  pairs per expert in the step, strategy - reference: {s['pairs_moved_in_step']}")
        print(
            f"  router (one device, each run's params at the step's start): logits differ by up to "
            f"{s['router_logits_max_abs_diff']:.2e}; reference's smallest top-k gap {s['reference_min_gap']:.2e} "
            f"({s['reference_tokens_gap_below_1e-5']} tokens under 1e-5); {len(s['topk_flips'])} top-k flips"
            f" (logits in the sequences without one differ by up to "
            f"{s['router_logits_max_abs_diff_rows_without_flips']:.2e})"
        )
        for f in s["topk_flips"]:
            probs = ", ".join(f"e{e} {p:.8f}" for e, p in f["reference_probs"].items())
            print(
                f"    layer {f['layer']} token {f['token']}: experts {f['reference_experts']} -> "
                f"{f['strategy_experts']}; reference probs {probs} (gap {f['reference_gap']:.2e}, "
                f"strategy's {f['strategy_gap']:.2e})"
                + (", after an earlier layer's flip in its sequence" if f["after_earlier_flip"] else "")
            )


if __name__ == "__main__":
    sys.exit(main())
