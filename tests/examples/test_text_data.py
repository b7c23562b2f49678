"""nvfp4_examples/text_data.py (the GCIDE corpus: dictd parsing, cleaning, the fixed
split, the corpus file, prepare from a .deb) on the small sample in tests/data,
and nvfp4_examples/train_common.py (batches, FLOPs, the training loop's records)."""

import argparse
import gzip
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nvfp4_examples import text_data, train_common

SAMPLE = text_data.sample_path()


def _sample_entries():
    return text_data.read_dictd(SAMPLE + ".dict", SAMPLE + ".index")


def test_b64_numbers():
    assert text_data.decode_b64_number("A") == 0
    assert text_data.decode_b64_number("/") == 63
    assert text_data.decode_b64_number("5I") == 57 * 64 + 8
    for n in (0, 1, 63, 64, 4095, 4096, 39_952_321):
        assert text_data.decode_b64_number(text_data.encode_b64_number(n)) == n
    with pytest.raises(ValueError, match="base-64"):
        text_data.decode_b64_number("a-b")


def test_index_and_entries_of_the_sample():
    with open(SAMPLE + ".index") as f:
        index = text_data.parse_dictd_index(f)
    assert len(index) == 50  # 40 entries, some with several headwords
    assert len({(o, n) for _, o, n in index}) == 40
    entries = _sample_entries()
    assert len(entries) == 39  # 00-database-short skipped, each entry once
    with open(SAMPLE + ".dict", "rb") as f:
        data = f.read()
    offsets = sorted({o for w, o, _ in index if not w.startswith("00-database")})
    assert entries[0] == data[offsets[0] : offsets[0] + len(entries[0])]
    assert entries[0].startswith(b"Androtomous \\An*drot")
    assert all(not e.startswith(b"00-database") for e in entries)
    with pytest.raises(ValueError, match="past the end"):
        text_data.dictd_entries(data[:100], index)
    with pytest.raises(ValueError, match="2 tab-separated fields"):
        text_data.parse_dictd_index(["word\tAB\n"])


def test_clean_entry():
    entry = (
        b"Word \\Word\\, n. [AS. word.]\n"
        b"   1. A sound.  \n"
        b"      [1913 Webster]\n"
        b"\n\n\n"
        b"   2. A promise. [Obs.]\n"
        b"   [Obs.]\n"
        b"         [Webster 1913 Suppl. +PJC]\n"
        b"   Syn: term\n"
        b"        [WordNet 1.5]\n"
    )
    assert text_data.clean_entry(entry) == (
        b"Word \\Word\\, n. [AS. word.]\n"
        b"1. A sound.\n"
        b"\n"
        b"2. A promise. [Obs.]\n"
        b"[Obs.]\n"
        b"Syn: term"
    )


def test_split_is_fixed_and_complete():
    entries = _sample_entries()
    train, held = text_data.split_entries(entries, held_out_every=8)
    cleaned = [text_data.clean_entry(e) for e in entries]
    assert held == b"\n\n".join(cleaned[7::8]) + b"\n"
    assert train == b"\n\n".join(c for i, c in enumerate(cleaned) if i % 8 != 7) + b"\n"
    assert b"[1913 Webster]" not in train + held
    assert text_data.split_entries(entries, 8) == (train, held)
    with pytest.raises(ValueError, match="held_out_every"):
        text_data.split_entries(entries, 1)


def test_corpus_file_round_trip(tmp_path):
    path = str(tmp_path / "corpus.bin")
    text_data.write_corpus(path, b"train bytes\n", b"held\n")
    train, held = text_data.load_corpus(path)
    assert train.dtype == np.uint8 and bytes(train) == b"train bytes\n"
    assert bytes(held) == b"held\n"
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        text_data.load_corpus(path)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a corpus at all, just text" * 2)
    with pytest.raises(ValueError, match="prepare"):
        text_data.load_corpus(str(bad))


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_prepare_from_a_deb(tmp_path):
    # A .deb laid out like dict-gcide's, holding the sample.
    root = tmp_path / "pkg"
    dictd = root / "usr" / "share" / "dictd"
    dictd.mkdir(parents=True)
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(
        "Package: dict-gcide\nVersion: 0.0\nArchitecture: all\n"
        "Maintainer: test <test@example.org>\nDescription: sample\n"
    )
    with (
        open(SAMPLE + ".dict", "rb") as f,
        gzip.open(dictd / "gcide.dict.dz", "wb") as g,
    ):
        g.write(f.read())
    shutil.copy(SAMPLE + ".index", dictd / "gcide.index")
    deb = tmp_path / "dict-gcide_0.0_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)],
        check=True,
        capture_output=True,
    )
    out = tmp_path / "data"
    path = text_data.prepare(str(out), deb=str(deb), held_out_every=8)
    train, held = text_data.load_corpus(path)
    want = text_data.split_entries(_sample_entries(), 8)
    assert (bytes(train), bytes(held)) == want
    assert (out / "corpus.json").exists()


def test_load_sample_and_batches():
    train, held = text_data.load_sample()
    assert train.dtype == np.uint8 and train.size > 5000 and held.size > 200
    stream = train_common.batches(train, 4, 32, seed=0)
    first, second = next(stream), next(stream)
    assert first.shape == (4, 33) and first.dtype == np.int32
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, next(train_common.batches(train, 4, 32, 0)))
    # Each row is a contiguous window of the byte stream.
    text = bytes(train)
    for row in first:
        assert bytes(row.astype(np.uint8)) in text
    evals = train_common.eval_batches(held, 2, 32, count=3)
    assert len(evals) == 3 and all(b.shape == (2, 33) for b in evals)
    np.testing.assert_array_equal(evals[0][0], held[:33])
    with pytest.raises(ValueError, match="fewer than one window"):
        next(train_common.batches(held[:10], 2, 32, 0))


def test_llama_flops_per_token():
    # No blocks: only the output head, 6 FLOPs per parameter per token.
    assert (
        train_common.llama_flops_per_token(d_model=64, layers=0, ffn=128, seq_len=32)
        == 6 * 64 * 256
    )
    one = train_common.llama_flops_per_token(d_model=64, layers=1, ffn=128, seq_len=32)
    two = train_common.llama_flops_per_token(d_model=64, layers=2, ffn=128, seq_len=32)
    per_block = 6 * (4 * 64 * 64 + 3 * 64 * 128) + 6 * 32 * 64
    assert one - 6 * 64 * 256 == per_block and two - one == per_block


def _args(tmp_path, **overrides):
    parser = argparse.ArgumentParser()
    train_common.add_common_flags(parser)
    train, held = text_data.split_entries(_sample_entries(), 8)
    path = str(tmp_path / "corpus.bin")
    text_data.write_corpus(path, train, held)
    args = parser.parse_args(["--data", path, "--out", str(tmp_path / "runs")])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_run_training_records_and_stops_on_nan(tmp_path):
    args = _args(tmp_path, steps=7, batch=2, seq_len=16, log_every=2, eval_every=3)

    @jax.jit
    def train_step(state, batch, key):
        del key
        return state + 1, jnp.mean(batch[:, 1:].astype(jnp.float32)) / state

    @jax.jit
    def eval_loss(state, batch):
        return jnp.float32(1.0) / state

    rows = train_common.run_training(
        label="t",
        args=args,
        train_step=train_step,
        state=jnp.float32(1.0),
        flops_per_token=100.0,
        eval_loss=eval_loss,
    )
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 7]  # logs, evals, last
    assert [r["eval_loss"] != "" for r in rows] == [False, True, False, True, True]
    assert rows[-1]["eval_loss"] == pytest.approx(1 / 8)  # after 7 steps
    written = train_common.read_csv(str(tmp_path / "runs" / "t.csv"))
    assert [int(r["step"]) for r in written] == [2, 3, 4, 6, 7]
    summary = train_common.summarize(rows, last_steps=3)
    assert summary["steps"] == 7 and summary["eval_loss"] == pytest.approx(
        (1 / 7 + 1 / 8) / 2
    )

    @jax.jit
    def diverging(state, batch, key):
        del batch, key
        return state + 1, jnp.where(state >= 3, jnp.nan, 1.0)

    args = _args(tmp_path, steps=10, batch=2, seq_len=16, log_every=5)
    with pytest.raises(FloatingPointError, match="nan at step 3"):
        train_common.run_training(
            label="d",
            args=args,
            train_step=diverging,
            state=jnp.float32(1.0),
            flops_per_token=1.0,
        )
    assert len(train_common.read_csv(str(tmp_path / "runs" / "d.csv"))) == 1
