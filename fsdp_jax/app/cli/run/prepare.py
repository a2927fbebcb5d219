"""`fsdp-jax prepare` once its flags have parsed (they and its description: fsdp_jax.app.cli.prepare)."""

from __future__ import annotations

import os
import sys

from fsdp_jax.app.cli.prepare import check_flags
from fsdp_jax.app.data.corpus import prepare_bin, prepare_stdlib, prepare_text
from fsdp_jax.app.data.sft import prepare_examples
from fsdp_jax.app.data.tables import KeyMap
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.data.writable import dir_problem
from fsdp_jax.app.hf.config_in import model_config_from_hf
from fsdp_jax.app.hf.load import read_config_json
from fsdp_jax.errors import DataError, UsageError


def _check_vocab(args) -> None:
    """--model: the tokenizer's vocab must fit the model's embedding table."""

    tok = load_tokenizer(args.tokenizer, args.eos)
    if args.model:
        vocab = model_config_from_hf(read_config_json(args.model), f"{args.model}/config.json").vocab_size
        if tok.vocab_size > vocab:
            raise DataError(
                f"--tokenizer {args.tokenizer}: vocab size {tok.vocab_size} exceeds "
                f"--model {args.model} vocab_size {vocab}; use the model's own tokenizer"
            )


def _report_packed(out: str, meta: dict) -> None:
    """The packed corpus' summary line (stdout), and a warning line each (stderr) for examples
    truncated to a row and for chats whose template leaves some message text out."""
    pk = meta["packing"]
    print(
        f"{out}: {meta['examples']:,} examples ({', '.join(f'{k} {v}' for k, v in meta['kinds'].items())}) "
        f"-> train {meta['train_rows']:,} rows, val {meta['val_rows']:,} rows of {meta['row_len']} "
        f"tokens; packing efficiency {pk['efficiency']:.2%}; truncated {pk['truncated']}, "
        f"split {pk['split']}, skipped (nothing to train on) {pk['empty']}"
        + (f", first at {meta['first_empty']}" if meta["first_empty"] else "")
    )
    if pk["truncated"]:
        print(
            f"warning: {pk['truncated']:,} of {meta['examples']:,} examples are longer than a row of "
            f"{meta['row_len']} tokens and were truncated to it (first: {meta['first_truncated']}; "
            f"{pk['dropped_tokens']:,} tokens dropped): --overflow split keeps them whole across rows, "
            "or prepare with a larger --pack",
            file=sys.stderr,
        )
    if meta["template_dropped"]:
        print(
            f"warning: {meta['template_dropped']:,} of {meta['kinds'].get('chat', 0):,} chat examples have message "
            f"text their chat template does not render (first: {meta['first_template_dropped']}; e.g. a system "
            "prompt Mistral v0.3 shows only before a final user turn, or earlier turns' reasoning under Qwen3): "
            "trained as the template renders them, as transformers does",
            file=sys.stderr,
        )


def run(args) -> int:
    check_flags(args)  # and --out: fsdp_jax.app.cli.prepare's `before`, run before JAX too
    if args.threads:  # Hugging Face tokenizers take their thread count from the environment
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)

    problem = dir_problem(args.out)
    if problem:
        raise UsageError(f"--out {args.out!r} {problem}")
    if args.pack is not None:
        if args.tokenizer != "bytes":
            _check_vocab(args)

        meta = prepare_examples(
            args.sources,
            args.out,
            args.pack,
            args.val_fraction,
            args.seed,
            tokenizer=args.tokenizer,
            pattern=args.pattern,
            eos=args.eos,
            chat_template=args.chat_template,
            train_on="all" if args.train_on_all else "targets",
            overflow=args.overflow,
            threads=args.threads,
            progress=not args.no_progress,
            workers=args.workers,
            keys=KeyMap(args.messages_key, args.text_key, args.prompt_key, args.completion_key),
        )
        _report_packed(args.out, meta)
        return 0
    if args.bin is not None:
        meta = prepare_bin(args.bin, args.val_bin, args.out, args.vocab_size, args.dtype)
    elif args.tokenizer != "bytes":
        _check_vocab(args)
        tok = dict(tokenizer=args.tokenizer, eos=args.eos, threads=args.threads, progress=not args.no_progress)
        meta = (
            prepare_stdlib(args.out, args.val_fraction, args.seed, **tok)
            if args.stdlib
            else prepare_text(
                args.sources,
                args.out,
                args.val_fraction,
                args.seed,
                pattern=args.pattern,
                text_key=args.text_key,
                **tok,
            )
        )
    elif args.stdlib:
        meta = prepare_stdlib(args.out, args.val_fraction, args.seed)
    else:
        meta = prepare_text(
            args.sources, args.out, args.val_fraction, args.seed, pattern=args.pattern, text_key=args.text_key
        )
    print(
        f"{args.out}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens "
        f"(vocab {meta['vocab_size']}, {meta['dtype']})"
    )
    return 0
