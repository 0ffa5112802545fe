"""``python -m judgeloop.models NAME``: print the local folder of a model, for tools that take a path.

A packaged offline id (``HuggingFaceTB/SmolLM2-135M-Instruct``: the dequantized GGUF folder) or a local
directory prints at once; any other hub id is downloaded (safetensors, configs, tokenizer) into the
Hugging Face cache first. The folder loads with plain ``transformers.AutoModelForCausalLM.from_pretrained``
and TRL's ``model=`` argument.
"""

from __future__ import annotations

import sys


def folder(name: str) -> str:
    """The local folder for ``name`` (downloading a hub id that has no offline source)."""
    from pathlib import Path

    from judgeloop.models.loading import resolve_model_path

    path = resolve_model_path(name)
    if Path(path).is_dir():
        return path
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"{name!r} is not a directory (and not an org/name hub id); check the path")
    from huggingface_hub import snapshot_download

    return snapshot_download(
        path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        sys.stderr.write("usage: python -m judgeloop.models HUB_ID_OR_DIR  (prints the local model folder)\n")
        return 2
    try:
        path = folder(args[0])
    except (ValueError, FileNotFoundError) as err:
        sys.stderr.write(f"judgeloop.models: error: {err}\n")
        return 2
    sys.stdout.write(path + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
