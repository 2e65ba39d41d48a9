"""Unit tests for fullshard.data: tokenizer, corpus, preprocess, datasets, sampler."""

import argparse
import json
import pickle
import random

import numpy as np
import pytest
import torch

import fullshard.data.binarize as binarize
from fullshard.data import (
    DataError,
    ShardedBatchSampler,
    TokenBlockDataset,
    builtin_corpus_documents,
    load_gpt2_tokenizer,
    preprocess,
    preprocess_cli,
    read_meta,
    split_documents,
)
from tests.wide_tokenizer import WIDE_VOCAB, save_wide_tokenizer, word


@pytest.fixture(scope="module")
def tokenizer():
    return load_gpt2_tokenizer()


@pytest.fixture(scope="module")
def wiki_docs():
    return builtin_corpus_documents()


def write_corpus(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


SMALL_FILES = {
    "a.txt": "The first document.\nIt has two lines.\n\nThe second one.\n\n\n",
    "b.txt": "  Third, with unicode: café, 東京, emoji 🙂.  \n \nFourth <|endoftext|> inline.\n",
    "ignored.md": "not a txt file",
}


def expected_tokens(tokenizer, docs):
    return sum(len(tokenizer.encode(d)) + 1 for d in docs)


def assert_consistent(destdir):
    meta = read_meta(destdir)
    for split, info in meta["splits"].items():
        data = np.memmap(destdir / info["file"], dtype=np.uint16, mode="r")
        assert len(data) == info["num_tokens"], split
        assert int((data == meta["eos_id"]).sum()) >= info["num_documents"]
        assert data[-1] == meta["eos_id"]
    return meta


# --- tokenizer and corpus -------------------------------------------------------------

def test_tokenizer_known_ids(tokenizer):
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.vocab_size == 50257 and tokenizer.eos_id == 50256
    assert tokenizer.decode([15496, 995]) == "Hello world"
    assert tokenizer.encode("<|endoftext|>") == [50256]
    assert tokenizer.encode_batch(["Hello world", " Hello"]) == [[15496, 995], [18435]]


def test_tokenizer_round_trip_on_wikipedia_sample(tokenizer, wiki_docs):
    for doc in random.Random(0).sample(wiki_docs, 200):
        assert tokenizer.decode(tokenizer.encode(doc)) == doc
    weird = " leading space\n\n\ttabs  and\u00a0nbsp, 東京 🙂\r\n"
    assert tokenizer.decode(tokenizer.encode(weird)) == weird


def test_builtin_corpus(wiki_docs):
    assert len(wiki_docs) == 10_033
    assert all(isinstance(d, str) and d.strip() for d in wiki_docs)


def test_split_documents():
    assert split_documents("a\nb\n\n \n\nc\n\n") == ["a\nb", "c"]
    assert split_documents(" \n\n ") == []


# --- preprocess -----------------------------------------------------------------------

def test_preprocess_small_corpus(tmp_path, tokenizer):
    src = write_corpus(tmp_path / "src", SMALL_FILES)
    docs = ["The first document.\nIt has two lines.", "The second one.",
            "Third, with unicode: café, 東京, emoji 🙂.", "Fourth <|endoftext|> inline."]
    result = preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.25, seed=5)
    assert not result.cached
    meta = assert_consistent(tmp_path / "out")
    assert meta == result.meta
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"], meta["dtype"]) == \
        ("gpt2-bpe", 50257, 50256, "uint16")
    train, valid = meta["splits"]["train"], meta["splits"]["valid"]
    assert (train["num_documents"], valid["num_documents"]) == (3, 1)
    assert train["num_tokens"] + valid["num_tokens"] == expected_tokens(tokenizer, docs)
    # The valid document is one of ours, and train keeps the others in order.
    valid_ids = np.fromfile(tmp_path / "out" / "valid.bin", dtype=np.uint16).tolist()
    valid_doc = tokenizer.decode(valid_ids[:-1])
    rest = [d for d in docs if d != valid_doc]
    assert valid_doc in docs and len(rest) == 3
    train_ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist()
    assert train_ids == [t for d in rest for t in tokenizer.encode(d) + [50256]]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["meta.json", "train.bin", "valid.bin"]


def test_preprocess_split_is_deterministic_and_seeded(tmp_path):
    src = write_corpus(tmp_path / "src", {"c.txt": "\n\n".join(f"doc {i}" for i in range(50))})
    a = preprocess(tmp_path / "a", trainpref=src, valid_fraction=0.1, seed=1)
    preprocess(tmp_path / "b", trainpref=src, valid_fraction=0.1, seed=1)
    preprocess(tmp_path / "c", trainpref=src, valid_fraction=0.1, seed=2)
    read = lambda d: (d / "valid.bin").read_bytes()  # noqa: E731
    assert a.meta["splits"]["valid"]["num_documents"] == 5
    assert read(tmp_path / "a") == read(tmp_path / "b") != read(tmp_path / "c")


def test_preprocess_explicit_valid_and_test(tmp_path, tokenizer):
    train = write_corpus(tmp_path / "train", {"t.txt": "one\n\ntwo\n\nthree"})
    valid = write_corpus(tmp_path / "valid", {"v.txt": "four"}) / "v.txt"
    test = write_corpus(tmp_path / "test", {"t.txt": "five\n\nsix"})
    meta = preprocess(tmp_path / "out", trainpref=train, validpref=valid, testpref=test).meta
    assert {k: v["num_documents"] for k, v in meta["splits"].items()} == \
        {"train": 3, "valid": 1, "test": 2}
    assert meta["splits"]["test"]["num_tokens"] == expected_tokens(tokenizer, ["five", "six"])
    assert_consistent(tmp_path / "out")


def test_preprocess_builtin_slice(tmp_path, monkeypatch, tokenizer, wiki_docs):
    docs = wiki_docs[:300]
    monkeypatch.setattr(binarize, "builtin_corpus_documents", lambda: list(docs))
    meta = preprocess(tmp_path / "out", builtin=True, valid_fraction=0.01, workers=2).meta
    assert_consistent(tmp_path / "out")
    assert meta["splits"]["train"]["num_documents"] == 297
    assert meta["splits"]["valid"]["num_documents"] == 3
    total = sum(s["num_tokens"] for s in meta["splits"].values())
    assert total == sum(len(ids) + 1 for ids in tokenizer.encode_batch(docs))


def test_preprocess_cache(tmp_path, caplog):
    src = write_corpus(tmp_path / "src", SMALL_FILES)
    first = preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.25)
    mtime = (tmp_path / "out" / "train.bin").stat().st_mtime_ns
    with caplog.at_level("INFO"):
        second = preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.25)
    assert second.cached and second.meta == first.meta
    assert "skipping" in caplog.text
    assert (tmp_path / "out" / "train.bin").stat().st_mtime_ns == mtime
    (src / "a.txt").write_text("Changed text.\n\nAnd more.\n\nAnd more still.")
    third = preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.25)
    assert not third.cached and third.meta["fingerprint"] != first.meta["fingerprint"]
    assert_consistent(tmp_path / "out")
    # Dropping the valid split leaves no stale valid.bin behind.
    fourth = preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.0)
    assert list(fourth.meta["splits"]) == ["train"]
    assert not (tmp_path / "out" / "valid.bin").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(trainpref="MISSING"), "does not exist"),
    (dict(trainpref="EMPTY"), "holds no text"),
    (dict(trainpref="NOTXT"), "no \\*.txt"),
    (dict(trainpref="ONE"), "cannot be split"),
    (dict(), "no training text"),
    (dict(trainpref="ONE", builtin=True), "not both"),
    (dict(trainpref="ONE", valid_fraction=1.0), "valid fraction"),
])
def test_preprocess_bad_input_leaves_nothing(tmp_path, kwargs, message):
    write_corpus(tmp_path / "empty", {"e.txt": " \n\n  \n"})
    write_corpus(tmp_path / "one", {"o.txt": "only one document"})
    (tmp_path / "notxt").mkdir()
    paths = {"MISSING": tmp_path / "missing", "EMPTY": tmp_path / "empty",
             "NOTXT": tmp_path / "notxt", "ONE": tmp_path / "one"}
    if "trainpref" in kwargs:
        kwargs["trainpref"] = paths[kwargs["trainpref"]]
    with pytest.raises(DataError, match=message) as info:
        preprocess(tmp_path / "out", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_preprocess_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    src = write_corpus(tmp_path / "src", SMALL_FILES)
    real = binarize._write_split
    calls = []

    def failing(path, *args):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, *args)

    monkeypatch.setattr(binarize, "_write_split", failing)
    with pytest.raises(OSError):
        preprocess(tmp_path / "out", trainpref=src, valid_fraction=0.25)
    assert not (tmp_path / "out").exists()
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "other").write_text("x")
    calls.clear()
    with pytest.raises(OSError):
        preprocess(tmp_path / "keep", trainpref=src, valid_fraction=0.25)
    assert [p.name for p in (tmp_path / "keep").iterdir()] == ["other"]


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    preprocess_cli.add_args(parser)
    src = write_corpus(tmp_path / "src", SMALL_FILES)
    args = parser.parse_args(["--trainpref", str(src), "--destdir", str(tmp_path / "out"),
                              "--valid-fraction", "0.25", "--seed", "3", "--workers", "1"])
    assert preprocess_cli.run(args) == 0
    assert "train: 3 documents" in capsys.readouterr().out
    assert preprocess_cli.run(args) == 0
    assert "skipping" in capsys.readouterr().out
    bad = parser.parse_args(["--trainpref", str(tmp_path / "nope"),
                             "--destdir", str(tmp_path / "x")])
    assert preprocess_cli.run(bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard preprocess: error: input path") and err.count("\n") == 1
    assert parser.parse_args(["--builtin-corpus", "--destdir", "d"]).builtin_corpus


# --- dataset --------------------------------------------------------------------------

@pytest.fixture()
def data_dir(tmp_path):
    src = write_corpus(tmp_path / "src", {"c.txt": "\n\n".join(
        f"Document number {i} talks about topic {i * 7}." for i in range(40))})
    preprocess(tmp_path / "bin", trainpref=src, valid_fraction=0.1)
    return tmp_path / "bin"


def test_token_block_dataset(data_dir):
    T = 16
    ds = TokenBlockDataset(data_dir, "train", T)
    stream = np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    assert len(ds) == (len(stream) - 1) // T
    for i in (0, 1, len(ds) - 1, -1):
        x, y = ds[i]
        j = i % len(ds)
        assert x.shape == y.shape == (T,) and x.dtype == y.dtype == torch.long
        assert torch.equal(x, torch.from_numpy(stream[j * T:j * T + T]))
        assert torch.equal(y, torch.from_numpy(stream[j * T + 1:j * T + T + 1]))
    assert torch.equal(ds[0][1][:-1], ds[0][0][1:])
    assert torch.equal(ds[0][1][-1], ds[1][0][0])  # stride T, no overlap of inputs
    with pytest.raises(IndexError):
        ds[len(ds)]
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[3][0], ds[3][0])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch[0].shape == (4, T)


def test_token_block_dataset_errors(tmp_path, data_dir):
    with pytest.raises(DataError, match="fullshard preprocess"):
        TokenBlockDataset(tmp_path / "nowhere", "train", 8)
    with pytest.raises(DataError, match="no split 'test'"):
        TokenBlockDataset(data_dir, "test", 8)
    valid_tokens = read_meta(data_dir)["splits"]["valid"]["num_tokens"]
    with pytest.raises(DataError, match="fewer than tokens_per_sample"):
        TokenBlockDataset(data_dir, "valid", valid_tokens)
    assert len(TokenBlockDataset(data_dir, "valid", valid_tokens - 1)) == 1
    (data_dir / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="does not match meta.json"):
        TokenBlockDataset(data_dir, "train", 8)
    (data_dir / "train.bin").write_bytes(b"\0\0\0")
    with pytest.raises(DataError, match="holds 3 bytes, not a whole number of uint16 token ids"):
        TokenBlockDataset(data_dir, "train", 8)
    meta = json.loads((data_dir / "meta.json").read_text())
    (data_dir / "meta.json").write_text(json.dumps({**meta, "dtype": "int64"}))
    with pytest.raises(DataError, match="records token dtype 'int64', not one of uint16, uint32"):
        TokenBlockDataset(data_dir, "valid", 8)


def test_data_dir_without_dtype_reads_uint16(data_dir):
    """A meta.json written before the dtype was recorded holds uint16 ids."""
    meta = json.loads((data_dir / "meta.json").read_text())
    want = TokenBlockDataset(data_dir, "train", 8)[2]
    del meta["dtype"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    assert read_meta(data_dir)["dtype"] == "uint16"
    got = TokenBlockDataset(data_dir, "train", 8)[2]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- tokenizers with more than 65,536 ids ------------------------------------------------

def test_token_dtype_is_the_narrowest_that_holds_every_id():
    assert [binarize.token_dtype(v) for v in (300, 50257, 2**16, 2**16 + 1, 151_646)] == \
        ["uint16", "uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(DataError, match="does not fit uint32"):
        binarize.token_dtype(2**32 + 1)


def test_preprocess_with_more_than_65536_ids_writes_uint32(tmp_path):
    ids = [[2, 65_535, 65_536, 69_999, 7], [40_000, 65_537, 3, 69_998, 65_536, 12, 5, 66_000], [69_997, 9]]
    text = "\n\n".join(" ".join(word(i) for i in doc) for doc in ids)
    src = write_corpus(tmp_path / "src", {"c.txt": text})
    tok = save_wide_tokenizer(tmp_path / "tok")
    meta = preprocess(tmp_path / "out", trainpref=src, validpref=src / "c.txt", tokenizer=tok).meta
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (WIDE_VOCAB, 1, "uint32"), meta
    want = [t for doc in ids for t in (*doc, 1)]
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * len(want) == 4 * meta["splits"]["train"]["num_tokens"]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32).tolist() == want
    ds = TokenBlockDataset(tmp_path / "out", "train", 4)
    blocks = [ds[i] for i in range(len(ds))]
    assert [int(t) for x, _ in blocks for t in x] == want[:4 * len(ds)]
    assert [int(t) for _, y in blocks for t in y] == want[1:4 * len(ds) + 1]
    assert ds.tokenizer == meta["tokenizer"]  # what the trainer records in its checkpoints


def test_same_tokenizer_compares_tokenizer_json_not_directory_names(tmp_path):
    import shutil

    from fullshard.data.tokenizer import HFTokenizer, different_tokenizers, same_tokenizer

    a = HFTokenizer(save_wide_tokenizer(tmp_path / "a"))
    b = HFTokenizer(shutil.copytree(tmp_path / "a", tmp_path / "b"))  # a copy elsewhere: the same tokenizer
    assert a.name != b.name and same_tokenizer(a.name, b.name)
    (tmp_path / "b" / "tokenizer.json").write_text((tmp_path / "b" / "tokenizer.json").read_text().replace("w9", "v9"))
    assert not same_tokenizer(a.name, HFTokenizer(tmp_path / "b").name)
    assert same_tokenizer("gpt2-bpe", "gpt2-bpe") and not same_tokenizer("gpt2-bpe", a.name)
    # refusals need both records: a checkpoint or meta.json from before the record is not refused
    assert different_tokenizers("gpt2-bpe", a.name) and not different_tokenizers(a.name, b.name)
    assert not different_tokenizers(None, a.name) and not different_tokenizers("gpt2-bpe", None)


# --- sampler --------------------------------------------------------------------------

@pytest.mark.parametrize("num_items, batch_size, world_size", [(100, 4, 3), (64, 8, 2), (7, 2, 1)])
def test_sharded_batch_sampler(num_items, batch_size, world_size):
    def batches(rank, epoch=0, **kw):
        return list(ShardedBatchSampler(num_items, batch_size, rank, world_size,
                                        seed=1, epoch=epoch, **kw))

    per_rank = [batches(r) for r in range(world_size)]
    n = num_items // (batch_size * world_size)
    for r, bs in enumerate(per_rank):
        assert len(bs) == n == len(ShardedBatchSampler(num_items, batch_size, r, world_size, 1, 0))
        assert all(len(b) == batch_size for b in bs)
    for step in range(n):
        global_batch = [i for r in range(world_size) for i in per_rank[r][step]]
        assert len(set(global_batch)) == batch_size * world_size  # ranks disjoint
    all_items = [i for bs in per_rank for b in bs for i in b]
    assert len(set(all_items)) == len(all_items) == n * batch_size * world_size
    gen = torch.Generator().manual_seed(1)
    assert sorted(all_items) == sorted(torch.randperm(num_items, generator=gen)
                                       [:n * batch_size * world_size].tolist())
    assert per_rank == [batches(r) for r in range(world_size)]  # deterministic
    assert per_rank != [batches(r, epoch=1) for r in range(world_size)]
    # drop_last=False pads the last global batch; every item appears.
    full = [batches(r, drop_last=False) for r in range(world_size)]
    assert len({len(bs) for bs in full}) == 1
    assert {i for bs in full for b in bs for i in b} == set(range(num_items))
    ordered = batches(0, shuffle=False)
    assert ordered[0] == list(range(batch_size))


def test_sharded_batch_sampler_errors():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        ShardedBatchSampler(10, 2, rank=2, world_size=2, seed=0, epoch=0)
    with pytest.raises(ValueError, match="no full global batch"):
        ShardedBatchSampler(5, 4, rank=0, world_size=2, seed=0, epoch=0)
    sampler = ShardedBatchSampler(20, 2, rank=0, world_size=2, seed=0, epoch=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
