"""Hugging Face checkpoints of the decoder families, named by direction.

load        a Hugging Face checkpoint -> the reference decoder's params, loaded sharded
config_in   a family's config.json -> `DecoderConfig`
export      a run's params -> a Hugging Face directory `from_pretrained` loads
config_out  `DecoderConfig` -> the family's config.json
peft        PEFT LoRA adapters in and out (adapter_config.json + adapter_model.safetensors), merging
export_lora a LoRA run's adapters as a PEFT directory, or merged into its base
"""
