"""Config keys that take several names take a YAML list as well as a string (PEFT users write
`target_modules: [q_proj, v_proj]`), in the YAML file and as a `key=[a,b]` override; a bad
element is one line naming the key and its index, exit 2."""

import pytest
import yaml

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.config.schema import NAME_LISTS
from helpers import call, one_line

MOE = {"n_experts": 4, "experts_per_token": 2, "moe_ffn_dim": 32}
# every key of NAME_LISTS: (its section's other keys, model overrides, names, the string the config keeps)
CASES = {
    "lora.targets": ({"rank": 4}, {}, ["q_proj", "v_proj", "down_proj"], "q_proj v_proj down_proj"),
    "lora.target_parameters": (
        {"rank": 4},
        MOE,
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "mlp.experts.gate_up_proj mlp.experts.down_proj",
    ),
    "grpo.rewards": ({}, {}, ["answer_match", "format"], "answer_match format"),
    "grpo.reward_weights": ({}, {}, ["1.0", "0.5"], "1.0 0.5"),
    "grpo.stop_tokens": ({}, {}, [10, 13], "10 13"),  # numbers, as token ids are written
}


def test_every_key_that_takes_names_is_covered():
    assert NAME_LISTS == set(CASES)  # a new names key gets its row here


def _load(tmp_path, key: str, value, overrides=()):
    section, field = key.split(".")
    others, model, _, _ = CASES[key]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": model, section: {**others, field: value}}))
    return load_config(path, list(overrides))


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_list_and_a_string_give_the_same_config(key, tmp_path):
    section, field = key.split(".")
    _, _, names, kept = CASES[key]
    as_list = _load(tmp_path, key, names)
    assert getattr(getattr(as_list, section), field) == kept
    assert _load(tmp_path, key, " ".join(map(str, names))) == as_list
    assert _load(tmp_path, key, "auto", [f"{key}=[{','.join(map(str, names))}]"]) == as_list  # an override list


@pytest.mark.parametrize("key", sorted(CASES))
@pytest.mark.parametrize("bad, index", [([True], 0), (["ok", None], 1), ([["a"]], 0), (["q_proj v_proj"], 0)])
def test_a_bad_element_is_one_line_exit_2(key, bad, index, tmp_path, capsys):
    _, _, names, _ = CASES[key]
    bad = [names[0] if b == "ok" else b for b in bad]
    section, field = key.split(".")
    others, model, _, _ = CASES[key]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": model, section: {**others, field: bad}}))
    rc, _, err = call("train", "--config", path, "--no-progress", capsys=capsys)
    one_line(rc, err, f"{key}[{index}]", "not a name")


def test_an_unknown_name_in_a_list_names_the_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"lora": {"rank": 4, "targets": ["q_proj", "qq_proj"]}}))
    rc, _, err = call("train", "--config", path, "--no-progress", capsys=capsys)
    one_line(rc, err, "lora.targets", "qq_proj")
