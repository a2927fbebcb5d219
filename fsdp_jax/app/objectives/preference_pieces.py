"""A reference-free preference loss (SimPO, ORPO) cut for the layer-wise step of
`offload: optimizer+params:nvme` (`fsdp_jax.app.models.layer_pieces.decoder_pieces`' `inputs` and
`loss`).

The scanned step's preference loss (`reference.make_preference_loss` with reference `none`) runs
the policy once over the pairs' rows (`reference.pair_logits`) and scores the logits
(`preference.preference_terms`, or `preference_packed.packed_terms` for packed rows). Here the
same rows go through the decoder's pieces a layer at a time, and the head scores the final
logits with the same function, returning `(loss, aux)`: the layer-wise step differentiates the
loss and hands the metrics on as the scanned step does. A loss with a reference (dpo, ipo, hinge)
would need a second forward over the frozen weights, which the layer files do not hold: refused
(`fsdp_jax.app.trainer.params_nvme.REFUSALS`).
"""

from __future__ import annotations

from fsdp_jax.app.objectives.preference import REFERENCE_FREE, PreferenceSpec, preference_terms
from fsdp_jax.app.objectives.preference_packed import is_packed, packed_inputs, packed_terms


def pair_inputs(batch) -> dict:
    """The decoder's inputs of a preference batch, as `reference.pair_logits` gives them: the
    pairs' rows `tokens[..., :-1]` (2P, L-1) (packed rows: (B, L-1) with their segment ids and
    positions), and the batch itself for the loss."""
    if is_packed(batch):
        inputs, seg, pos = packed_inputs(batch)
        return {"inputs": inputs, "segment_ids": seg, "positions": pos, "batch": batch}
    p = batch["tokens"].shape[0]
    rows = batch["tokens"][..., :-1].reshape(2 * p, -1)
    return {"inputs": rows, "segment_ids": None, "positions": None, "batch": batch}


def pair_loss(spec: PreferenceSpec, slots: int = 0):
    """`loss(logits, pair_inputs(batch)) -> (loss, aux)`: `make_preference_loss`'s terms without
    a reference (`slots`: the sequences per packed row, as there)."""
    if spec.loss not in REFERENCE_FREE:
        raise ValueError(f"{spec.loss!r} needs a reference model; reference-free: {', '.join(REFERENCE_FREE)}")

    def loss(logits, b: dict):
        if is_packed(b["batch"]):
            return packed_terms(spec, logits, b["batch"], slots, None)
        return preference_terms(spec, logits, b["batch"], None)

    return loss
