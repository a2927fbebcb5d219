"""Encoding batches of fine-tuning examples in worker processes: in order, bounded.

    spec = EncoderSpec("ckpt/", eos=None, chat_template=src, specials={...}, train_on="targets")
    for items, examples in encode_batches(spec, batches, workers=4):
        ...                       # the same (items, examples) pairs, in the same order, as workers=1

Rendering a chat template is Python (jinja2) and holds the GIL, so threads cannot
spread it over cores: `workers` > 1 starts that many processes (the `forkserver`
method: a fresh server process imports this module once and forks the workers, so no
process that already runs JAX's or the tokenizer's threads is forked, and the imports
are paid once), each of which loads the tokenizer and compiles the template once and
encodes whole batches. As with any `multiprocessing` start method but fork, a script
that calls this must guard its entry point with `if __name__ == "__main__":`.
The main process submits batches and takes the results back strictly in input
order, with at most `2 x workers` batches in flight, so the output is byte for byte
the output of one worker and memory stays bounded by the batches in flight. An
error is the one the serial run would raise first: a batch's `ExampleError` comes
before a read error in a later batch. Each worker's tokenizer gets `threads` threads
(default 1 with several workers: the processes are the parallelism).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable, Iterator

from fsdp_jax.app.examples import Example, ExampleEncoder


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """What a worker needs to build the `ExampleEncoder` (picklable: paths and text)."""
    tokenizer: str                  # "bytes" or a tokenizer path (`fsdp_jax.app.tokenizer`)
    eos: str | None = None
    chat_template: str | None = None  # the template's source text
    specials: dict = dataclasses.field(default_factory=dict)
    train_on: str = "targets"
    threads: int | None = None

    def build(self) -> ExampleEncoder:
        from fsdp_jax.app.tokenizer import load_tokenizer
        tok = None if self.tokenizer == "bytes" else load_tokenizer(self.tokenizer, self.eos)
        return ExampleEncoder(tok, self.chat_template, self.specials, self.train_on)


_ENCODER: ExampleEncoder | None = None
_THREADS: int | None = None


def _init_worker(spec: EncoderSpec) -> None:
    global _ENCODER, _THREADS
    _THREADS = spec.threads or 1
    os.environ["RAYON_NUM_THREADS"] = str(_THREADS)  # before `tokenizers` starts its pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if _THREADS > 1 else "false"
    _ENCODER = spec.build()


def _encode(items: list) -> list[Example]:
    return _ENCODER.encode_batch(items, _THREADS)


def encode_batches(spec: EncoderSpec, batches: Iterable[list], workers: int = 1,
                   encoder: ExampleEncoder | None = None) -> Iterator[tuple[list, list[Example]]]:
    """(items, `encoder.encode_batch(items)`) for each batch (a list) of (record, "file:line")
    items, in input order; `workers` processes (1: this process, with `encoder` if given).
    Anything else in `batches` (a long file the caller streams itself) comes back as
    (it, None), in its place in the order."""
    if workers < 1:
        raise ValueError(f"workers {workers}: must be >= 1")
    if workers == 1:
        enc = encoder or spec.build()
        for items in batches:
            yield items, (enc.encode_batch(items, spec.threads) if isinstance(items, list) else None)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", __name__])  # imported once, in the server
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec,))
    pending: collections.deque = collections.deque()
    try:
        it = iter(batches)
        while True:
            try:
                items = next(it)
            except StopIteration:
                break
            except Exception:  # reading failed: an earlier batch's error comes first, as in order
                for _, fut in pending:
                    fut.result()
                raise
            if not isinstance(items, list):  # not a batch (a long file): passed on, in order
                while pending:
                    first, fut = pending.popleft()
                    yield first, fut.result()
                yield items, None
                continue
            pending.append((items, pool.submit(_encode, items)))
            if len(pending) >= 2 * workers:
                first, fut = pending.popleft()
                yield first, fut.result()
        while pending:
            first, fut = pending.popleft()
            yield first, fut.result()
    except BrokenProcessPool as e:  # a worker was killed (out of memory, a signal)
        raise OSError(f"an encoding worker process died ({' '.join(str(e).split())[:160]})") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
