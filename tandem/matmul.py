"""How a model's linear layers multiply on a CPU, chosen on the machine by timing them.

A verify pass multiplies a handful of rows (k + 1 per session) by every weight matrix, and
on a CPU the kernel behind `F.linear` decides whether that costs one row's time or k + 1
rows'. torch's default fp32 path (MKL) runs 2-4 rows about as separate matrix-vector
products on some CPUs (AVX2 EPYC); oneDNN with the weight prepacked once into its own
blocked layout runs them together, and runs one row faster too. Other CPUs differ (an
AVX-512 machine with bf16 has nearly flat passes already), so the path is not assumed: at
start-up a service times each distinct weight shape of its own model on each path, at the
row counts it will run, and keeps the cheaper one per shape.

Paths:
  default  torch's `F.linear` (MKL for fp32 on x86, oneDNN for bf16)
  onednn   oneDNN with the weight reordered once into its blocked layout; the original
           is dropped, so the weights are held once

Exactness: the kernels round differently in the last bits, as a pass of k + 1 rows already
rounds differently from k + 1 passes of one row. Greedy output is the target's own greedy
output on the path it runs (docs/ARCHITECTURE.md, "What exact means").
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT = "default"
ONEDNN = "onednn"
PATHS = (DEFAULT, ONEDNN)
AUTO = "auto"
# A draft may also run int8: weights quantized, activations scaled per pass (fbgemm). It
# changes the draft's numbers, so only its acceptance, never the output; a target never.
INT8 = "int8-dynamic"
CHOICES = (AUTO, *PATHS)
# The dtypes oneDNN's packed linear serves on a CPU.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Rows a service multiplies at once, which the timing covers: a decode token, a verify block
# of k + 1 (k = 1, 2, 4, 7), and passes shared by a few sessions.
TIMED_ROWS = (1, 2, 3, 5, 8, 16)
# A wider weight (a vocabulary head) is timed on this many of its output rows, scaled up:
# its cost grows with its rows, and timing the whole of it would take seconds.
TIMED_OUT_FEATURES = 16384
# Pass widths of the cost curve v(T) a replica reports: a decode, blocks of k + 1 for
# k = 1, 2, 4 and 8, and two sessions' blocks of 5.
PASS_TOKENS = (1, 2, 3, 5, 9, 10)


class OneDnnLinear(nn.Module):
    """A Linear layer whose weight oneDNN holds prepacked; the same maths as `nn.Linear`."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 1) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Reordered once into oneDNN's blocked layout for this shape; `rows_hint` is the row
        # count the layout is tuned for (any row count runs).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight: its shape, dtype and device are the original's."""
        return self.packed  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, path=onednn"


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                ) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class Shape:
    """A weight shape and how many layers of the model have it."""

    in_features: int
    out_features: int
    layers: int

    def __str__(self) -> str:
        return f"{self.in_features}x{self.out_features} (x{self.layers})"


@dataclass(frozen=True)
class Choice:
    """What the timing found: per shape, each path's ms at each row count, and the path kept."""

    rows: tuple[int, ...]
    timings: dict[Shape, dict[str, tuple[float, ...]]]  # shape -> path -> ms per row count
    chosen: dict[Shape, str]

    @property
    def summary(self) -> str:
        """The path, as ModelInfo reports it: one name, or the mix per shape."""
        paths = set(self.chosen.values())
        if len(paths) == 1:
            return paths.pop()
        return ",".join(f"{s.in_features}x{s.out_features}:{p}" for s, p in self.chosen.items())

    def table(self) -> str:
        """The timing table the service logs: rows x path, ms summed over the model's layers."""
        head = "rows " + " ".join(f"{r:>8d}" for r in self.rows)
        lines = [head]
        for path in (*PATHS, INT8):
            if not all(path in t for t in self.timings.values()):
                continue
            total = [sum(t[path][i] * s.layers for s, t in self.timings.items())
                     for i in range(len(self.rows))]
            lines.append(f"{path:<8} " + " ".join(f"{ms:8.1f}" for ms in total))
        return "\n".join(lines)


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every plain `nn.Linear` in the model (quantized or
    already packed layers are not `nn.Linear`)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, child))
    return found


def shapes(layers: Iterable[nn.Linear]) -> dict[tuple[int, int], Shape]:
    counts: dict[tuple[int, int], int] = {}
    for layer in layers:
        key = (layer.in_features, layer.out_features)
        counts[key] = counts.get(key, 0) + 1
    return {key: Shape(*key, layers) for key, layers in counts.items()}


def _median_ms(fn: object, x: torch.Tensor, repeats: int) -> float:
    assert callable(fn)
    fn(x)  # warm: the first call of a shape picks and caches the kernel
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


@torch.inference_mode()
def time_layer(layer: nn.Linear, rows: Sequence[int], paths: Sequence[str], repeats: int = 5
               ) -> dict[str, tuple[float, ...]]:
    """Each path's median ms for `layer` at each row count (copies are made and dropped)."""
    scale = max(1.0, layer.out_features / TIMED_OUT_FEATURES)
    if scale > 1.0:
        part = nn.Linear(layer.in_features, TIMED_OUT_FEATURES, bias=layer.bias is not None,
                         dtype=layer.weight.dtype)
        part.weight.copy_(layer.weight[:TIMED_OUT_FEATURES])
        if layer.bias is not None:
            part.bias.copy_(layer.bias[:TIMED_OUT_FEATURES])
        layer = part
    out: dict[str, tuple[float, ...]] = {}
    for path in paths:
        fn: nn.Module = layer if path == DEFAULT else OneDnnLinear(layer, max(rows)) \
            if path == ONEDNN else _int8_copy(layer)
        out[path] = tuple(scale * _median_ms(
            fn, torch.randn(1, r, layer.in_features, dtype=layer.weight.dtype), repeats)
            for r in rows)
        del fn
    return out


def _int8_copy(layer: nn.Linear) -> nn.Module:
    import warnings

    from torch.ao.quantization import quantize_dynamic

    copy = nn.Sequential(nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None))
    copy.load_state_dict({f"0.{k}": v for k, v in layer.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates torch.ao quantization, not this path yet
        return quantize_dynamic(copy, {nn.Linear}, dtype=torch.qint8)  # type: ignore[no-untyped-call, no-any-return]


def fastest(timings: dict[str, tuple[float, ...]]) -> str:
    """The path with the least time summed over the row counts timed."""
    return min(timings, key=lambda path: sum(timings[path]))


def pack(model: nn.Module, keep: dict[tuple[int, int], str] | None = None,
         rows_hint: int = 1) -> int:
    """Replace the model's `nn.Linear` layers by `OneDnnLinear` (those whose shape `keep` maps
    to onednn; all without `keep`); how many were packed. A tied head keeps its embedding's
    weight, so that matrix is then held twice (its packed copy for the head)."""
    packed = 0
    layers = linear_layers(model)
    while layers:  # popped as packed: a dense weight is freed once its packed copy exists
        parent, name, layer = layers.pop()
        if keep is not None and keep.get((layer.in_features, layer.out_features)) != ONEDNN:
            continue
        setattr(parent, name, OneDnnLinear(layer, rows_hint))
        packed += 1
    return packed


class PathError(Exception):
    """A matmul path the model or the machine cannot run."""


def refusal(model: nn.Module) -> str | None:
    """Why oneDNN's packed path cannot run this model (None: it can)."""
    if not onednn_available():
        return "this torch has no oneDNN"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "the model is not on the CPU"
    dtypes = {layer.weight.dtype for _, _, layer in linear_layers(model)}
    if not dtypes:
        return "the model has no plain Linear layers (quantized?)"
    if not dtypes <= set(ONEDNN_DTYPES):
        return f"oneDNN's packed linear serves float32 and bfloat16, not {sorted(map(str, dtypes))}"
    for dtype in dtypes:
        try:  # bfloat16 needs AVX-512 (or AVX-NE-CONVERT) on x86
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        except RuntimeError as exc:
            return f"oneDNN cannot pack {dtype} weights on this CPU ({str(exc).splitlines()[0]})"
    if any(getattr(layer.weight, "device_mesh", None) is not None
           for _, _, layer in linear_layers(model)):
        return "the model is sharded (tensor parallel)"
    return None


def apply(model: nn.Module, choice: str, rows: Sequence[int], repeats: int = 5,
          may_quantize: bool = False) -> tuple[str, Choice | None]:
    """Put the model on the path `choice` names (auto: timed per shape); the path it runs
    on, and the timings where they were taken.

    With `may_quantize` (a float32 draft), auto times int8-dynamic too; where the model's
    layers cost less in int8 than on the float paths, it returns INT8 and leaves the model
    as it is, for the caller to quantize (`models.quantize`)."""
    if choice not in CHOICES:
        raise PathError(f"--matmul must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == DEFAULT:
        return DEFAULT, None
    why_not = refusal(model)
    if why_not is not None:
        if choice == ONEDNN:
            raise PathError(f"--matmul onednn: {why_not}")
        log.info("matmul path: default (%s)", why_not)
        return DEFAULT, None
    if choice == ONEDNN:
        pack(model, rows_hint=max(rows))
        return ONEDNN, None
    found = shapes(layer for _, _, layer in linear_layers(model))
    representative: dict[tuple[int, int], nn.Linear] = {}
    for _, _, layer in linear_layers(model):
        representative.setdefault((layer.in_features, layer.out_features), layer)
    paths = (*PATHS, INT8) if may_quantize and model.dtype == torch.float32 else PATHS
    timings = {found[key]: time_layer(layer, rows, paths, repeats)
               for key, layer in representative.items()}
    chosen = {shape: fastest({p: t[p] for p in PATHS}) for shape, t in timings.items()}
    result = Choice(tuple(rows), timings, chosen)
    if INT8 in paths:
        floats = sum(sum(t[chosen[s]]) * s.layers for s, t in timings.items())
        int8 = sum(sum(t[INT8]) * s.layers for s, t in timings.items())
        if int8 < floats:
            log.info("matmul path: %s (its layers cost %.0f%% of the float paths'); linear "
                     "layers' ms per pass, by rows:\n%s", INT8, 100 * int8 / floats, result.table())
            return INT8, result
    pack(model, {(s.in_features, s.out_features): p for s, p in chosen.items()}, max(rows))
    log.info("matmul path: %s; linear layers' ms per pass, by rows:\n%s", result.summary,
             result.table())
    return result.summary, result


@torch.inference_mode()
def time_passes(model: nn.Module, tokens: Sequence[int], context: int = 64, repeats: int = 3
                ) -> dict[int, float]:
    """v(T): the median ms of one forward pass of T tokens after `context` cached ones, every
    row projected onto the vocabulary (as a verify pass does), for each T in `tokens`."""
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device  # type: ignore[operator]
    on_gpu = device.type == "cuda"
    vocab = int(model.config.get_text_config().vocab_size)  # type: ignore[union-attr, operator]
    generator = torch.Generator().manual_seed(0)
    history = torch.randint(0, vocab, (1, context + max(tokens)), generator=generator).to(device)
    cache = DynamicCache()
    model(input_ids=history[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    out: dict[int, float] = {}
    for t in tokens:
        ids = history[:, context:context + t]
        keep = torch.arange(t, device=device)
        samples = []
        for i in range(repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep)
            if on_gpu:
                torch.cuda.synchronize()
            if i:
                samples.append((time.perf_counter() - started) * 1000.0)
            cache.crop(-t)  # transformers 5.x: the (negative) number of tokens to remove
        out[t] = statistics.median(samples)
    return out
