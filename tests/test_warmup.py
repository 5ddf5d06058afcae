"""The kernel warm-up (``weftboard.cuda.warmup``, ``weftboard warmup``): after it, a real
publisher and a real island compile nothing more.

The check runs in a fresh process, so what the kernels were compiled for is only what that
process did: the warm-up, then publishing and following runs of several served formats and
encodings through a real board (the test's, on real Redis) and blob store. Every compile or
cache load the run adds after the warm-up is a path the warm-up missed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pubsubkit import Trainer, follow_each

# (served format, its options, patch encoding, publisher options): the fp32-master bf16 read in
# both scans and staged in parts, the baseline encoding, fp8 with block scales (1-, 2- and
# 4-byte elements) and nvfp4 (packed bytes and fp8 scales).
_CASES = [
    ("bf16", {}, "default", {"part_bytes": 4096}),
    ("bf16", {}, "context", {}),
    ("bf16", {}, "baseline", {}),
    ("fp8_e4m3", {"scale_granularity": "block128"}, "default", {}),
    ("nvfp4", {}, "context", {}),
]


def _publish_and_follow(address: str, token: str, blob_dir: Path, work: Path, case: tuple) -> None:
    """Three versions of a small model published in one case's format and encoding, followed
    version by version by an island that must hold an independent projection bitwise."""
    from weftboard.board.blobs import LocalDirBlobStore
    from weftboard.board.client import BoardClient
    from weftboard.cuda.formats import Projector, ServedFormatSpec
    from weftboard.publisher.publisher import Publisher

    kind, spec_options, encoding, publisher_options = case
    run = f"warm-{kind}-{encoding}"
    spec = ServedFormatSpec(kind, **spec_options)
    store = LocalDirBlobStore(blob_dir)
    trainer = Trainer(lr=1e-4, d=128, hidden=256)
    reference = Projector(spec)
    views: dict[int, dict] = {}
    with Publisher(address, run, token=token, blob_store=store, served_format=spec, encoding=encoding,
                   anchor_every=1000, anchor_patch_fraction=100.0, **publisher_options) as pub:
        for _ in range(3):
            trainer.step()
            handle = pub.publish(trainer.model, step=trainer.step_no)
            state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            views[handle.version] = reference.project(state, anchor=handle.version == 1)
        pub.flush()

    async def follow() -> None:
        async with BoardClient(address, token) as client:
            await follow_each(client, run, store, work / run, views)

    asyncio.run(follow())


def _child(address: str, token: str, blob_dir: str, work: str) -> None:
    """The fresh process: the warm-up for the cases' formats and encodings, then the cases;
    prints what the cases compiled or loaded beyond the warm-up, as JSON."""
    from weftboard.cuda.jit import kernel_signatures
    from weftboard.cuda.warmup import warm_up_kernels

    warm = warm_up_kernels(sorted({c[0] for c in _CASES}), sorted({c[2] for c in _CASES}))
    before = kernel_signatures()
    for case in _CASES:
        _publish_and_follow(address, token, Path(blob_dir), Path(work), case)
    print(json.dumps({"warmed": len(warm.signatures), "widths": warm.widths,
                      "after": sorted(map(list, kernel_signatures() - before))}))


@pytest.mark.timeout(900)  # the child compiles everything itself where the disk cache is empty
async def test_after_the_warm_up_a_real_publisher_and_island_compile_nothing_more(board, local_store,
                                                                                  tmp_path: Path) -> None:
    tests = Path(__file__).parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); import test_warmup; "
            f"test_warmup._child({board.address!r}, {board.admin_token!r}, {str(local_store.root)!r}, "
            f"{str(tmp_path / 'work')!r})")
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True,
                                   timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["widths"] == [1, 2, 4]
    assert result["after"] == [], "the warm-up missed these kernel signatures:\n" + "\n".join(
        f"{name} {sig}" for name, sig in result["after"])


def test_the_warm_up_refuses_an_unknown_format_or_encoding() -> None:
    from weftboard.cuda.warmup import warm_up_kernels
    from weftboard.proto.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="encodings must be some of"):
        warm_up_kernels(("bf16",), ("zstd",))
    with pytest.raises(InvalidArgument, match="served format kind 'bf17'"):
        warm_up_kernels(("bf17",), ("default",))


def test_served_widths_follow_the_formats_stored_dtypes() -> None:
    from weftboard.cuda.warmup import served_widths

    assert served_widths(["bf16"]) == (2,)
    assert served_widths(["fp16"]) == (2,)
    assert served_widths(["raw"]) == (4,)
    assert served_widths(["mxfp4"]) == (1, 2)  # packed values and e8m0 scales; norms stay bf16
    assert served_widths(["fp8_e4m3", "bf16"]) == (1, 2, 4)  # fp8 values, bf16 norms, fp32 scales


@pytest.mark.timeout(600)  # the session warm-up it asks for, on an empty cache
def test_the_warmup_command_reports_what_it_warmed(warm_kernels) -> None:
    """In this process the session's warm-up already ran: the command loads nothing new and says
    so; the same call in a fresh process is what the first test above times."""
    from typer.testing import CliRunner

    from weftboard.board.cli import build_app

    out = CliRunner().invoke(build_app(), ["warmup", "--format", "bf16", "--encoding", "default"])
    assert out.exit_code == 0, out.output
    assert "kernel cache: " in out.output
    assert "2-byte elements: the read of an fp32 master served as bf16" in out.output
    assert "warm: 0 kernel signatures compiled or loaded for 2-byte elements and the default encoding" in out.output
    bad = CliRunner().invoke(build_app(), ["warmup", "--format", "bf17"])
    assert bad.exit_code == 2 and "choose from bf16" in bad.output


_SHARED_VARIANTS = r"""
import json, torch, numpy as np
from weftboard.cuda import tile_encode
from weftboard.cuda.codec import CODEC_TILE, apply_patch_, encode_patch
from weftboard.cuda.jit import kernel_signatures

g = torch.Generator().manual_seed(0)
old = torch.randn(3 * CODEC_TILE + 5, generator=g).to(torch.bfloat16)
bits = old.clone().view(torch.int16)
bits[::37] += 1
new = bits.view(torch.bfloat16)
zeros = torch.zeros(3 * CODEC_TILE + 5, dtype=torch.bfloat16)  # no spread for classes: a huffman stream
tiny = zeros.clone().view(torch.int16)
tiny[::41] = 1
pairs = [("w", old, new), ("z", zeros, tiny.view(torch.bfloat16))]
patches = [encode_patch(pairs, base_version=1, target_version=2, target_root="", encoding=e).data
           for e in ("default", "compact")]
a = old.clone().view(torch.int16).numpy().view(np.uint16)
tile_encode.scan_tiles(a, new.view(torch.int16).numpy().view(np.uint16), CODEC_TILE, {}, update=True)
for data in patches:
    for container in (data, bytearray(data), memoryview(bytearray(data))):
        live = {"w": old.clone(), "z": zeros.clone()}
        apply_patch_(live, container).revert()
count = {}
for name, _ in kernel_signatures():
    count[name.rsplit(".", 1)[1]] = count.get(name.rsplit(".", 1)[1], 0) + 1
print(json.dumps(count))
"""


def test_the_encoder_and_the_publishers_scan_share_one_compile_and_so_do_every_buffers_applies() -> None:
    """Each argument type compiles a kernel once more (minutes on an empty cache, over every
    kernel): ``encode_patch`` and the publisher's ``scan_tiles`` run one compiled scan of a
    width, and an apply from bytes, a bytearray or an arriving part's memoryview one decoder.
    In a fresh process, so the count is what these calls compiled or loaded."""
    out = subprocess.run([sys.executable, "-c", _SHARED_VARIANTS], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    count = json.loads(out.stdout.strip().splitlines()[-1])
    assert count["scan_encode_tiles_packed"] == 1, count
    assert count["_decode_tiles"] == 1, count
    assert count["decode_batch"] == 1 and count["_scan_batch"] == 1, count
    assert count["parse_stream"] == 1, count
