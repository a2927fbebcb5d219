"""One encoding worker process of `fsdp_jax.app.data.encode_pool`: frames in on stdin, frames out
on stdout, no pickle.

A frame is an 8-byte little-endian length and that many bytes. The parent sends the
`EncoderSpec` as a JSON object first, then one JSON list of [record, "file:line"] pairs
per batch. For each batch, in order, the worker answers with a JSON header
{"kinds": [...], "lens": [...], "dropped": [0 | 1, ...]} and one frame of the tokens (int32, little-endian) then the
masks (uint8) of all the batch's examples back to back, or with the header
{"error": class name, "message": ..., "args": [...]} alone. End of stdin (the parent is done, or dead) ends
the worker; so does a broken stdout. Ctrl-C is the parent's to handle (ignored here).

Started by `encode_pool` as `python -c BOOT <package dir>`: BOOT registers the
package directory as a bare `fsdp_jax` package, so the worker imports only the
tokenizer and template modules, not `fsdp_jax/__init__` (JAX: 1.3 s per worker).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import struct
import sys
import threading
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from fsdp_jax.app.data.examples import ExampleEncoder
from fsdp_jax.app.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from fsdp_jax.app.data.examples import ExampleEncoder

LEN = struct.Struct("<Q")

BOOT = (
    "import sys, types; p = types.ModuleType('fsdp_jax'); p.__path__ = [sys.argv[1]]; "
    "sys.modules['fsdp_jax'] = p; from fsdp_jax.app.data.encode_worker import main; main()"
)


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """What a worker needs to build the `ExampleEncoder` (paths and text: sent to it as JSON);
    `fsdp_jax.app.data.encode_pool.EncoderSpec`."""

    tokenizer: str  # "bytes" or a tokenizer path (`fsdp_jax.app.data.tokenizer`)
    eos: str | None = None
    chat_template: str | None = None  # the template's source text
    specials: dict = dataclasses.field(default_factory=dict)
    train_on: str = "targets"
    threads: int | None = None

    def build(self) -> ExampleEncoder:

        tok = None if self.tokenizer == "bytes" else load_tokenizer(self.tokenizer, self.eos)
        return ExampleEncoder(tok, self.chat_template, self.specials, self.train_on)


def write_frame(f: BinaryIO, *parts: bytes) -> None:
    f.write(LEN.pack(sum(len(p) for p in parts)))
    for p in parts:
        f.write(p)


def read_frame(f: BinaryIO) -> bytearray | None:
    """The next frame's bytes; None at a clean end of the stream. A stream cut inside a
    frame raises EOFError."""
    head = f.read(LEN.size)
    if not head:
        return None
    if len(head) < LEN.size:
        raise EOFError("the stream ended inside a frame")
    buf = bytearray(LEN.unpack(head)[0])
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            raise EOFError("the stream ended inside a frame")
        got += n
    return buf


def encode_reply(examples) -> tuple[bytes, bytes]:
    """(header, body) frames for a batch's `Example`s."""
    header = json.dumps(
        {
            "kinds": [e.kind for e in examples],
            "lens": [len(e.tokens) for e in examples],
            "dropped": [int(e.dropped) for e in examples],
        }
    )
    tokens = [np.ascontiguousarray(e.tokens, "<i4") for e in examples]
    masks = [np.ascontiguousarray(e.mask, np.uint8) for e in examples]
    body = b"".join([t.tobytes() for t in tokens] + [m.tobytes() for m in masks])
    return header.encode(), body


def error_reply(e: BaseException) -> bytes:
    """{"error": class name, "message": str(e), "args": e.args (when JSON can carry them)}."""
    reply = {"error": type(e).__name__, "message": str(e)}
    try:
        return json.dumps({**reply, "args": list(e.args)}).encode()
    except (TypeError, ValueError):
        return json.dumps(reply).encode()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    spec_frame = read_frame(stdin)
    if spec_frame is None:
        return
    spec = EncoderSpec(**json.loads(spec_frame))
    # Requests are read by a thread of their own, so that stdin is always drained (from
    # before the tokenizer loads): the parent never blocks writing a batch while this process
    # is busy, and a reply this process writes is never stuck behind a batch it has not read.
    requests: queue.Queue = queue.Queue()

    def read_requests():
        try:
            while (frame := read_frame(stdin)) is not None:
                requests.put(frame)
        except (OSError, EOFError):
            pass
        requests.put(None)

    threading.Thread(target=read_requests, daemon=True).start()
    threads = spec.threads or 1
    try:
        encoder, failed = spec.build(), None
    except Exception as e:  # told with every batch: the parent raises it in order
        encoder, failed = None, e
    try:
        while (frame := requests.get()) is not None:
            try:
                if failed is not None:
                    raise failed
                examples = encoder.encode_batch([(rec, where) for rec, where in json.loads(frame)], threads)
                header, body = encode_reply(examples)
                write_frame(stdout, header)
                write_frame(stdout, body)
            except Exception as e:
                write_frame(stdout, error_reply(e))
            stdout.flush()
    except BrokenPipeError:  # the parent is gone: no flush at exit (it would fail again)
        os._exit(0)


if __name__ == "__main__":
    main()
