"""Data for the recipes: bytes, or tokens of a local tokenizer streamed from a cached file.

Without a tokenizer the corpus is bytes in RAM (vocab 256), read file by file straight into the one
tensor that holds them (RAM: the text once; ``load_bytes``). With
``--tokenizer PATH`` (a ``tokenizers`` / Hugging Face ``tokenizer.json``, or a folder holding one;
read locally, nothing is downloaded) the corpus is tokenized once into a flat file of token ids,
cached under a key of the corpus files (names, sizes, modification times), the byte cap and the
tokenizer file's SHA-256, and read back with ``np.memmap``: a batch touches only its own windows,
so a corpus larger than RAM trains.

Split rule (both paths): a folder's files go to val by a stable hash of their relative path
(VAL_PERCENT%); when that leaves a split empty or val under 2% of the corpus, everything is cut by
position instead (bytes: at 90% of the bytes; tokens: at 90% of the tokens). Files are walked in
sorted path order and read only up to the cap (``--data-cap``, recipes/data_cap.py: default all of
the corpus, but MAX_CORPUS_BYTES of the default corpus as bytes): no file after it is opened, however
large; the rest is only listed (a stat per file) to say what the cap left out.
``get_batch`` draws the same windows for the same generator from either form.

Cost of building the cache: one pass over the corpus (read, tokenize, write 2 or 4 bytes per token),
file by file in pieces of PIECE_BYTES, so memory stays bounded by a piece whatever the corpus size.

Why one module over 400 lines: both forms of the corpus share its walk, split rule and cap, and the
cache's key is the walk's listing; the cap's own rules live in recipes/data_cap.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from recipes.data_cap import DEFAULT_CAP, Leftover, resolve_cap

VAL_PERCENT = 10
PIECE_BYTES = 4 * 2**20  # text tokenized at a time when building a cache
CACHE_VERSION = 1  # part of the cache key: bump when the file layout or the split rule changes


# ----------------------------------------------------------------------------- the corpus
def is_val(rel: str) -> bool:
    """Whether the file at relative path ``rel`` belongs to val: stable across runs and machines."""
    return zlib.crc32(rel.encode()) % 100 < VAL_PERCENT


def looks_binary(head: bytes) -> bool:
    return b"\x00" in head[:4096]


def walk(root: Path, keep: Callable[[str, bool], bool]) -> Iterator[Path]:
    """The files under ``root``, lazily, in sorted path order (that of ``sorted(root.rglob("*"))``: a
    folder's entries by name, a subfolder's files at the place of its name), reading a folder only
    when the walk reaches it. ``keep(name, is_dir)``: whether an entry (a folder: its whole subtree) is walked.
    Symbolic links to files are files; links to folders are not followed (as rglob); unreadable
    folders are skipped."""
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            is_dir = e.is_dir(follow_symlinks=False)
            is_file = not is_dir and e.is_file()
        except OSError:
            continue
        if (is_dir or is_file) and keep(e.name, is_dir):
            if is_dir:
                yield from walk(Path(e.path), keep)
            else:
                yield Path(e.path)


def corpus_files(path: str | os.PathLike | None) -> tuple[Path, Iterator[Path], str]:
    """(root, its files in sorted path order, description) of a text file or folder (recursively,
    hidden entries skipped), or by default the Python stdlib's *.py files (site-packages left out).
    The files are walked lazily (``walk``): a reader that stops early lists no further folders."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = walk(root, lambda name, is_dir: name != "site-packages" and (is_dir or name.endswith(".py")))
        return root, files, f"Python stdlib source ({root})"
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"--data: path {str(path)!r} does not exist")
    if root.is_file():
        return root, iter([root]), str(root)
    return root, walk(root, lambda name, is_dir: not name.startswith(".")), str(root)


def _rel(root: Path, f: Path) -> str:
    return f.name if f == root else str(f.relative_to(root))


def iter_documents(root: Path, files: Iterable[Path], max_bytes: int | None,
                   left: Leftover | None = None) -> Iterator[tuple[str, Path, int]]:
    """(relative path, file, bytes to read) of each readable, non-empty, non-binary file, in order,
    until ``max_bytes`` in all (the last one cut short); None: no cap. Once the cap is reached no
    further file is opened: without ``left`` none is taken from ``files`` either; with it the rest
    of ``files`` is listed (a stat each) and what the cap left out added to it."""
    if max_bytes is not None and max_bytes <= 0:
        return
    total = 0
    files = iter(files)
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(4096)
        except OSError:
            continue
        if size == 0 or not head or looks_binary(head):
            continue
        n = size if max_bytes is None else min(size, max_bytes - total)
        total += n
        yield _rel(root, f), f, n
        if max_bytes is not None and total >= max_bytes:
            if left is not None:
                left.bytes += size - n
                _count_rest(files, left)
            return


def _count_rest(files: Iterator[Path], left: Leftover) -> None:
    for f in files:
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if size:
            left.files, left.bytes = left.files + 1, left.bytes + size


@dataclass
class Corpus:
    """A corpus as token ids: ``train`` and ``val`` are 1-D torch tensors (bytes) or np.memmap views
    (tokens); ``get_batch`` takes either."""

    train: torch.Tensor | np.ndarray
    val: torch.Tensor | np.ndarray
    vocab_size: int
    source: str
    n_files: int
    cache: Path | None = None  # the cache folder (tokens only)
    reused: bool = False  # the cache was there already (tokens only)
    n_bytes: int | None = None  # text bytes read (None: a token cache that does not record it)
    cap: int | None = None  # the --data-cap in bytes it was read under (None: none)
    cap_is_default: bool = False  # that cap is the default corpus' (no --data-cap given)
    left_files: int = 0  # what the cap left out: files not read,
    left_bytes: int = 0  # and bytes (theirs, and the rest of the file it cut)


def load_bytes(path: str | os.PathLike | None = None, max_bytes: int | None | str = DEFAULT_CAP) -> Corpus:
    """The corpus as bytes in RAM (vocab 256): the GPT recipe's ``load_corpus``. ``max_bytes``: the
    cap (None: none; DEFAULT_CAP: ``resolve_cap``'s). The train documents joined by newlines, a
    newline, then the val ones, read file by file straight into one uint8 tensor sized from the
    listing (RAM: the text read, once; no copy); train and val are views of it."""
    cap = resolve_cap(max_bytes, path, None)
    root, files, source = corpus_files(path)
    left = Leftover()
    docs = list(iter_documents(root, files, cap, left))
    buf = torch.empty(sum(n for _, _, n in docs) + len(docs), dtype=torch.uint8)  # + a newline each at most
    view = memoryview(buf.numpy())
    at, ends, n_files, n_bytes = 0, {}, 0, 0
    for split in (False, True):
        start, count = at, 0
        for rel, f, n in docs:
            if is_val(rel) != split:
                continue
            sep = 1 if count else 0
            try:
                got = _read_into(f, view[at + sep:at + sep + n])  # the first n bytes, not the whole file
            except OSError:
                continue
            if sep:
                view[at] = 10  # documents are joined by a newline
            at, count, n_bytes = at + sep + got, count + 1, n_bytes + got
        ends[split] = (start, at, count)
        if not split and count:
            view[at] = 10  # train and val joined, kept if val has documents (a cut by position reads it)
            at += 1
        n_files += count
    if n_files == 0:
        raise ValueError(f"--data: no text data found in {source!r}")
    (_, train_end, _), (val_start, val_end, n_val) = ends[False], ends[True]
    train, val = buf[:train_end], buf[val_start:val_end]
    if cut_by_position(len(train), len(val)):
        everything = buf[:val_end if n_val else train_end]
        cut = len(everything) * (100 - VAL_PERCENT) // 100
        train, val = everything[:cut], everything[cut:]
    return Corpus(train, val, 256, source, n_files, n_bytes=n_bytes, cap=cap,
                  cap_is_default=cap is not None and max_bytes == DEFAULT_CAP, left_files=left.files,
                  left_bytes=left.bytes)


def _read_into(f: Path, out: memoryview) -> int:
    """Read the first ``len(out)`` bytes of ``f`` into ``out``; the count read (fewer at its end)."""
    got = 0
    with open(f, "rb", buffering=0) as fh:
        while got < len(out):
            k = fh.readinto(out[got:])
            if not k:
                break
            got += k
    return got


def cut_by_position(n_train: int, n_val: int) -> bool:
    """Whether a corpus whose files' hash split gave ``n_train`` and ``n_val`` is cut by position
    instead: one split empty (one file), or val under 2% of the whole."""
    return not n_train or not n_val or n_val < (n_train + n_val) // 50


def min_corpus(block_size: int) -> int:
    """The fewest bytes (tokens) of a corpus cut by position whose splits both hold a window of
    ``block_size`` and its next token (more than ``block_size + 1``): val is VAL_PERCENT%, rounded up."""
    return 100 * (block_size + 1) // VAL_PERCENT + 1


def get_batch(data: torch.Tensor | np.ndarray, batch_size: int, block_size: int, generator=None, device="cpu"):
    """Random windows: x = data[i:i+T], y = data[i+1:i+T+1] as int64 (B, T), the same windows for the
    same generator whatever the form of ``data``: a tensor, or an array / np.memmap (only the windows
    drawn are read)."""
    if len(data) <= block_size + 1:
        raise ValueError(f"split of {len(data)} tokens is too short for block_size={block_size}")
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    offsets = ix[:, None] + torch.arange(block_size + 1)
    if isinstance(data, torch.Tensor):
        chunk = data[offsets].long()
    else:
        chunk = torch.from_numpy(np.asarray(data)[offsets.numpy()].astype(np.int64))
    x, y = chunk[:, :-1], chunk[:, 1:]
    if str(device) != "cpu":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# ----------------------------------------------------------------------------- tokenizers
def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json file, or a folder holding one.

    Raises FileNotFoundError / ValueError naming --tokenizer, the path and what was expected.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"--tokenizer: expected a tokenizer.json file or a folder holding one, got "
                                f"{str(path)!r} (no such file: {str(p)!r})")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from e
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"--tokenizer: {str(p)!r} is not a tokenizers JSON file ({e})") from e


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def cache_key(path: str | os.PathLike | None, tokenizer: str | os.PathLike, max_bytes: int | None) -> str:
    """Hex key of a token cache: the corpus files' names, sizes and mtimes, the cap, and the tokenizer
    file's SHA-256. A file edited in place within one mtime tick and at the same size goes unseen."""
    root, files, _ = corpus_files(path)
    listing = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        listing.append((_rel(root, f), st.st_size, st.st_mtime_ns))
    spec = dict(version=CACHE_VERSION, root=str(root.resolve()), files=listing, max_bytes=max_bytes,
                tokenizer=file_sha256(_tokenizer_file(tokenizer)), val_percent=VAL_PERCENT)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _text_pieces(f: Path, n: int) -> Iterator[str]:
    """The first ``n`` bytes of ``f`` as text, in pieces of about PIECE_BYTES cut after a newline; in a
    line longer than a piece, before a space; in a run of PIECE_BYTES without either, at a UTF-8
    character boundary. Tokenizers that split words at newlines and spaces (byte-level BPE, whitespace
    pre-tokenizers) give the tokens of the whole text; only the last kind of cut may split a token."""
    with open(f, "rb") as fh:
        left, buf = n, b""
        while left > 0:
            block = fh.read(min(PIECE_BYTES, left))
            if not block:
                break
            left -= len(block)
            buf += block
            cut = buf.rfind(b"\n") + 1
            if cut == 0 and left > 0:  # no newline: cut before a space, where byte-level BPE starts a word
                cut = max(buf.rfind(b" "), 0)
            if cut == 0 and left > 0:  # nor a space: keep back a character the block may have cut in two
                cut = len(buf)
                while cut > 0 and buf[cut - 1] & 0xC0 == 0x80:  # continuation bytes
                    cut -= 1
                if cut > 0 and buf[cut - 1] >= 0xC0:  # the lead byte they belong to
                    cut -= 1
            if cut:
                yield buf[:cut].decode("utf-8", errors="replace")
                buf = buf[cut:]
        if buf:
            yield buf.decode("utf-8", errors="replace")


def _build(path, tok, out: Path, max_bytes: int | None, dtype) -> dict:
    """Tokenize the corpus into out/tokens.bin (train documents, then val documents); returns the meta."""
    root, files, source = corpus_files(path)
    sep = tok.encode("\n", add_special_tokens=False).ids  # documents are joined by a newline, as bytes are
    counts, n_files, n_bytes, left = {False: 0, True: 0}, 0, 0, Leftover()
    with open(out / "train.part", "wb") as train_f, open(out / "val.part", "wb") as val_f:
        for rel, f, n in iter_documents(root, files, max_bytes, left):
            split = is_val(rel)
            sink = val_f if split else train_f
            if counts[split]:
                sink.write(np.asarray(sep, dtype=dtype).tobytes())
                counts[split] += len(sep)
            for text in _text_pieces(f, n):
                ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=dtype)
                sink.write(ids.tobytes())
                counts[split] += len(ids)
            n_files, n_bytes = n_files + 1, n_bytes + n
    if n_files == 0:
        raise ValueError(f"--data: no text data found in {source!r}")
    with open(out / "tokens.bin", "wb") as dst:
        for part in ("train.part", "val.part"):
            with open(out / part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
            (out / part).unlink()
    n_train, n_val = counts[False], counts[True]
    total = n_train + n_val
    cut = n_train
    if cut_by_position(n_train, n_val):  # as the bytes path
        cut = total * (100 - VAL_PERCENT) // 100
    return dict(version=CACHE_VERSION, source=source, n_files=n_files, n_tokens=total, cut=cut,
                dtype=np.dtype(dtype).name, vocab_size=tok.get_vocab_size(), n_bytes=n_bytes, cap=max_bytes,
                left_files=left.files, left_bytes=left.bytes)


def _cache_folder(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / key[:24]


def is_cached(path: str | os.PathLike | None, tokenizer: str | os.PathLike, cache_dir: str | os.PathLike,
              max_bytes: int | None = None) -> bool:
    """Whether ``load_tokens`` would reuse a cache under ``cache_dir`` (and so write nothing there)."""
    return (_cache_folder(cache_dir, cache_key(path, tokenizer, max_bytes)) / "meta.json").is_file()


def load_tokens(path: str | os.PathLike | None, tokenizer: str | os.PathLike, cache_dir: str | os.PathLike,
                max_bytes: int | None = None) -> Corpus:
    """The corpus tokenized by ``tokenizer`` (a local tokenizer.json), as np.memmap views of a cache
    file under ``cache_dir/<key>/``: built on the first call (atomically: a half-built cache is never
    read), reused by every later call with the same corpus files, cap and tokenizer.

    Processes that build the same key at once each build in a private folder; the first rename
    wins and the others use it.
    """
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    key = cache_key(path, tokenizer, max_bytes)
    final = _cache_folder(cache_dir, key)
    reused = (final / "meta.json").is_file()
    if not reused:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        # a folder of its own: ranks on two machines sharing OUT may have the same pid
        tmp = Path(cache_dir) / f".{key[:24]}.{uuid.uuid4().hex}.tmp"
        tmp.mkdir()
        try:
            meta = _build(path, tok, tmp, max_bytes, dtype)
            meta["key"] = key
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; debris after a failure
    meta = json.loads((final / "meta.json").read_text())
    if meta.get("key") != key:
        raise ValueError(f"token cache {str(final)!r}: its key {meta.get('key')!r} is not this corpus' {key!r}")
    want = meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize
    got = (final / "tokens.bin").stat().st_size
    if got != want:
        raise ValueError(f"token cache {str(final / 'tokens.bin')!r}: {got} bytes, expected {want} "
                         f"({meta['n_tokens']} {meta['dtype']} tokens); delete the folder to rebuild it")
    tokens = np.memmap(final / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))
    cut = meta["cut"]
    return Corpus(tokens[:cut], tokens[cut:], meta["vocab_size"], meta["source"], meta["n_files"], final, reused,
                  n_bytes=meta.get("n_bytes"), cap=max_bytes, left_files=meta.get("left_files", 0),
                  left_bytes=meta.get("left_bytes", 0))  # a cache built before these were recorded: unsaid


def load(path: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
         cache_dir: str | os.PathLike | None = None, max_bytes: int | None | str = DEFAULT_CAP) -> Corpus:
    """The recipes' one entry: bytes without a tokenizer, else cached tokens (``cache_dir`` required).
    ``max_bytes`` caps the text read (None: no cap); DEFAULT_CAP: ``resolve_cap``'s, all of the
    corpus but MAX_CORPUS_BYTES of the default corpus as bytes."""
    if tokenizer is None:
        return load_bytes(path, max_bytes)
    if cache_dir is None:
        raise ValueError("cache_dir: a folder for the token cache is needed with a tokenizer")
    return load_tokens(path, tokenizer, cache_dir, resolve_cap(max_bytes, path, tokenizer))


# ----------------------------------------------------------------------------- text <-> ids
class ByteCodec:
    """Text as UTF-8 bytes: vocab 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """Text through a ``tokenizers.Tokenizer`` (no special tokens added)."""

    def __init__(self, tok):
        self.tok, self.vocab_size = tok, tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def codec(tokenizer: str | os.PathLike | None = None) -> ByteCodec | TokenizerCodec:
    """Encode/decode for prompts and samples: bytes without a tokenizer, else the tokenizer's."""
    return ByteCodec() if tokenizer is None else TokenizerCodec(load_tokenizer(tokenizer))
