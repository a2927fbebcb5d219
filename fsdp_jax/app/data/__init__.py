"""Data: token corpora and fine-tuning examples, prepared to disk and read back as batches.

corpus        token corpora on disk: text files, the stdlib, bins (prepare)
writable      whether an output directory can be written (no JAX, no NumPy: the CLI's checks)
windows       reading a corpus back: meta.json checked, resumable per-process windows
token_check   every token id below the model's vocabulary
tokenizer     Hugging Face `tokenizer.json` / bytes, chat templates
examples      chat, instruction and plain-text examples as tokens + loss mask
sft           packed fine-tuning corpora, prepared as a stream (packed_splits writes them)
packing       packing examples into rows; packed_rows reads a packed corpus back
encode_pool   encoding in worker processes (encode_worker), in order, bounded
batches       the trainer's train iterator and validation batches
"""
