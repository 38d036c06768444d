"""recipes/data.py: bytes exactly as recipes/gpt.py reads them (read straight into their tensor, up to
--data-cap, saying what it left out); a local tokenizer's tokens cached once in
a memory-mapped file, streamed in pieces, reused while the corpus and tokenizer stay the same."""
import json
import os

import numpy as np
import pytest
import torch

from recipes import data, data_cap, gpt

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega déjà vu naïve café").split()


def text(i: int, n_lines: int = 12) -> str:
    g = torch.Generator().manual_seed(i)
    return "".join(" ".join(WORDS[j] for j in torch.randint(len(WORDS), (8,), generator=g)) + "\n"
                   for _ in range(n_lines))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of 40 small text files in two subfolders, plus a binary one and a hidden one (skipped)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        f = root / f"part{i % 2}" / f"doc{i:02d}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(text(i))
    (root / "blob.bin").write_bytes(b"\x00\x01" * 100)
    (root / ".hidden").write_text("not part of the corpus\n")
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus):
    """A byte-level BPE of 300 tokens trained on the corpus, saved as a tokenizers JSON file."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([f.read_text() for f in sorted(corpus.rglob("*.txt"))], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


# ----------------------------------------------------------------------------- bytes, as today
def test_bytes_are_the_gpt_recipes_corpus(corpus, tmp_path):
    single = tmp_path / "one.txt"
    single.write_text(text(99, 200))
    for path in (corpus, single):
        ours, theirs = data.load(path), data.load_bytes(path)
        assert torch.equal(ours.train, theirs.train) and torch.equal(ours.val, theirs.val)
        assert (ours.vocab_size, ours.n_files, ours.source) == (256, theirs.n_files, theirs.source)
    assert data.load(corpus).n_files == 40  # the binary and the hidden file are skipped


def test_get_batch_draws_the_gpt_recipes_windows_from_tensors_and_arrays(corpus):
    train = data.load(corpus).train
    want = data.get_batch(train, 4, 16, torch.Generator().manual_seed(5))
    for source in (train, train.numpy(), np.asarray(train.numpy(), dtype=np.uint16)):
        x, y = data.get_batch(source, 4, 16, torch.Generator().manual_seed(5))
        assert x.dtype == torch.int64 and torch.equal(x, want[0]) and torch.equal(y, want[1])
    with pytest.raises(ValueError, match="split of 10 tokens is too short for block_size=16"):
        data.get_batch(np.zeros(10, np.uint16), 2, 16)


def test_the_baseline_counts_a_split_in_pieces_as_it_would_whole():
    from recipes import task

    ids = torch.randint(0, 250, (10_007,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    ids[5] = 255  # beyond the vocab asked for: counted, as bincount counts it
    whole = torch.bincount(ids.long(), minlength=200).double()
    for tokens in (ids, ids.numpy(), ids.numpy().astype(np.uint16)):
        assert torch.equal(task.token_counts(tokens, 200, piece=1000), whole)
    assert torch.equal(task.token_counts(ids[:0], 7), torch.zeros(7, dtype=torch.float64))


# ----------------------------------------------------------------------------- tokens
def test_tokens_round_trip_to_the_same_split_as_bytes(corpus, tokenizer, tmp_path):
    tokens = data.load(corpus, tokenizer, tmp_path / "cache")
    as_bytes = data.load(corpus)
    assert len(as_bytes.val) > 0 and not tokens.reused
    assert isinstance(tokens.train, np.memmap) and tokens.train.dtype == np.uint16 and tokens.vocab_size == 300
    codec = data.codec(tokenizer)
    assert codec.decode(tokens.train) == bytes(as_bytes.train.tolist()).decode()
    assert codec.decode(tokens.val) == bytes(as_bytes.val.tolist()).decode()
    assert len(tokens.train) < 0.75 * len(as_bytes.train)  # BPE merged something
    x, y = data.get_batch(tokens.train, 3, 8, torch.Generator().manual_seed(0))
    assert x.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 300


def test_the_cache_is_built_once_and_reused_until_the_corpus_or_tokenizer_changes(corpus, tokenizer, tmp_path):
    cache = tmp_path / "cache"
    first = data.load(corpus, tokenizer, cache)
    stamp = (first.cache / "tokens.bin").stat().st_mtime_ns
    second = data.load(corpus, tokenizer, cache)
    assert second.reused and second.cache == first.cache
    assert (second.cache / "tokens.bin").stat().st_mtime_ns == stamp
    assert np.array_equal(second.train, first.train) and np.array_equal(second.val, first.val)
    capped = data.load(corpus, tokenizer, cache, max_bytes=1000)  # another cap: another cache
    assert not capped.reused and capped.cache != first.cache and len(capped.train) < len(first.train)
    edited = corpus / "part0" / "doc00.txt"
    before = edited.read_text()
    try:
        edited.write_text(before + "one more line\n")
        rebuilt = data.load(corpus, tokenizer, cache)
        assert not rebuilt.reused and rebuilt.cache != first.cache
    finally:
        edited.write_text(before)
    assert sorted(p.name for p in cache.iterdir()) == sorted({first.cache.name, capped.cache.name,
                                                              rebuilt.cache.name})  # no debris


def test_a_file_is_tokenized_in_pieces_as_it_would_be_whole(tokenizer, tmp_path, monkeypatch):
    f = tmp_path / "long.txt"
    long_line = " ".join(WORDS * 3)  # longer than a piece: cut before spaces
    body = text(7, 50) + long_line + "\n" + text(8, 5)
    f.write_text(body)
    monkeypatch.setattr(data, "PIECE_BYTES", 37)
    pieces = list(data._text_pieces(f, f.stat().st_size))
    assert len(pieces) > 50 and "".join(pieces) == body
    got = data.load(f, tokenizer, tmp_path / "cache")
    whole = data.codec(tokenizer).encode(body)
    assert np.concatenate([got.train, got.val]).tolist() == whole  # one file: cut by position, 90%
    assert len(got.train) == len(whole) * 9 // 10


def test_a_run_without_newline_or_space_is_cut_at_character_boundaries(tmp_path, monkeypatch):
    f = tmp_path / "run.txt"
    body = "é" * 40 + "x" + "€" * 30  # 2- and 3-byte characters: a block edge falls inside some
    f.write_text(body)
    monkeypatch.setattr(data, "PIECE_BYTES", 7)
    pieces = list(data._text_pieces(f, f.stat().st_size))
    assert len(pieces) > 10 and "".join(pieces) == body and "\ufffd" not in "".join(pieces)


def test_bad_tokenizers_and_caches_are_named(corpus, tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer: expected a tokenizer.json file or a folder holding one"):
        data.load(corpus, tmp_path / "nope.json", tmp_path / "cache")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizers JSON file"):
        data.load(corpus, bad.parent, tmp_path / "cache")  # a folder holding tokenizer.json is accepted
    with pytest.raises(ValueError, match="cache_dir: a folder for the token cache is needed"):
        data.load(corpus, tokenizer)
    with pytest.raises(FileNotFoundError, match="--data: path '/no/such/corpus' does not exist"):
        data.load("/no/such/corpus", tokenizer, tmp_path / "cache")
    built = data.load(corpus, tokenizer, tmp_path / "cache")
    with open(built.cache / "tokens.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(ValueError, match="tokens.bin.*10 bytes, expected .*delete the folder to rebuild it"):
        data.load(corpus, tokenizer, tmp_path / "cache")


def test_codecs_round_trip(tokenizer):
    s = "theta iota déjà vu\n"
    for c in (data.codec(), data.codec(tokenizer)):
        assert c.decode(c.encode(s)) == s
    assert data.codec().vocab_size == 256 and data.codec(tokenizer).vocab_size == 300


def test_the_cache_records_what_it_holds(corpus, tokenizer, tmp_path):
    built = data.load(corpus, tokenizer, tmp_path / "cache")
    meta = json.loads((built.cache / "meta.json").read_text())
    assert meta["n_tokens"] == len(built.train) + len(built.val) and meta["cut"] == len(built.train)
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["n_files"] == 40
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    assert os.path.getsize(built.cache / "tokens.bin") == 2 * meta["n_tokens"]


def test_tokens_say_what_the_cap_left_out_as_bytes_do(corpus, tokenizer, tmp_path):
    as_bytes, tokens = data.load(corpus, max_bytes=1000), data.load(corpus, tokenizer, tmp_path / "c", max_bytes=1000)
    again = data.load(corpus, tokenizer, tmp_path / "c", max_bytes=1000)  # from the cache's meta
    for got in (tokens, again):
        assert (got.n_files, got.n_bytes, got.cap, got.left_files, got.left_bytes) == (
            as_bytes.n_files, 1000, 1000, as_bytes.left_files, as_bytes.left_bytes) and got.left_files > 0
        assert data_cap.used(got) == data_cap.used(as_bytes)
    whole = data.load(corpus, tokenizer, tmp_path / "c")  # tokens: all of it by default
    assert whole.cap is None and whole.left_bytes == 0 and whole.n_files == 40


# ----------------------------------------------------------------------------- small and large corpora
def test_a_corpus_too_small_for_a_val_split_is_cut_by_position_not_left_without_one(tmp_path, tokenizer):
    tiny = tmp_path / "tiny.txt"  # its name hashes to train: under 50 bytes its val share rounded to 0
    tiny.write_bytes(b"the quick brown fox jumps over the lazy dog.\n")
    assert not data.is_val(tiny.name)
    got = data.load(tiny)
    assert (len(got.train), len(got.val)) == (40, 5)
    assert bytes(got.train.tolist()) + bytes(got.val.tolist()) == tiny.read_bytes()
    tokens = data.load(tiny, tokenizer, tmp_path / "cache")
    assert len(tokens.val) > 0 and len(tokens.train) > 0
    one = tmp_path / "one.txt"
    one.write_bytes(b"x")
    assert (len(data.load(one).train), len(data.load(one).val)) == (0, 1)  # empty tensors, no crash
    assert data.min_corpus(32) == 331  # both splits more than 33: val is 10%, rounded up


def test_a_large_file_is_read_only_up_to_the_cap(tmp_path):
    import tracemalloc

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 64 MiB, sparse: text first, then a hole
        f.write(b"some text\n" * 1000)
        f.truncate(64 * 2**20)
    tracemalloc.start()
    try:
        got = data.load_bytes(big, max_bytes=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got.train) + len(got.val) == 1000 and peak < 8 * 2**20, peak


def test_past_the_cap_files_are_counted_not_opened(tmp_path, monkeypatch):
    sizes = {}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "doc.txt").write_text(text(ord(name)))
        sizes[name] = (tmp_path / name / "doc.txt").stat().st_size
    (tmp_path / "c" / "empty.txt").write_bytes(b"")  # not a document: not counted
    opened = []
    real_open = open
    monkeypatch.setattr(data, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k),
                        raising=False)
    got = data.load_bytes(tmp_path, max_bytes=100)
    assert got.n_files == 1 and set(opened) == {str(tmp_path / "a" / "doc.txt")}, opened
    assert (got.n_bytes, got.cap, got.left_files) == (100, 100, 2)
    assert got.left_bytes == sizes["a"] - 100 + sizes["b"] + sizes["c"]
    line = data_cap.used(got)
    assert "1 of 3 files" in line and f"100 of {sum(sizes.values()):,} bytes" in line, line
    assert f"--data-cap 100 left out {got.left_bytes:,} bytes" in line and "--data-cap none" in line, line


# ----------------------------------------------------------------------------- --data-cap
def test_data_cap_parses_sizes_in_powers_of_1024_and_none():
    assert data_cap.parse_cap(None) == data_cap.DEFAULT_CAP
    assert [data_cap.parse_cap(v) for v in ("1000", "16M", "16MiB", "1g", "2K", "1T")] == [
        1000, 16 * 2**20, 16 * 2**20, 2**30, 2048, 2**40]
    assert data_cap.parse_cap("none") is None and data_cap.parse_cap("ALL") is None
    for bad in ("16MB", "0", "-1", "1.5G", "lots", ""):
        with pytest.raises(ValueError, match=f"--data-cap: expected a byte count such as 16M or 1G .*got {bad!r}"):
            data_cap.parse_cap(bad)
    assert [data_cap.format_cap(n) for n in (16 * 2**20, 2**30, 1000, 1536)] == ["16M", "1G", "1000", "1536"]


def test_a_users_data_is_read_whole_by_default_and_the_stdlib_up_to_16_mib(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 20 MiB, sparse: text first, then a hole of zeros (a text head: read)
        f.write(b"some text\n" * 1000)
        f.truncate(20 * 2**20)
    whole = data.load(big)
    assert len(whole.train) + len(whole.val) == 20 * 2**20 and whole.cap is None and whole.left_bytes == 0
    capped = data.load(big, max_bytes=data_cap.parse_cap("1M"))
    assert len(capped.train) + len(capped.val) == 2**20 and capped.left_bytes == 19 * 2**20
    assert data_cap.resolve_cap(data_cap.DEFAULT_CAP, None, None) == data_cap.MAX_CORPUS_BYTES == 16 * 2**20
    assert data_cap.resolve_cap(data_cap.DEFAULT_CAP, None, "tokenizer.json") is None  # tokens: all of it, as ever
    assert data_cap.resolve_cap(data_cap.DEFAULT_CAP, big, None) is None and data_cap.resolve_cap(5, None, None) == 5


def test_the_recipes_data_line_says_what_the_cap_left_out(tmp_path, capsys):
    """--data-cap reaches the data, and the recipe's data line says what it read and left out (a
    dry run: nothing trained)."""
    text_file = tmp_path / "corpus.txt"
    text_file.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 40)
    size, out = text_file.stat().st_size, str(tmp_path / "out")
    gpt.main(["--block-size", "16", "--data", str(text_file), "--data-cap", "1K", "--dry-run", "--out", out])
    printed = capsys.readouterr().out
    assert f"corpus.txt: 1 of 1 files, 1,024 of {size:,} bytes read: --data-cap 1K left out {size - 1024:,} " \
           "bytes" in printed, printed
    gpt.main(["--block-size", "16", "--data", str(text_file), "--dry-run", "--out", out])
    assert f"corpus.txt: 1 file, {size:,} bytes; " in capsys.readouterr().out  # a --data: all of it
    with pytest.raises(SystemExit):
        gpt.main(["--data-cap", "16MB", "--dry-run", "--out", out])
    assert "--data-cap: expected a byte count such as 16M or 1G" in capsys.readouterr().err


def test_a_checkpoint_saved_before_data_cap_resumes_only_on_the_bytes_it_trained_on():
    """Its --data was read up to 16 MiB as bytes, in full as tokens: --resume compares that cap."""
    old_bytes, old_tokens = {"data": "/c", "tokenizer": None}, {"data": "/c", "tokenizer": "/t.json"}
    assert data_cap.saved_flags(old_bytes) == {**old_bytes, "data_cap": 16 * 2**20}
    assert data_cap.saved_flags(old_tokens) == {**old_tokens, "data_cap": None}
    assert data_cap.saved_flags({**old_bytes, "data_cap": None})["data_cap"] is None  # saved with it: as saved
    assert data_cap.saved_flags({"n_layer": 4}) == {"n_layer": 4}  # a model config, not flags


def _old_default_corpus():
    """The default corpus as the bytes path has always read it: the stdlib's .py files in sorted path
    order, each non-empty text file up to a 16 MiB cap in all, joined by newlines, split by path hash."""
    root, files, _ = data.corpus_files(None)
    parts, total = {False: [], True: []}, 0
    for f in files:
        raw = f.read_bytes()
        if not raw or b"\x00" in raw[:4096]:
            continue
        raw = raw[:16 * 2**20 - total]
        total += len(raw)
        parts[data.is_val(str(f.relative_to(root)))].append(raw)
        if total >= 16 * 2**20:
            break
    return b"\n".join(parts[False]), b"\n".join(parts[True])


def test_the_default_corpus_keeps_its_bytes_and_says_what_the_cap_left_out():
    train, val = _old_default_corpus()
    got = data.load()
    assert bytes(got.train.numpy()) == train and bytes(got.val.numpy()) == val
    assert got.cap == 16 * 2**20 and got.n_bytes == 16 * 2**20 and got.left_files > 0
    _, files, _ = data.corpus_files(None)
    every = [f.stat().st_size for f in files if f.stat().st_size > 0]
    assert got.n_files + got.left_files == len(every) and got.n_bytes + got.left_bytes == sum(every)
    line = data_cap.used(got)
    assert f"{got.n_files:,} of {len(every):,} files" in line and "the default corpus' --data-cap 16M" in line, line


def test_bytes_are_read_into_the_tensor_not_through_python_copies(tmp_path):
    """The corpus needs its own size in RAM once: the text is read straight into the tensor that
    holds it, no Python bytes object of it is made (the peak Python allocation stays small)."""
    import tracemalloc

    for i in range(4):
        (tmp_path / f"doc{i}.txt").write_bytes((b"%d some text\n" % i) * (2**20 // 12))  # ~1 MiB each
    tracemalloc.start()
    try:
        got = data.load_bytes(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got.train) + len(got.val) > 4 * 10**6 and peak < 2**20, peak


def test_the_default_corpus_is_the_stdlib_in_sorted_path_order():
    """The walk gives sorted(rglob)'s files: the default run's bytes stay the same."""
    root, files, _ = data.corpus_files(None)
    want = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())
    assert list(files) == want


def test_a_cache_built_by_another_process_with_our_pid_is_left_alone(corpus, tokenizer, tmp_path):
    """Ranks on two machines sharing OUT may have the same pid; each builds in a folder of its own."""
    cache = tmp_path / "cache"
    key = data.cache_key(corpus, tokenizer, None)
    theirs = cache / f".{key[:24]}.{os.getpid()}.tmp"
    theirs.mkdir(parents=True)
    (theirs / "train.part").write_bytes(b"being written")
    got = data.load(corpus, tokenizer, cache)
    assert not got.reused and (theirs / "train.part").read_bytes() == b"being written"
