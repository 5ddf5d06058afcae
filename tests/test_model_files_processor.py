"""A vision-language trainer's processor as a run's model files: what ``save_pretrained`` writes
for it (``processor_config.json`` beside the tokenizer's files) is carried, so an island's
``AutoProcessor.from_pretrained`` loads it; a file it writes that is not carried is named in a
warning, never dropped silently; and the board takes a run declaring such files.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from weftboard.board.client import BoardClient
from weftboard.proto import errors
from weftboard.proto.model_files import HF_MODEL_FILE_NAMES
from weftboard.publisher.model_files import collect_model_files
from weftboard.publisher.publisher import Publisher

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")
TEXTS = ["the quick brown fox jumps over the lazy dog", "a picture shows <image> and a cat", "hello world"] * 4


def tiny_llava_processor():
    """A LlavaProcessor (a CLIP image processor and a tiny BPE tokenizer with a chat template):
    what GRPO on a vision-language model passes as ``processing_class``."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.chat_template = template
    return transformers.LlavaProcessor(image_processor=transformers.CLIPImageProcessor(), tokenizer=fast,
                                       patch_size=14, vision_feature_select_strategy="default",
                                       image_token="<image>", chat_template=template)


def test_the_processor_names_transformers_writes_are_carried() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.utils import hub

    assert set(PROCESSOR_FILES) <= set(HF_MODEL_FILE_NAMES)
    for name in (transformers.utils.PROCESSOR_NAME, transformers.utils.IMAGE_PROCESSOR_NAME,
                 transformers.utils.FEATURE_EXTRACTOR_NAME, transformers.utils.VIDEO_PROCESSOR_NAME,
                 hub.CHAT_TEMPLATE_FILE, hub.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE):
        assert name in HF_MODEL_FILE_NAMES, name


def test_a_processor_is_carried_whole_and_loads_on_an_island(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    processor = tiny_llava_processor()
    written = tmp_path / "written"
    processor.save_pretrained(written)
    with capture_logs() as logs:
        files = collect_model_files("r", [processor])
    names = [f.name for f in files]
    assert "processor_config.json" in names
    assert set(names) == {p.name for p in written.iterdir()}  # everything it wrote
    assert not [e for e in logs if e["log_level"] == "warning"]

    island = tmp_path / "island"  # the island's checkpoint folder: the run's files and a config
    island.mkdir()
    for f in files:
        (island / f.name).write_bytes(f.data)
    transformers.LlavaConfig().save_pretrained(island)
    loaded = transformers.AutoProcessor.from_pretrained(island)
    assert type(loaded).__name__ == "LlavaProcessor"
    assert loaded.patch_size == 14
    assert loaded.chat_template == processor.chat_template


def test_a_folder_with_processor_files_gives_them(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in (*PROCESSOR_FILES, "config.json"):
        (folder / name).write_text(json.dumps({"name": name}))
    (folder / "model.safetensors").write_bytes(b"weights are never model files")
    assert [f.name for f in collect_model_files("r", folder)] == sorted((*PROCESSOR_FILES, "config.json"))


def test_a_file_save_pretrained_writes_but_is_not_carried_is_named_in_a_warning() -> None:
    class Saves:  # writes a carried file, an unknown one and one in a folder
        def save_pretrained(self, where: str) -> None:
            Path(where, "processor_config.json").write_text("{}")
            Path(where, "custom_processing.py").write_text("# remote code")
            Path(where, "additional_chat_templates").mkdir()
            Path(where, "additional_chat_templates", "tools.jinja").write_text("{{ x }}")

    with capture_logs() as logs:
        files = collect_model_files("r", [Saves()])
    assert [f.name for f in files] == ["processor_config.json"]
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0]["dropped"] == ["additional_chat_templates/tools.jinja", "custom_processing.py"]
    assert warnings[0]["source"] == "Saves"

    class WritesNothingCarried:
        def save_pretrained(self, where: str) -> None:
            Path(where, "custom.txt").write_text("x")

    with pytest.raises(errors.InvalidArgument, match=r"WritesNothingCarried.save_pretrained .* \(it wrote custom.txt\)"):
        collect_model_files("r", [WritesNothingCarried()])


async def test_the_board_takes_a_run_with_a_processor(board, local_store) -> None:
    processor = tiny_llava_processor()

    def publish() -> int:
        with Publisher(board.address, "vlm", token=board.admin_token, blob_store=local_store,
                       model_files=[processor]) as pub:
            return pub.publish({"w": torch.ones(4, 4)}).result(60).version

    assert await asyncio.to_thread(publish) == 1  # version 1 commits only with every file stored
    async with BoardClient(board.address, board.admin_token) as client:
        names = [f.name for f in await client.get_model_files("vlm")]
    assert "processor_config.json" in names and "chat_template.jinja" in names
