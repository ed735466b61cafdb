"""The tokenizer the cookbook loads for the service's debug model, served from disk.

The cookbook's ``tokenizer_utils.get_tokenizer(name)`` loads ``AutoTokenizer.from_pretrained``
from a directory named ``name`` relative to the working directory when there is one, and its
``model_info`` picks the renderer by that name (``qwen3`` for ``Qwen/Qwen3-8B``). The debug model
uses the built-in byte tokenizer (``model.hf_assets_path = ""``), so the directory holds the HF
files an HF export writes for it: the cookbook then tokenizes with exactly the server model's ids.
"""

from pathlib import Path

from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.hf_checkpoint import write_tokenizer_files
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer

MODEL_NAME = "Qwen/Qwen3-8B"
"""The base model name the cookbook recipes ask the service for: one the cookbook knows
(renderer ``qwen3``), which the service maps to its debug model."""

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def tokenizer_dir(root: str | Path, model_name: str = MODEL_NAME) -> Path:
    """Writes the byte tokenizer's HF files into ``<root>/<model_name>/`` and returns that folder;
    a cookbook recipe run with ``root`` as its working directory loads them for ``model_name``."""
    folder = Path(root) / model_name
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(ExportTokenizer.for_run(ByteTokenizer(), "", STOP_TOKENS), str(folder))
    return folder
