"""What a run optimises, each a loss with its data and metrics (STYLE 29).

`preference`: DPO, IPO, hinge, SimPO and ORPO with TRL's definitions and metric names;
`reference`: the loss as the train step calls it, with its reference model;
`preference_data`: {prompt, chosen, rejected} rows -> token pairs (docs/preference.md);
`preference_pieces`: SimPO / ORPO cut for the layer-wise step of params on disk (docs/offload.md).
"""

from fsdp_jax.app.objectives.preference import (
    LOSSES,
    REFERENCE_FREE,
    PreferenceSpec,
    finish_metrics,
    pair_losses,
    preference_terms,
    sequence_logps,
    spec_problem,
)
from fsdp_jax.app.objectives.reference import (
    REFERENCES,
    adapters_off,
    choose_reference,
    make_preference_loss,
    reference_logps,
    with_reference,
)

__all__ = [
    "LOSSES",
    "REFERENCES",
    "REFERENCE_FREE",
    "PreferenceSpec",
    "adapters_off",
    "choose_reference",
    "finish_metrics",
    "make_preference_loss",
    "pair_losses",
    "preference_terms",
    "reference_logps",
    "sequence_logps",
    "spec_problem",
    "with_reference",
]
