"""The CPU matmul paths: oneDNN's packed layers compute what nn.Linear does, hold the weights
once, and the greedy output through the services is the target's own on each path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from tiny import PROMPTS, greedy_reference, speculated
from torch import nn
from transformers import AutoModelForCausalLM

from tandem import matmul, models
from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2, target_pb2_grpc

pytestmark = pytest.mark.skipif(not matmul.onednn_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_what_linear_does(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = matmul.OneDnnLinear(linear, rows_hint=rows)
    for shape in ((rows, 48), (2, rows, 48)):
        x = torch.randn(shape)
        with torch.inference_mode():
            assert torch.allclose(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed.weight.shape == linear.weight.shape and packed.weight.dtype == torch.float32


def tiny_model(tiny_target: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def test_onednn_packs_every_linear_and_holds_its_weight_once(tiny_target: Path) -> None:
    model = tiny_model(tiny_target)
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    dense = sum(layer.weight.numel() for _, _, layer in matmul.linear_layers(model))
    before = sum(p.numel() for p in model.parameters())
    assert matmul.apply(model, "onednn", matmul.TIMED_ROWS) == ("onednn", None)
    assert not matmul.linear_layers(model)  # no plain nn.Linear left
    assert sum(isinstance(m, matmul.OneDnnLinear) for m in model.modules()) > 0
    # The dense weights are gone: only the packed copies hold them (not parameters).
    assert sum(p.numel() for p in model.parameters()) == before - dense
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_packed_model_with_biases_computes_what_the_unpacked_one_does(tmp_path: Path) -> None:
    """A reference outside the path: the same weights unpacked. Its square projections (q and
    o) and the others carry biases, as Qwen2's do; a bias lost in packing moves the logits."""
    from tiny import make_model

    path = make_model(tmp_path / "biased", seed=3, attention_bias=True)
    model, reference = tiny_model(path), tiny_model(path)
    assert {name.split(".")[-2] for name, _ in model.named_parameters() if name.endswith(".bias")} \
        == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert matmul.apply(model, "onednn", matmul.TIMED_ROWS) == ("onednn", None)
    ids = torch.tensor([[1, 5, 7, 9, 3, 4, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_auto_packs_exactly_the_shapes_it_timed_faster(tiny_target: Path) -> None:
    model = tiny_model(tiny_target)
    shapes = {(layer.in_features, layer.out_features) for _, _, layer in matmul.linear_layers(model)}
    summary, choice = matmul.apply(model, "auto", (1, 2, 5), repeats=2)
    assert choice is not None
    assert {(s.in_features, s.out_features) for s in choice.chosen} == shapes
    for shape, timings in choice.timings.items():
        assert set(timings) == set(matmul.PATHS) and all(len(t) == 3 for t in timings.values())
        assert choice.chosen[shape] == min(matmul.PATHS, key=lambda p: sum(timings[p]))
    packed = {(m.in_features, m.out_features) for m in model.modules()
              if isinstance(m, matmul.OneDnnLinear)}
    assert packed == {(s.in_features, s.out_features) for s, p in choice.chosen.items()
                      if p == "onednn"}
    assert summary == choice.summary and "rows" in choice.table()


def test_a_quantized_draft_keeps_its_own_kernels(tiny_target: Path) -> None:
    model = models.quantize(tiny_model(tiny_target), models.Placement("cpu", "float32",
                                                                     quantize="int8-dynamic"))
    assert matmul.refusal(model) is not None
    assert matmul.apply(model, "auto", matmul.TIMED_ROWS) == ("default", None)
    with pytest.raises(matmul.PathError, match="onednn"):
        matmul.apply(model, "onednn", matmul.TIMED_ROWS)
    with pytest.raises(matmul.PathError, match="must be one of"):
        matmul.apply(model, "fastest", matmul.TIMED_ROWS)


def test_time_passes_reports_each_width(tiny_target: Path) -> None:
    times = matmul.time_passes(tiny_model(tiny_target), (1, 3, 5), context=8, repeats=2)
    assert list(times) == [1, 3, 5] and all(ms > 0 for ms in times.values())


LENGTH = 32


@pytest.fixture(scope="module", params=matmul.PATHS)
def path_stack(request: pytest.FixtureRequest, tiny_draft: Path, tiny_target: Path
               ) -> Iterator[tuple[str, Stack]]:
    args = ["--matmul", request.param]
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=args, target_args=args)
    yield request.param, stack
    stack.stop()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_the_targets_own_on_each_path(path_stack: tuple[str, Stack],
                                                       tiny_target: Path, prompt: str) -> None:
    path, stack = path_stack
    from tiny import make_tokenizer

    expected = greedy_reference(tiny_target, make_tokenizer().encode(prompt), LENGTH,
                                matmul_path=path)
    with stack.client() as client:
        plain = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=0,
                                ignore_eos=True)
        for k in (1, 4, 8):
            tokens, _ = speculated(client, prompt, LENGTH, k)  # every step drafted k
            assert tokens == expected, f"k={k} on {path}"
    assert list(plain.token_ids) == expected  # k = 0 and k > 0 agree on the same path


@pytest.mark.slow
def test_replicas_report_their_path_and_pass_times(path_stack: tuple[str, Stack]) -> None:
    path, stack = path_stack
    with grpc.insecure_channel(stack.targets[0].address) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=30).info
    assert info.matmul_path == path
    assert [p.token_count for p in info.pass_times] == list(matmul.PASS_TOKENS)
    assert all(p.pass_ms > 0 for p in info.pass_times)


def test_a_draft_may_time_int8_and_takes_it_where_cheaper(tiny_target: Path) -> None:
    model = tiny_model(tiny_target)
    path, choice = matmul.apply(model, "auto", (1, 2), repeats=2, may_quantize=True)
    assert choice is not None and all(matmul.INT8 in t for t in choice.timings.values())
    floats = sum(sum(t[choice.chosen[s]]) * s.layers for s, t in choice.timings.items())
    int8 = sum(sum(t[matmul.INT8]) * s.layers for s, t in choice.timings.items())
    assert path == (matmul.INT8 if int8 < floats else choice.summary)
    # Int8 is left to the caller to apply (the model is untouched then); else shapes are packed.
    packed = sum(isinstance(m, matmul.OneDnnLinear) for m in model.modules())
    onednn_layers = sum(s.layers for s, p in choice.chosen.items() if p == "onednn")
    assert packed == (0 if path == matmul.INT8 else onednn_layers)
    assert matmul.INT8 in choice.table()
