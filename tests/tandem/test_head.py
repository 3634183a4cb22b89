"""The head read in slices of the vocabulary (tandem.head): a greedy pass's argmax is the
whole head's, ties and NaN included; the model's logits are unchanged where it is installed,
and a model whose logits are not its head's product keeps its head whole."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from tandem import batching, head, host, matmul
from tandem.batching import Pass, PassOutput, Reads
from tandem.head import VocabChunks
from tandem.kv import KVSession

VOCAB = 40
TOLERANCE = 1e-5
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "initializer_range": 0.3}


def sliced(layer: nn.Linear, rows: int, width: int) -> VocabChunks:
    """The head read in slices of `width` vocabulary rows for a pass of `rows` rows."""
    chunks = VocabChunks(layer, rows * width * layer.weight.element_size())
    assert chunks.slices(rows)[1] == width
    return chunks


def linear(vocab: int = 1000, hidden: int = 16, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(hidden, vocab, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_the_sliced_argmax_is_the_whole_heads(bias: bool) -> None:
    layer = linear(bias=bias)
    chunks = sliced(layer, 9, 128)  # 1000 rows: 7 whole slices and a tail of 104
    x = torch.randn(9, 16)
    with torch.inference_mode():
        whole = layer(x)
        assert torch.allclose(chunks(x), whole, atol=TOLERANCE)
        assert torch.equal(chunks.argmax(x), chunks(x).argmax(-1))
        assert torch.equal(chunks.argmax(x), whole.argmax(-1))
    assert chunks.slices(1) == [0]  # one row's logits over 1000 ids fit in one slice: the plain product


def test_ties_go_to_the_lowest_id_across_slices_and_within_one() -> None:
    layer = linear()
    with torch.no_grad():
        layer.weight[700] = layer.weight[5] = 10.0  # the same largest row in slices 0 and 5
        layer.weight[131] = layer.weight[129] = -10.0  # and, for -x, a pair inside slice 1
    chunks = sliced(layer, 2, 128)
    x = torch.stack([torch.ones(16), -torch.ones(16)])
    with torch.inference_mode():
        assert chunks.argmax(x).tolist() == [5, 129] == layer(x).argmax(-1).tolist()


def test_a_nan_wins_as_in_torchs_argmax() -> None:
    layer = linear()
    with torch.no_grad():
        layer.weight[300, 0] = float("nan")  # logit 300 is NaN in every row, in slice 2
    chunks = sliced(layer, 2, 128)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        assert chunks.argmax(x).tolist() == [300, 300] == layer(x).argmax(-1).tolist()


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    batching.use_batched_attention(model)
    return model


def full_pass(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_installed_it_reads_the_models_own_head_and_leaves_the_model_as_it_is() -> None:
    model = llama()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    before, weight = full_pass(model, ids), model.get_output_embeddings().weight
    installed = head.install(model, 64)
    assert isinstance(installed, VocabChunks) and installed.head is model.get_output_embeddings()
    assert model.get_output_embeddings().weight is weight
    assert len(installed.slices(len(ids))) == 20  # 2 ids a slice: 64 bytes of 8 rows' logits
    assert torch.equal(full_pass(model, ids), before)


def test_a_model_whose_logits_are_not_its_heads_product_keeps_its_head(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    config = Gemma2Config(**{**SMALL, "head_dim": 8}, final_logit_softcapping=0.5)  # tanh-capped logits
    model = Gemma2ForCausalLM(config).eval()
    with caplog.at_level(logging.INFO, logger="tandem.head"):
        assert head.install(model, 64) is None
    assert "softcapped or scaled" in caplog.text
    assert type(model.get_output_embeddings()) is nn.Linear


@pytest.mark.skipif(not matmul.onednn_available(), reason="this torch has no oneDNN")
def test_a_head_packed_by_onednn_is_read_whole() -> None:
    model = llama()
    matmul.pack(model)
    assert "not a plain Linear" in str(head.refusal(model))
    assert head.install(model, 64) is None


def test_a_vocabulary_smaller_than_the_probe_is_probed_all_the_same() -> None:
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": 5})).eval()
    assert isinstance(head.install(model, 64), VocabChunks)


def read_best(out: PassOutput) -> list[int]:
    assert out.best is not None
    return host.values(out.best)


def test_greedy_passes_read_the_argmax_alone_alone_or_batched() -> None:
    model = llama()
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [1, 6, 1]]
    installed = head.install(model, 64)
    runner = batching.TorchRunner(model, head=installed)
    sessions = [KVSession(f"s{i}", VOCAB) for i in range(3)]
    for s, p in zip(sessions, prompts, strict=True):
        runner.single(Pass(s, 0, tuple(p[:-2])))
    clock = host.begin()
    alone = runner.single(Pass(sessions[0], 3, (1, 5, 9), logits_to_keep=3, reads=Reads(argmax=True), reduce=read_best))
    split = clock.split()
    want = full_pass(model, [3, 1, 4, 1, 5, 9])
    assert alone.logits is None and alone.value == want[-3:].argmax(-1).tolist()
    assert split.host_bytes == 3 * 8  # three ids, no row of logits
    # Batched: a greedy pass beside a sampled one; then beside one that wants hidden states
    # (the model's own forward then, the argmax read from its logits).
    for wants_hidden in (False, True):
        for s, p in zip(sessions[1:], prompts[1:], strict=True):
            s.rollback(len(p) - 2)
        outs = runner.batched([Pass(sessions[1], 2, (1, 8), logits_to_keep=2, reads=Reads(argmax=True), reduce=read_best),
                               Pass(sessions[2], 1, (6, 1), logits_to_keep=2, with_hidden=wants_hidden)], ())
        greedy_want, sampled_want = full_pass(model, prompts[1])[-2:], full_pass(model, prompts[2])[-2:]
        assert outs[0].value == greedy_want.argmax(-1).tolist()
        assert (outs[0].logits is None) != wants_hidden
        assert outs[1].logits is not None and torch.allclose(outs[1].logits, sampled_want, atol=1e-4)
