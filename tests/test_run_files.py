"""A run's model files (config, tokenizer) make an island's checkpoint folder a complete
Hugging Face model folder.

Real board, real Redis, real SeaweedFS: a trainer publishes a tiny random Llama with its
config, generation config and tokenizer files (uploaded through presigned URLs); islands,
with S3 credentials or with presigned URLs only, end with a folder holding the files
byte-identical beside verified safetensors, which transformers loads when it is installed
(else the config is parsed and every tensor checked against it). A corrupted file in S3 is
refused and never written; bad names, other files for the same run, and a version 1 whose
files were never uploaded are refused; garbage collection keeps the files.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from boardkit import digest_of, make_record, make_run, upload
from safetensors.torch import load_file

from weftboard.board.client import BoardClient
from weftboard.board.gc import VersionBlobs, plan_gc
from weftboard.proto import errors
from weftboard.proto.model_files import MAX_MODEL_FILES_BYTES, check_model_files
from weftboard.proto.names import blob_key
from weftboard.proto.records import BlobRef
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.model_files import collect_model_files
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.checkpoint_dir import MODEL_FILES, CheckpointDirDestination
from weftboard.subscriber.model_files import hold_model_files
from weftboard.subscriber.subscriber import Subscriber

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7}
TOKENIZER_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 128, "chat_template": "{{ x }}"}
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face LlamaForCausalLM with ``config``, by checkpoint name."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def write_model_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A trainer's model folder (config, generation config, tokenizer files, plus weight files
    that must not be taken as model files); returns the random weights of the config."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(LLAMA, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (folder / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS))
    (folder / "tokenizer.model").write_bytes(os.urandom(3000))  # a sentencepiece model is opaque bytes
    (folder / "model.safetensors").write_bytes(b"not taken")
    (folder / "training_args.bin").write_bytes(b"not taken either")
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=gen) * 0.02 for n, s in llama_shapes(LLAMA).items()}


def publish(board, store, run: str, model_dir: Path, weights: dict[str, torch.Tensor], versions: int = 1,
            **kw) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``versions`` versions (the weights nudged each time); the bf16 view of each."""
    served = {}
    with Publisher(board.address, run, token=board.admin_token, blob_store=store, model_files=model_dir, **kw) as pub:
        for step in range(versions):
            weights = {n: t + 1e-3 * step for n, t in weights.items()}
            served[pub.publish(weights, step=step).version] = {n: t.to(torch.bfloat16) for n, t in weights.items()}
    return served


def model_files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors"
            and p.name != "weftboard.json"}


def check_loads(folder: Path, served: dict[str, torch.Tensor]) -> None:
    """The folder is a Hugging Face model folder: its config describes its weights."""
    try:
        import transformers  # optional: the check is stronger where it is installed
    except ImportError:
        transformers = None
    if transformers is not None:
        config = transformers.AutoConfig.from_pretrained(folder)
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 256)
        got = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
        for name, tensor in served.items():
            assert torch.equal(got[name].to(torch.bfloat16), tensor), name  # bf16 -> fp32 -> bf16 is exact
        assert transformers.GenerationConfig.from_pretrained(folder).temperature == 0.7
        return
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in tensors.items()} == llama_shapes(config)
    for name, tensor in served.items():
        assert torch.equal(tensors[name], tensor), name


# -- the rules ------------------------------------------------------------------------------


def _ref(run: str, name: str, data: bytes = b"{}") -> BlobRef:
    return BlobRef(blob_key(run, digest_of(data)), digest_of(data), len(data), name=name)


@pytest.mark.parametrize("name", ["/etc/passwd", "../config.json", "a/../b.json", "a/b/c.json", ".hidden",
                                  "sub/.tmp-x", "", "a//b", "con fig.json", "x\\y.json", "model.safetensors",
                                  "pytorch_model.bin", "weights.PT", "model.safetensors.index.json",
                                  "model.safetensors/config.json", "weftboard.json"])
def test_unsafe_or_weight_names_are_refused(name: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="run.model_files\\[0\\].name"):
        check_model_files("r", [_ref("r", name)])


def test_names_counts_and_sizes() -> None:
    check_model_files("r", [_ref("r", "config.json"), _ref("r", "tokenizer/vocab.txt", b"a b"),
                            _ref("r", "chat_template.jinja", b"{{ x }}")])
    many = [_ref("r", f"f{i}.json", str(i).encode()) for i in range(65)]
    with pytest.raises(errors.InvalidArgument, match="65 files; at most 64"):
        check_model_files("r", many)
    big = BlobRef(blob_key("r", digest_of(b"x")), digest_of(b"x"), MAX_MODEL_FILES_BYTES + 1, name="big.json")
    with pytest.raises(errors.InvalidArgument, match="at most 67108864"):
        check_model_files("r", [big])
    with pytest.raises(errors.InvalidArgument, match="given twice"):
        check_model_files("r", [_ref("r", "config.json"), _ref("r", "config.json", b"[]")])
    with pytest.raises(errors.InvalidArgument, match="both as a file and as a folder"):
        check_model_files("r", [_ref("r", "tok"), _ref("r", "tok/vocab.txt", b"a")])
    with pytest.raises(errors.InvalidArgument, match="empty file"):
        check_model_files("r", [_ref("r", "empty.json", b"")])
    with pytest.raises(errors.InvalidArgument, match="content-addressed key"):
        check_model_files("r", [BlobRef("other/blobs/" + "0" * 32, digest_of(b"{}"), 2, name="config.json")])
    with pytest.raises(errors.InvalidArgument, match="url must be empty"):
        check_model_files("r", [BlobRef(blob_key("r", digest_of(b"{}")), digest_of(b"{}"), 2, "http://x", "a.json")])


def test_publisher_collects_a_folder_a_list_a_mapping_and_saved_objects(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    write_model_folder(folder)
    names = [f.name for f in collect_model_files("r", folder)]
    assert names == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.model",
                     "tokenizer_config.json"]  # no weight file, in name order
    files = collect_model_files("r", [folder / "config.json", str(folder / "tokenizer.model")])
    assert [(f.name, f.data) for f in files] == [("config.json", (folder / "config.json").read_bytes()),
                                                 ("tokenizer.model", (folder / "tokenizer.model").read_bytes())]
    assert files[0].digest == digest_of(files[0].data)
    nested = collect_model_files("r", {"tokenizer/tokenizer.model": folder / "tokenizer.model"})
    assert nested[0].ref("r").name == "tokenizer/tokenizer.model"

    class Saves:  # what transformers' configs and tokenizers do
        def save_pretrained(self, where: str) -> None:
            Path(where, "generation_config.json").write_text("{}")

    assert [f.name for f in collect_model_files("r", [Saves(), folder / "config.json"])] == [
        "config.json", "generation_config.json"]
    with pytest.raises(errors.InvalidArgument, match="not the model"):
        collect_model_files("r", [torch.nn.Linear(2, 2)])
    with pytest.raises(errors.InvalidArgument, match="weight file"):
        collect_model_files("r", [folder / "model.safetensors"])
    with pytest.raises(errors.InvalidArgument, match="No such file"):
        collect_model_files("r", [folder / "absent.json"])
    with pytest.raises(errors.InvalidArgument, match="two files are named"):
        collect_model_files("r", [folder, folder / "config.json"])
    huge = tmp_path / "vocab.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_MODEL_FILES_BYTES + 1)  # sparse: refused from its size, never read
    with pytest.raises(errors.InvalidArgument, match="more than 64 MiB in all"):
        collect_model_files("r", [folder / "config.json", huge])
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.InvalidArgument, match="holds none of"):
        collect_model_files("r", tmp_path / "empty")


def test_gc_plan_never_deletes_a_kept_key() -> None:
    versions = {1: VersionBlobs(1, anchor=(("r/blobs/a", 10), ("r/blobs/cfg", 5))), 2: VersionBlobs(2, patch=(("p2", 1),)),
                3: VersionBlobs(3, anchor=(("r/blobs/b", 10),))}
    plan = plan_gc(versions, 3, 1, [], keep_anchors=1, keep_versions=1, orphans={"r/blobs/cfg": 5})
    assert plan.oldest_available == 3 and "r/blobs/cfg" in dict(plan.delete)
    kept = plan_gc(versions, 3, 1, [], keep_anchors=1, keep_versions=1, orphans={"r/blobs/cfg": 5},
                   keep={"r/blobs/cfg"})
    assert dict(kept.delete) == {"r/blobs/a": 10, "p2": 1}


# -- the board --------------------------------------------------------------------------------


async def test_board_stores_checks_and_keeps_model_files(board, local_store) -> None:
    files = {"config.json": json.dumps(LLAMA).encode(), "tokenizer/tokenizer.model": os.urandom(100)}
    async with BoardClient(board.address, board.admin_token) as client:
        refs = [pb.BlobRef(key=blob_key("mf", digest_of(d)), digest=digest_of(d), size=len(d), name=n)
                for n, d in files.items()]
        run = make_run("mf", keep_anchors=1, keep_versions=1)
        run.model_files.extend(reversed(refs))
        created = await client.create_run(run)
        assert [f.name for f in created.model_files] == ["config.json", "tokenizer/tokenizer.model"]
        again = make_run("mf", keep_anchors=1, keep_versions=1)
        again.model_files.extend(refs)  # the same files in another order: idempotent
        assert (await client.create_run(again)).model_files == created.model_files
        other = make_run("mf")
        other.model_files.extend(refs)
        other.model_files[0].CopyFrom(pb.BlobRef(key=blob_key("mf", digest_of(b"{}")), digest=digest_of(b"{}"),
                                                 size=2, name="config.json"))
        with pytest.raises(errors.AlreadyExists, match="other model files: 'config.json' is 2 bytes"):
            await client.create_run(other)
        fewer = make_run("mf")
        fewer.model_files.append(refs[0])
        with pytest.raises(errors.AlreadyExists, match="'tokenizer/tokenizer.model' is missing"):
            await client.create_run(fewer)
        with pytest.raises(errors.AlreadyExists, match="model files"):
            await client.create_run(make_run("mf"))
        bad = make_run("bad")
        bad.model_files.append(pb.BlobRef(key=refs[0].key.replace("mf", "bad"), digest=refs[0].digest,
                                          size=refs[0].size, name="../config.json"))
        with pytest.raises(errors.InvalidArgument, match="not a safe relative file name"):
            await client.create_run(bad)
        bad.model_files[0].name = "model-00001-of-00002.safetensors"
        with pytest.raises(errors.InvalidArgument, match="weight file"):
            await client.create_run(bad)

        # Version 1 commits only once every model file is in the blob store.
        first = await make_record(local_store, "mf", 1)
        with pytest.raises(errors.FailedPrecondition, match="model file 'config.json' of run 'mf'.*does not exist"):
            await client.commit_version(first)
        for name, data in files.items():
            await upload(local_store, "mf", data, name=name)
        await client.commit_version(first)
        assert [f.name for f in await client.get_model_files("mf")] == ["config.json", "tokenizer/tokenizer.model"]
        assert all(not f.url for f in await client.get_model_files("mf", presign=True))  # a local store: no URLs
        with pytest.raises(errors.NotFound):
            await client.get_model_files("absent")

        # Garbage collection, whatever it collects, keeps the files.
        for v in range(2, 6):
            await client.commit_version(await make_record(local_store, "mf", v, anchor=v % 2 == 1))
        done = await client.collect_garbage("mf")
        assert done.oldest_available == 5 and done.deleted_keys
        assert not {r.key for r in refs} & set(done.deleted_keys)
        for ref in refs:
            assert await local_store.stat(ref.key) == ref.size
        assert (await client.get_run("mf")).model_files == created.model_files


async def test_island_role_gets_presigned_model_files(board_factory, s3_store) -> None:
    board = await board_factory(blobs=s3_store)
    data = json.dumps(LLAMA).encode()
    async with BoardClient(board.address, board.admin_token) as admin:
        ref = await upload(s3_store, "ps", data, name="config.json")
        run = make_run("ps")
        run.model_files.append(ref)
        await admin.create_run(run)
        reader = (await admin.create_token("reader", pb.ROLE_READER)).token
        island = (await admin.create_token("island", pb.ROLE_ISLAND)).token
    async with BoardClient(board.address, reader) as client:
        assert (await client.get_run("ps")).model_files[0].url == ""  # names and digests only
        with pytest.raises(errors.PermissionDenied, match="GetModelFiles"):
            await client.get_model_files("ps", presign=True)
    async with BoardClient(board.address, island) as client:
        [got] = await client.get_model_files("ps", presign=True)
        assert got.url.startswith("http") and got.name == "config.json" and got.digest == digest_of(data)


# -- publisher and island, end to end ---------------------------------------------------------


@pytest.mark.usefixtures("warm_kernels")
@pytest.mark.timeout(600)
async def test_island_folder_is_a_complete_model_folder(board_factory, s3_store, tmp_path: Path) -> None:
    board = await board_factory(blobs=s3_store)
    model_dir = tmp_path / "trainer-model"
    weights = write_model_folder(model_dir)
    # Uploads through the board's presigned URLs (the publisher has no blob-store credentials).
    served = await asyncio.to_thread(publish, board, None, "llama", model_dir, weights, 2)
    expected = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.suffix not in (".safetensors", ".bin")}
    assert len(expected) == 5

    async with BoardClient(board.address, board.admin_token) as client:
        run = await client.get_run("llama")
        assert sorted(f.name for f in run.model_files) == sorted(expected)
        for presigned in (False, True):  # with S3 credentials, and with presigned URLs only
            root = tmp_path / f"island-{presigned}"
            dest = await asyncio.to_thread(CheckpointDirDestination, root)
            sub = Subscriber(client, "llama", dest, island_id=f"isl-{presigned}", blob_store=None if presigned else s3_store,
                             cache_dir=root / "cache", heartbeat=False)
            assert await sub.sync_to(1) == 1
            folder = dest.current.resolve()
            assert model_files_in(folder) == expected
            meta = json.loads((folder / "weftboard.json").read_text())
            assert meta["model_files"] == {n: digest_of(d) for n, d in expected.items()}
            await asyncio.to_thread(check_loads, dest.current, served[1])
            assert await sub.sync_to(2) == 2  # a patched version carries them too
            assert model_files_in(dest.current.resolve()) == expected
            await asyncio.to_thread(check_loads, dest.current, served[2])
            assert not [p for p in (root / "cache").rglob("*") if p.is_file()]  # the fetched copies are gone

        # A restarted island with its files on disk fetches none of them again; one whose held
        # version lacks them (an older island) gets them placed beside its weights.
        root = tmp_path / "island-False"
        (root / "current" / "config.json").unlink()
        dest = await asyncio.to_thread(CheckpointDirDestination, root)
        sub = Subscriber(client, "llama", dest, island_id="again", blob_store=s3_store, cache_dir=root / "cache",
                         heartbeat=False)
        assert await sub.sync_to(2) == 2
        assert sub.fetcher.bytes_downloaded == 0
        assert model_files_in(dest.current.resolve()) == expected
        (root / MODEL_FILES / "generation_config.json").write_text("{}")  # a damaged copy is fetched anew
        fetched = await hold_model_files(client, "llama", dest, sub.fetcher, presign=False)
        assert fetched == ["generation_config.json"]
        assert (root / MODEL_FILES / "generation_config.json").read_bytes() == expected["generation_config.json"]


@pytest.mark.usefixtures("warm_kernels")
@pytest.mark.timeout(600)
async def test_a_corrupted_model_file_is_refused_and_never_written(board_factory, s3_store, tmp_path: Path) -> None:
    board = await board_factory(blobs=s3_store)
    model_dir = tmp_path / "trainer-model"
    weights = write_model_folder(model_dir)
    await asyncio.to_thread(publish, board, s3_store, "bad", model_dir, weights, 1)
    async with BoardClient(board.address, board.admin_token) as client:
        config = next(f for f in (await client.get_run("bad")).model_files if f.name == "config.json")
        good = await s3_store.get_bytes(config.key)
        damaged = bytearray(good)
        damaged[10] ^= 0x20
        await s3_store.put_bytes(config.key, bytes(damaged))
        root = tmp_path / "island"
        dest = await asyncio.to_thread(CheckpointDirDestination, root)
        sub = Subscriber(client, "bad", dest, island_id="isl", blob_store=s3_store, cache_dir=root / "cache")
        with pytest.raises(errors.DigestMismatch, match="config.json"):
            await sub.sync_to(1)
        assert dest.held_version() == 0 and not dest.current.exists()
        assert not [p for p in root.rglob("*") if "config.json" in p.name]  # nor a partial or temporary copy
        status = {i.status.island_id: i.status for i in (await client.list_islands("bad")).islands}["isl"]
        assert status.state == pb.ISLAND_STATE_ERROR and "model files: DigestMismatch" in status.message
        await s3_store.put_bytes(config.key, good)  # repaired: the next attempt completes the folder
        assert await sub.sync_to(1) == 1
        assert (dest.current / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


@pytest.mark.usefixtures("warm_kernels")
@pytest.mark.timeout(600)
async def test_a_publisher_with_other_model_files_is_refused(board, local_store, tmp_path: Path) -> None:
    model_dir = tmp_path / "trainer-model"
    weights = write_model_folder(model_dir)
    await asyncio.to_thread(publish, board, local_store, "fixed", model_dir, weights, 1)
    (model_dir / "generation_config.json").write_text(json.dumps({**GENERATION, "temperature": 1.0}))

    def other(**kw) -> int:
        with Publisher(board.address, "fixed", token=board.admin_token, blob_store=local_store, **kw) as pub:
            return pub.publish(weights).result(60).version

    with pytest.raises(errors.AlreadyExists, match="'generation_config.json' is .* the run's is"):
        await asyncio.to_thread(other, model_files=model_dir)
    assert await asyncio.to_thread(other) == 2  # a publisher that names no model files takes the run's
