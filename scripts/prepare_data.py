"""Prepare a token corpus directory (train.bin, val.bin, meta.json) for training.

    python scripts/prepare_data.py --out data/stdlib --stdlib
    python scripts/prepare_data.py --out data/mine notes/ book.txt --pattern '*.txt'
    python scripts/prepare_data.py --out data/mine --bin train.bin --val-bin val.bin --vocab-size 32000

Exit codes: 0 success, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parse(argv):
    p = _Parser(description="Tokenize text (bytes) or adopt pre-tokenized .bin files.")
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
    args = p.parse_args(argv)
    modes = [bool(args.sources), args.stdlib, args.bin is not None]
    if sum(modes) != 1:
        p.error("give exactly one of: SOURCES..., --stdlib, --bin")
    if args.bin is not None and (args.val_bin is None or args.vocab_size is None):
        p.error("--bin needs --val-bin and --vocab-size")
    if not 0 < args.val_fraction < 1:  # (also rejects nan)
        p.error(f"--val-fraction {args.val_fraction}: must be in (0, 1)")
    if args.seed < 0:
        p.error(f"--seed {args.seed}: must be >= 0")
    if args.vocab_size is not None and not 0 < args.vocab_size <= 2**32:
        p.error(f"--vocab-size {args.vocab_size}: must be in 1..2**32")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    from fsdp_jax.app import data  # after parsing: --help and bad flags stay fast

    problem = data.dir_problem(args.out)
    if problem:
        print(f"error: --out {args.out!r} {problem}", file=sys.stderr)
        return 2
    try:
        if args.bin is not None:
            meta = data.prepare_bin(args.bin, args.val_bin, args.out, args.vocab_size, args.dtype)
        elif args.stdlib:
            meta = data.prepare_stdlib(args.out, args.val_fraction, args.seed)
        else:
            meta = data.prepare_text(args.sources, args.out, args.val_fraction, args.seed,
                                     pattern=args.pattern)
    except data.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment (disk full, I/O error): one line, nothing half-written
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"{args.out}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens "
          f"(vocab {meta['vocab_size']}, {meta['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
