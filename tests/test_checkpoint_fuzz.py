"""A checkpoint is a file from anywhere (issue 26): a real checkpoint mutated field by field and byte by byte.

Every mutation is loaded in this process (``load_checkpoint``, what ``evaluate`` and ``--resume`` call)
and must end in one of two ways, never a traceback:

- a ValueError of one line naming the file and the field (for a field mutation: exactly that field);
- for a byte mutation only, acceptance of a file whose every field reads exactly as the original's
  (a flipped byte in a zip timestamp changes nothing the reader uses).

A malformed field accepted silently fails the test, and so does a valid variant refused (a float64
or big-endian copy of the parameters, a compressed archive). No load may modify the file. A few
mutations also go through ``python -m cnn evaluate`` and ``train --resume``. About 2 s in all.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cnn.train import load_checkpoint, train

from test_reliability import assert_one_line, run_main, write_tiny_idx
from test_train import quiet, tiny_data

VALID_PARALLEL = {"strategy": "allreduce", "ranks": 2, "workers": 2, "global_batch": 32, "images_into_epoch": 0,
                  "state": {}, "lacks": ""}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A checkpoint written by ``cnn.train`` after one epoch (epoch 1 of 1, batch 0)."""
    path = tmp_path_factory.mktemp("original") / "ck.npz"
    train(quiet(epochs=1, checkpoint=str(path)), tiny_data())
    return path


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)       # object arrays too: the reader must never unpickle them
    return buffer.getvalue()


def raw_npy(header: dict, data: bytes) -> bytes:
    """A .npy file with a header of our own making (it may lie about the data)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


def members_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def write_members(path: Path, members: list[tuple[str, bytes]] | dict[str, bytes], method=zipfile.ZIP_STORED) -> None:
    items = members.items() if isinstance(members, dict) else members
    with zipfile.ZipFile(path, "w", method) as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")             # "Duplicate name": that is the point of one mutation
        for name, data in items:
            archive.writestr(name, data)


def text(value) -> bytes:
    return npy(np.array(json.dumps(value)))


# -- the field mutations -------------------------------------------------------------------------------

def vector_mutations(name: str, good: np.ndarray):
    """(label, field, replacement bytes) for the params or momentum vector."""
    size = good.size
    nan, inf = good.copy(), good.copy()
    nan[17], inf[-1] = np.nan, -np.inf
    yield from [
        (f"{name} int64", name, npy(good.astype(np.int64))),
        (f"{name} complex128", name, npy(good.astype(np.complex128))),
        (f"{name} float16", name, npy(good.astype(np.float16))),
        (f"{name} object", name, npy(good[:4].astype(object))),
        (f"{name} strings", name, npy(np.array(["0.1"] * 4))),
        (f"{name} bool", name, npy(good > 0)),
        (f"{name} 2-D", name, npy(good.reshape(-1, 2))),
        (f"{name} one short", name, npy(good[:-1])),
        (f"{name} one long", name, npy(np.append(good, 0))),
        (f"{name} empty", name, npy(good[:0])),
        (f"{name} 0-d", name, npy(good[0])),
        (f"{name} NaN", name, npy(nan)),
        (f"{name} -inf", name, npy(inf)),
        (f"{name} 2 TiB declared", name, raw_npy({"descr": "<f8", "fortran_order": False, "shape": (2**38,)},
                                                  good.tobytes()[:64])),
        (f"{name} f8 header over f4 data", name, raw_npy({"descr": "<f8", "fortran_order": False, "shape": (size,)},
                                                          good.tobytes())),
        (f"{name} negative shape", name, raw_npy({"descr": "<f4", "fortran_order": False, "shape": (-size,)},
                                                  good.tobytes())),
        (f"{name} structured", name, npy(np.zeros(size, dtype=[("a", "<f4")]))),
        (f"{name} subarray dtype", name, raw_npy({"descr": [("", "<f4", (size,))], "fortran_order": False,
                                                  "shape": (1,)}, good.tobytes())),
        (f"{name} header text", name, b"\x93NUMPY\x01\x00" + b"\x76\x00" + b"{'descr': '<f4', 'shape': (" + b"(" * 60
         + b"\n" + b" " * 51),
    ]


def json_mutations(field: str, good):
    """(label, field, replacement) for a JSON field: wrong types, missing keys, NaN, huge, not JSON."""
    def changed(**updates):
        return {**good, **updates}

    def without(key):
        return {k: v for k, v in good.items() if k != key}

    common = [("a list", text([1, 2])), ("a number", text(5)), ("null", text(None)),
              ("not JSON", npy(np.array("{'a': 1"))), ("nested 100000 deep", npy(np.array("[" * 100_000 + "]" * 100_000))),
              ("bytes, not text", npy(np.array(b"{}"))), ("a vector of texts", npy(np.array(["{}", "{}"])))]
    per_field = {
        "rng_state": lambda: [("empty", text({})), ("another generator", text(changed(bit_generator="MT19937"))),
                      ("state negative", text(changed(state={**good["state"], "state": -1}))),
                      ("inc huge", text(changed(state={**good["state"], "inc": 2**200}))),
                      ("uinteger 2^40", text(changed(uinteger=2**40))), ("has_uint32 text", text(changed(has_uint32="0"))),
                      ("state a float", text(changed(state={**good["state"], "state": 1.5}))),
                      ("no uinteger", text(without("uinteger"))), ("extra key", text(changed(extra=1)))],
        "config": lambda: [("no model", text(without("model"))), ("model vgg", text(changed(model="vgg"))),
                   ("model a number", text(changed(model=7))), ("stage quantum", text(changed(stage="quantum"))),
                   ("batch_size text", text(changed(batch_size="64"))), ("batch_size 0", text(changed(batch_size=0))),
                   ("batch_size 2^40", text(changed(batch_size=2**40))), ("lr NaN", text(changed(lr=float("nan")))),
                   ("lr Infinity", text(changed(lr=float("inf")))), ("lr negative", text(changed(lr=-0.1))),
                   ("momentum 1", text(changed(momentum=1.0))), ("gamma 0", text(changed(gamma=0.0))),
                   ("gamma 1.5", text(changed(gamma=1.5))), ("warmup NaN", text(changed(warmup_epochs=float("nan")))),
                   ("weight_decay inf", text(changed(weight_decay=float("inf")))), ("seed -1", text(changed(seed=-1))),
                   ("seed 2^40", text(changed(seed=2**40))), ("epochs 0", text(changed(epochs=0))),
                   ("epochs 1.5", text(changed(epochs=1.5))), ("epochs true", text(changed(epochs=True))),
                   ("dtype float16", text(changed(dtype="float16"))), ("schedule cosine", text(changed(schedule="cosine"))),
                   ("resume text", text(changed(resume="yes"))), ("data_dir a number", text(changed(data_dir=5))),
                   ("limit_train 0", text(changed(limit_train=0))), ("eval_every -1", text(changed(eval_every=-1)))],
        "history": lambda: [("no evals", text(without("evals"))), ("steps text", text(changed(steps="no"))),
                    ("a step of two", text(changed(steps=[[1, 2.0]]))), ("a step of text", text(changed(steps=[["1", 2, 3, 4]]))),
                    ("epochs of numbers", text(changed(epochs=[5]))),
                    ("an epoch's accuracy text", text(changed(epochs=[{"test_accuracy": "high", "test_loss": 1.0}]))),
                    ("an epoch without loss", text(changed(epochs=[{"test_accuracy": 0.5}]))),
                    ("train_seconds NaN", text(changed(train_seconds=float("nan")))),
                    ("train_seconds -1", text(changed(train_seconds=-1))), ("evals of three", text(changed(evals=[[1, 2, 3]])))],
    }
    for label, replacement in common + per_field[field]():
        yield f"{field} {label}", field, replacement


def field_mutations(original: Path):
    """(label, field named in the error, members of the mutated archive)."""
    good = members_of(original)
    saved = load_checkpoint(original)

    def replaced(field, data):
        return {**good, f"{field}.npy": data}

    for name in ("params", "momentum"):
        for label, field, data in vector_mutations(name, saved[name]):
            yield label, field, replaced(field, data)
    for name in ("rng_state", "config", "history"):
        for label, field, data in json_mutations(name, saved[name]):
            yield label, field, replaced(field, data)
    integer_cases = [("a vector", npy(np.array([1, 1]))), ("negative", npy(np.array(-5))), ("a float", npy(np.array(1.5))),
                     ("text", npy(np.array("1"))), ("a bool", npy(np.array(True))), ("2^40", npy(np.array(2**40))),
                     ("complex", npy(np.array(1 + 0j)))]
    for name in ("epoch", "batch"):
        for label, data in integer_cases:
            yield f"{name} {label}", name, replaced(name, data)
    yield "epoch beyond the configured epochs", "epoch", replaced("epoch", npy(np.array(3)))
    yield "batch after the last epoch", "batch", replaced("batch", npy(np.array(2)))
    yield "another model's config", "params", replaced("config", text({**saved["config"], "model": "alexnet-small"}))
    for name in ("params", "momentum", "epoch", "batch", "rng_state", "config", "history"):
        yield f"{name} missing", name, {key: value for key, value in good.items() if key != f"{name}.npy"}
    yield "an unknown member", "member 'notes.txt'", {**good, "notes.txt": b"hello"}
    yield "an unknown array", "member 'extra.npy'", {**good, "extra.npy": npy(np.zeros(3))}
    yield "params twice", "params", list(good.items()) + [("params.npy", good["params.npy"])]
    for label, record in [("a list", [1]), ("no images_into_epoch", {k: v for k, v in VALID_PARALLEL.items()
                                                                    if k != "images_into_epoch"}),
                          ("images_into_epoch text", {**VALID_PARALLEL, "images_into_epoch": "x"}),
                          ("strategy quantum", {**VALID_PARALLEL, "strategy": "quantum"}),
                          ("more workers than ranks", {**VALID_PARALLEL, "workers": 3}),
                          ("no ranks", {**VALID_PARALLEL, "ranks": 0}),
                          ("position not the batch", {**VALID_PARALLEL, "images_into_epoch": 64}),
                          ("state a list", {**VALID_PARALLEL, "state": []}),
                          ("global_batch NaN", {**VALID_PARALLEL, "global_batch": float("nan")})]:
        yield f"parallel {label}", "parallel", replaced("parallel", text(record))
    rows = np.stack([saved["params"]] * 2)
    yield "rows without a parallel record", "rows_momentum", {**good, "rows_momentum.npy": npy(rows)}
    with_parallel = replaced("parallel", text(VALID_PARALLEL))
    bad_rows = rows.copy()
    bad_rows[1, 5] = np.nan
    for label, data in [("too narrow", npy(rows[:, :-3])), ("NaN", npy(bad_rows)), ("3-D", npy(rows[None])),
                        ("2000 rows", raw_npy({"descr": "<f4", "fortran_order": False, "shape": (2000, rows.shape[1])},
                                              b""))]:
        yield f"rows {label}", "rows_momentum", {**with_parallel, "rows_momentum.npy": data}


def valid_variants(original: Path):
    """Checkpoints that differ in form but not in content: each must load with the original's values."""
    good = members_of(original)
    saved = load_checkpoint(original)
    yield "compressed", good, zipfile.ZIP_DEFLATED
    yield "big-endian params", {**good, "params.npy": npy(saved["params"].astype(">f4"))}, zipfile.ZIP_STORED
    yield "an unknown config key", {**good, "config.npy": text({**saved["config"], "future": 1})}, zipfile.ZIP_STORED
    yield "a distributed record", {**good, "parallel.npy": text(VALID_PARALLEL)}, zipfile.ZIP_STORED


# -- the checks ------------------------------------------------------------------------------------------

def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def outcome(path: Path):
    """("refused", message) or ("accepted", contents); any other exception is raised: a traceback."""
    before = digest(path)
    try:
        result = ("accepted", load_checkpoint(path))
    except ValueError as err:
        result = ("refused", str(err))
    assert digest(path) == before, f"{path} was modified by loading it"
    return result


def same_contents(a: dict, b: dict) -> bool:
    return (all(np.array_equal(a[name], b[name]) and a[name].dtype == b[name].dtype for name in ("params", "momentum"))
            and all(a[name] == b[name] for name in ("epoch", "batch", "rng_state", "config", "history", "parallel"))
            and a["rows"].keys() == b["rows"].keys())


def test_every_malformed_field_is_refused_in_one_line_that_names_it(original, tmp_path):
    silent, vague = [], []
    mutations = list(field_mutations(original))
    for number, (label, field, members) in enumerate(mutations):
        path = tmp_path / f"m{number}.npz"
        write_members(path, members)
        verdict, detail = outcome(path)
        if verdict == "accepted":
            silent.append(label)
        elif "\n" in detail or not detail.startswith(f"{path}: not a valid checkpoint: {field}"):
            vague.append(f"{label}: {detail}")
    print(f"{len(mutations)} field mutations")
    assert silent == [], f"accepted silently: {silent}"
    assert vague == [], "\n".join(vague)
    assert len(mutations) >= 140


def test_the_containers_that_are_not_checkpoints_are_named(original, tmp_path):
    cases = {"empty.npz": b"", "text.npz": b"params = [0.1, 0.2]\n", "array.npy": npy(np.zeros(3, np.float32)),
             "gzip.npz": b"\x1f\x8b\x08\x00" + bytes(40)}
    expected = {"empty.npz": "the archive", "text.npz": "the archive", "array.npy": "the file: is a single .npy array",
                "gzip.npz": "the archive"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        verdict, detail = outcome(tmp_path / name)
        assert verdict == "refused"
        assert_one_line(detail, f"{tmp_path / name}: not a valid checkpoint: {expected[name]}")
    (tmp_path / "folder.npz").mkdir()
    with pytest.raises(ValueError, match="is a directory, not a checkpoint"):
        load_checkpoint(tmp_path / "folder.npz")


def test_valid_variants_load_with_the_original_values(original, tmp_path):
    reference = load_checkpoint(original)
    for number, (label, members, method) in enumerate(valid_variants(original)):
        path = tmp_path / f"v{number}.npz"
        write_members(path, members, method)
        verdict, loaded = outcome(path)
        assert verdict == "accepted", f"{label}: {loaded}"
        assert all(np.array_equal(loaded[name], reference[name]) for name in ("params", "momentum")), label
        assert loaded["params"].dtype.isnative and loaded["params"].flags.writeable


def byte_offsets(original: Path, count: int = 300) -> list[int]:
    """``count`` bytes drawn from every zip header, .npy header, the central directory and the end record,
    and a few of every member's data."""
    size = original.stat().st_size
    structure, data = set(), set()
    with zipfile.ZipFile(original) as archive:
        infos = archive.infolist()
        directory = archive.start_dir
    for info in infos:
        local = info.header_offset
        start = local + 30 + len(info.filename) + len(info.extra)          # the member's data (its .npy file)
        structure.update(range(local, start + 128))                        # local header, .npy magic and header
        data.update(np.linspace(start + 128, start + info.compress_size - 1, 6).astype(int).tolist())
    structure.update(range(directory, size))
    drawn = np.random.default_rng(0).choice(sorted(structure), count, replace=False).tolist()
    return sorted(offset for offset in set(drawn) | data if offset < size)


def test_damaged_bytes_are_refused_or_change_nothing(original, tmp_path):
    good_bytes, reference = original.read_bytes(), load_checkpoint(original)
    rng = np.random.default_rng(26)
    offsets = byte_offsets(original)
    cases = [(f"byte {offset} ^ {mask:#04x}", good_bytes[:offset] + bytes([good_bytes[offset] ^ mask]) + good_bytes[offset + 1:])
             for offset, mask in zip(offsets, rng.integers(1, 256, len(offsets)))]
    cases += [(f"truncated to {length}", good_bytes[:length])
              for length in np.linspace(0, len(good_bytes) - 1, 40).astype(int)]
    path = tmp_path / "damaged.npz"
    silent, vague, refused = [], [], 0
    for label, data in cases:
        path.write_bytes(data)
        verdict, detail = outcome(path)
        if verdict == "accepted":
            if not same_contents(detail, reference):
                silent.append(label)
        elif "\n" in detail or not detail.startswith(f"{path}: "):
            vague.append(f"{label}: {detail}")
        else:
            refused += 1
    print(f"{len(cases)} byte mutations, {refused} refused, the rest read exactly as the original")
    assert len(cases) >= 350
    assert silent == [], f"accepted with changed contents: {silent[:10]}"
    assert vague == [], "\n".join(vague[:10])


def test_the_command_line_says_what_is_wrong_in_one_line(original, tmp_path):
    good = members_of(original)
    saved = load_checkpoint(original)
    nan = saved["params"].copy()
    nan[3] = np.nan
    write_members(tmp_path / "nan.npz", {**good, "params.npy": npy(nan)})
    code, out, err = run_main("evaluate", "--checkpoint", str(tmp_path / "nan.npz"))
    assert code == 2 and out == ""
    assert_one_line(err, "params", "1 of", "NaN or infinite: the weights are not finite")

    (tmp_path / "plain.npz").write_bytes(npy(saved["params"]))
    code, _, err = run_main("evaluate", "--checkpoint", str(tmp_path / "plain.npz"))
    assert code == 2
    assert_one_line(err, "is a single .npy array")

    tiny_idx = write_tiny_idx(tmp_path / "idx")
    for name, members in {"epoch.npz": {**good, "epoch.npy": npy(np.array(-5))},
                          "config.npz": {**good, "config.npy": text([1, 2])}}.items():
        write_members(tmp_path / name, members)
        before = digest(tmp_path / name)
        code, _, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "2", "--batch-size", "16",
                                "--checkpoint", str(tmp_path / name), "--resume", "--out", str(tmp_path / "h.json"),
                                "--no-progress")
        assert code == 2
        assert_one_line(err, f"{tmp_path / name}: not a valid checkpoint: {name[:-4]}")
        assert digest(tmp_path / name) == before
