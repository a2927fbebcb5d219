"""Prepare a token corpus directory (train.bin, val.bin, meta.json) for training.

    fsdp-jax prepare --out data/stdlib --stdlib
    fsdp-jax prepare --out data/mine notes/ book.txt --pattern '*.txt'
    fsdp-jax prepare --out data/mine --bin train.bin --val-bin val.bin --vocab-size 32000
    fsdp-jax prepare --out data/mine docs/ --tokenizer checkpoints/Llama-2-7b-hf

(`python scripts/prepare.py ...` is the same command.) --tokenizer takes a Hugging Face tokenizer.json, a SentencePiece .model or a model
directory holding one: each file (each line of a .jsonl file, {"text": ...}) is a
document, encoded as encode(doc) + [eos], with the library's threads and a progress
bar; token dtype from the vocab size; meta.json records the tokenizer so the
trainer's text sample decodes with it. --model DIR (a Hugging Face model) checks
that the tokenizer's vocab fits the model's before anything is written.

--pack ROW_LEN prepares fine-tuning examples instead (docs/finetuning_data.md): each
.jsonl line is a chat {"messages": [...]} (rendered with the tokenizer's chat template),
an instruction {"prompt", "completion"} or a plain {"text"}; a text file is one plain
example. Only assistant turns / completions are trained on (--train-on-all: every
token); examples are packed into rows of ROW_LEN tokens with segment ids, longer ones
truncated or split (--overflow); the packing report is printed. --workers N renders
and tokenizes in N processes (the output is identical to one worker's).

    fsdp-jax prepare --out data/sft chats.jsonl --pack 512 --tokenizer ckpt/

Sources may also be tables: .parquet files and Hugging Face `datasets` directories
(`save_to_disk`), read a batch of rows at a time (pip install 'fsdp_jax[data]'); a row is
a record like a .jsonl line. --messages-key, --text-key, --prompt-key and --completion-key
name the keys (columns) that hold them, e.g. --messages-key conversations.

    fsdp-jax prepare --out data/sft my_dataset/ --pack 2048 --tokenizer ckpt/ --messages-key conversations

Exit codes: 0 success, 2 bad input (one line on stderr), 1 anything else (the disk, an
I/O error: one line, nothing half-written).
"""

from __future__ import annotations

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in
from fsdp_jax.app.data.packing import MAX_ROW_LEN
from fsdp_jax.app.data.writable import dir_problem
from fsdp_jax.errors import TokenizerError, UsageError


def build_parser(prog: str | None = None) -> Parser:
    p = Parser(prog=prog, description=__doc__)
    p.add_argument("sources", nargs="*", help="text files or directories (searched recursively)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--stdlib", action="store_true", help="use this Python's stdlib source")
    p.add_argument("--pattern", default="*", help="file glob inside directories (default '*')")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bin", help="pre-tokenized train token file")
    p.add_argument("--val-bin", help="pre-tokenized val token file")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the --bin files")
    p.add_argument("--dtype", choices=("uint16", "uint32"), help="dtype of the --bin files")
    p.add_argument(
        "--tokenizer", default="bytes", help="bytes (default), a tokenizer.json, a SentencePiece .model or a model dir"
    )
    p.add_argument("--eos", help="end-of-document token (default: from the tokenizer)")
    p.add_argument("--threads", type=int_in(1), default=None, help="encoding threads (default: all)")
    p.add_argument("--model", help="Hugging Face model dir whose vocab_size the tokenizer must fit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--pack", type=int_in(2), metavar="ROW_LEN", help="fine-tuning examples packed into rows of ROW_LEN tokens"
    )
    p.add_argument(
        "--train-on-all",
        action="store_true",
        help="--pack: train on every token (default: assistant turns / completions only)",
    )
    p.add_argument(
        "--overflow",
        choices=("truncate", "split"),
        default="truncate",
        help="--pack: an example longer than a row is truncated (default) or split",
    )
    p.add_argument("--chat-template", help="--pack: a jinja chat template file (default: the tokenizer's)")
    for key, what in (("text", "a text"), ("messages", "a chat's messages"), ("prompt", "a prompt")):
        p.add_argument(
            f"--{key}-key", default=key, metavar="KEY", help=f"the key (column) holding {what} (default {key})"
        )
    p.add_argument("--completion-key", default="completion", metavar="KEY", help="the key holding a completion")
    p.add_argument(
        "--workers",
        type=int_in(1),
        default=1,
        help="--pack: processes rendering and tokenizing examples (default 1; same output)",
    )
    return p


def _errors():

    return (TokenizerError,), ()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), "fsdp_jax.app.cli.run.prepare:run", argv, errors=_errors, before=_before)


def _before(args) -> None:
    """The body's first refusals, which need no JAX, in its order: the flags, then --out."""
    check_flags(args)
    problem = dir_problem(args.out)
    if problem:
        raise UsageError(f"--out {args.out!r} {problem}")


def check_flags(args) -> None:
    """UsageError for flags that do not go together or are out of range (before any work)."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1")
    if args.pack is not None:
        if not args.sources:
            raise UsageError("--pack needs SOURCES... (jsonl or text files)")

        if not 2 <= args.pack <= MAX_ROW_LEN:
            raise UsageError(f"--pack {args.pack}: must be in 2..{MAX_ROW_LEN}")
    elif args.train_on_all or args.chat_template or args.overflow != "truncate" or args.workers != 1:
        raise UsageError("--train-on-all, --overflow, --chat-template and --workers need --pack")
    elif (args.messages_key, args.prompt_key, args.completion_key) != ("messages", "prompt", "completion"):
        raise UsageError("--messages-key, --prompt-key and --completion-key need --pack")
    for flag in ("text_key", "messages_key", "prompt_key", "completion_key"):
        if not getattr(args, flag).strip():
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: must name a key")
    if args.text_key != "text" and args.bin is not None:
        raise UsageError("--text-key applies to SOURCES..., not to --bin files")
    modes = [bool(args.sources), args.stdlib, args.bin is not None]
    if sum(modes) != 1:
        raise UsageError("give exactly one of: SOURCES..., --stdlib, --bin")
    if args.bin is not None and (args.val_bin is None or args.vocab_size is None):
        raise UsageError("--bin needs --val-bin and --vocab-size")
    if args.tokenizer != "bytes" and not args.sources and not args.stdlib:
        raise UsageError("--tokenizer applies to SOURCES... or --stdlib, not to --bin files")
    if (args.eos or args.model) and args.tokenizer == "bytes":
        raise UsageError("--eos and --model need --tokenizer")
    if not 0 < args.val_fraction < 1:  # (also rejects nan)
        raise UsageError(f"--val-fraction {args.val_fraction}: must be in (0, 1)")
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be >= 0")
    if args.vocab_size is not None and not 0 < args.vocab_size <= 2**32:
        raise UsageError(f"--vocab-size {args.vocab_size}: must be in 1..2**32")
