"""Tables as corpus sources: `.parquet` files and Hugging Face `datasets` directories.

    for n, row in table_rows(Path("chats.parquet")):     # (1-based row number, dict)
        ...

A `datasets` directory is what `Dataset.save_to_disk` writes: `state.json` naming its Arrow
files (`_data_files`), `dataset_info.json`, and the files, Arrow IPC streams. Both kinds are
read with pyarrow alone (`pip install 'fsdp_jax[data]'`), a record batch at a time (a parquet
row group, an Arrow stream's batch), so memory is bounded by a batch, not the table; a row is
a dict of its columns as Python values (nested lists and structs included; a struct field a
row lacks reads as None, which chat rendering drops as transformers does). A `DatasetDict`
directory (`dataset_dict.json`, one folder per split) is refused with the splits to choose
from. Unreadable tables are DataError, one line naming the file.

`KeyMap` maps a source's column names onto the record keys examples are told by
(`messages`, `text`, `prompt`, `completion`; `fsdp_jax.app.data.examples`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

from fsdp_jax.app.extras import require
from fsdp_jax.errors import DataError, ExampleError

BATCH_ROWS = 1024  # rows per parquet batch read


def is_datasets_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def is_table(p: Path) -> bool:
    """A .parquet file or a `datasets` directory."""
    return (p.suffix == ".parquet" and p.is_file()) or is_datasets_dir(p)


def _arrow_files(d: Path) -> list[Path]:
    if (d / "dataset_dict.json").is_file():
        try:
            splits = json.loads((d / "dataset_dict.json").read_text()).get("splits") or []
        except ValueError:
            splits = []
        names = ", ".join(f"{d / s}" for s in splits) or "its split folders"
        raise DataError(f"{d}: a DatasetDict of splits {', '.join(map(str, splits))}; give one split: {names}")
    try:
        state = json.loads((d / "state.json").read_text())
        files = [d / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{d}/state.json: not a datasets state file (no _data_files list)") from None
    for f in files:
        if not f.is_file() or f.parent != d:
            raise DataError(f"{d}/state.json names {f.name!r}, which is not a file in {d}")
    return files


def table_size(p: Path) -> int:
    """Bytes of the table's files (what progress and batching count)."""
    if p.is_dir():
        return sum(f.stat().st_size for f in _arrow_files(p))
    return p.stat().st_size


def _pyarrow():

    return require("pyarrow", "reading .parquet files and datasets directories")


def table_rows(p: Path) -> Iterator[tuple[int, dict]]:
    """(1-based row number, row as a dict) of a table, a record batch at a time."""
    pa = _pyarrow()
    n = 0
    for f in _arrow_files(p) if p.is_dir() else [p]:
        try:
            with contextlib.ExitStack() as stack:
                if p.is_dir():
                    source = stack.enter_context(pa.memory_map(str(f)))
                    batches = iter(stack.enter_context(pa.ipc.open_stream(source)))
                else:
                    import pyarrow.parquet as pq

                    batches = stack.enter_context(pq.ParquetFile(str(f))).iter_batches(batch_size=BATCH_ROWS)
                for batch in batches:
                    for row in batch.to_pylist():
                        n += 1
                        yield n, row
        except (pa.ArrowException, OSError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kind = "Arrow stream" if p.is_dir() else "parquet"
            raise DataError(f"{f}: not a readable {kind} file ({msg[:160]})") from None


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """Source key (column) for each record key; the defaults are the record keys themselves."""

    messages: str = "messages"
    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"

    @property
    def identity(self) -> bool:
        return self == KeyMap()

    def apply(self, rec, where: str):
        """`rec` with its mapped keys renamed to the record keys (other keys dropped); a dict
        holding none of them is ExampleError naming the keys looked for."""
        if self.identity or not isinstance(rec, dict):
            return rec
        out = {k: rec[src] for k, src in dataclasses.asdict(self).items() if src in rec}
        if not out:
            looked = ", ".join(f'"{v}"' for v in dict.fromkeys(dataclasses.asdict(self).values()))
            raise ExampleError(f"{where}: none of the keys {looked} (--messages-key, --text-key, ...) is in it")
        return out


def source_size(p: Path) -> int:
    """Bytes of a source: a table's files, or the file."""
    return table_size(p) if is_table(p) else p.stat().st_size


def is_tabular(p: Path) -> bool:
    """Sources read as records rather than text: .jsonl and tables."""
    return p.suffix == ".jsonl" or is_table(p)
