"""Medusa heads: numerics, the published format, the tree, training, and exact decoding in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import (
    PROMPTS,
    greedy_reference,
    make_model,
    make_tokenizer,
    random_prompts,
    verify_directly,
)
from transformers import AutoModelForCausalLM

from tandem import batching, sampling
from tandem.kv import KVSession
from tandem.model_service import Step
from tandem.models import ModelError
from target_service.candidates import NO_CANDIDATES
from target_service.medusa import (
    DEFAULT_CHOICES,
    MedusaHeads,
    MedusaProposer,
    MedusaTree,
    build_medusa,
    load_heads,
    parse_choices,
    save_heads,
)
from target_service.medusa_train import (
    TrainConfig,
    build_corpus,
    self_distill,
    top1_accuracy,
    train_heads,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    # Tiny matrices: a second intra-op thread only waits on a shared, busy CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tiny_target: Path):  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def randomized(heads: MedusaHeads, seed: int) -> MedusaHeads:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return heads


# --- Numerics ---

def test_head_is_a_resblock_then_a_projection() -> None:
    heads = randomized(MedusaHeads(num_heads=2, num_layers=1, hidden_size=8, vocab_size=11), seed=0)
    state = heads.published_state_dict()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for i in range(2):
        z = x @ state[f"{i}.0.linear.weight"].T + state[f"{i}.0.linear.bias"]
        expected = (x + z * torch.sigmoid(z)) @ state[f"{i}.1.weight"].T  # SiLU(z) = z sigmoid(z)
        torch.testing.assert_close(heads(x)[i], expected)


def test_new_heads_start_as_the_target_lm_head(model) -> None:  # type: ignore[no-untyped-def]
    heads = MedusaHeads.for_model(model, num_heads=2)
    with torch.inference_mode():
        out = model(torch.tensor([[3, 4, 5]]), output_hidden_states=True)
        logits = heads(out.hidden_states[-1][0])
    for i in range(2):  # the ResBlock starts as the identity
        torch.testing.assert_close(logits[i], out.logits[0], atol=1e-5, rtol=1e-5)


# --- The published format ---

@pytest.mark.parametrize("num_layers", [1, 2])
def test_save_load_round_trip_in_the_published_format(tmp_path: Path, num_layers: int) -> None:
    heads = randomized(MedusaHeads(3, num_layers, 8, 11, "some/base"), seed=2)
    save_heads(heads, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == num_layers
    assert config["base_model_name_or_path"] == "some/base"
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "medusa_lm_head.safetensors")))
    assert keys == {f"{i}.{j}.linear.{w}" for i in range(3) for j in range(num_layers)
                    for w in ("weight", "bias")} | {f"{i}.{num_layers}.weight" for i in range(3)}
    loaded = load_heads(str(tmp_path))
    for key, value in heads.published_state_dict().items():
        assert torch.equal(loaded.published_state_dict()[key], value)
    assert loaded.base_model_name_or_path == "some/base"


def test_loads_the_older_pt_state_dict(tmp_path: Path) -> None:
    heads = randomized(MedusaHeads(2, 1, 8, 11), seed=3)
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    torch.save(heads.published_state_dict(), tmp_path / "medusa_lm_head.pt")
    loaded = load_heads(str(tmp_path))
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), heads(x))


def test_bad_heads_are_refused_clearly(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="needs config.json"):
        load_heads(str(tmp_path))
    save_heads(MedusaHeads(2, 1, 16, model.config.vocab_size), tmp_path / "other")
    with pytest.raises(ModelError, match="hidden size 16"):
        build_medusa(str(tmp_path / "other"), "", model)


# --- The tree ---

def test_tree_from_medusa_choices() -> None:
    tree = MedusaTree.from_choices([[1, 0], [0], [0, 0, 0], [1], [0, 1], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, -1, 0, 0, 1, 2)
    assert tree.depth == 3 and tree.widths == (2, 2, 1)
    # Depth d holds head (d-1)'s top-k, whatever the parent.
    assert tree.token_ids(((10, 11), (20, 21), (30,))) == (10, 11, 20, 21, 20, 30)


def test_default_tree_is_small() -> None:
    tree = parse_choices("")
    assert tree == MedusaTree.from_choices(DEFAULT_CHOICES)
    assert len(tree.paths) == 14 and tree.depth == 3


@pytest.mark.parametrize("text, needle", [
    ("[[0], [0, 1, 2]]", "parent of each path"),
    ("[]", "non-empty"),
    ("[[0], [-1]]", ">= 0"),
    ("[[0], []]", "non-empty"),
    ("{\"a\": 1}", "JSON list of lists"),
    ("[[0]", "not JSON"),
])
def test_bad_medusa_choices(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_choices(text)


def test_tree_deeper_than_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="only 2"):
        MedusaProposer(MedusaHeads(2, 1, 8, 11), MedusaTree.from_choices([[0], [0, 0], [0, 0, 0]]))


# --- The proposer's soft state ---

def test_proposer_state_follows_the_history(model) -> None:  # type: ignore[no-untyped-def]
    proposer = MedusaProposer(MedusaHeads.for_model(model, 3), parse_choices(""))
    session = KVSession("s", vocab_size=model.config.vocab_size)
    assert proposer.get_candidates(session, [3, 4, 5]) == NO_CANDIDATES  # nothing learnt yet
    logits, hidden = batching.forward_segment(session, model, [3, 4, 5], NO_CANDIDATES.segment, True)
    proposer.update_candidate_strategy(session, NO_CANDIDATES, logits, hidden,
                                       sampling.TreeVerdict((), 7))
    candidates = proposer.get_candidates(session, [7])  # the step that commits 7 after 3 4 5
    assert len(candidates.tree_nodes) == 14
    with torch.inference_mode():
        top = torch.topk(MedusaHeads.for_model(model, 3)(hidden[0])[0], 4).indices.tolist()
    assert list(candidates.tree_token_ids[:4]) == top
    # A step that does not continue the history the heads saw proposes nothing.
    assert proposer.get_candidates(session, [7, 8]) == NO_CANDIDATES


# --- Training ---

def test_trained_heads_beat_baselines_on_held_out_text(model) -> None:  # type: ignore[no-untyped-def]
    """Heads trained on the target's own greedy text, scored on greedy text from other prompts.

    A random tiny model's text is hard to predict two or more tokens ahead, so the margins
    are modest but deterministic (seeded): every head is far above chance, and head 0 beats
    both the most frequent token's share and the untrained heads (the lm_head, which
    predicts token t+1 where token t+2 is asked).
    """
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, 320, 8, seed=0)
    texts = self_distill(model, prompts, max_new_tokens=64, temperature=0.0, seed=0, batch_size=64)
    train, test = build_corpus(model, texts[:256], 3, 64), build_corpus(model, texts[256:], 3, 64)
    torch.manual_seed(0)
    untrained = top1_accuracy(MedusaHeads.for_model(model, 3), test)
    heads = MedusaHeads.for_model(model, 3)
    losses = train_heads(heads, train, TrainConfig(epochs=3, learning_rate=1e-2))
    assert losses[-1] < losses[0]
    accuracy = top1_accuracy(heads, test)
    assert all(a > 3 / vocab for a in accuracy), accuracy
    labels = test.labels[:, 0]
    majority = float(torch.bincount(labels).max()) / len(labels)
    assert accuracy[0] > majority + 0.03, (accuracy, majority)
    assert accuracy[0] > untrained[0] + 0.03, (accuracy, untrained)
    assert sum(accuracy) > sum(untrained)


def test_self_distillation_is_the_target_greedy_text(model, tiny_target: Path) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts(model.config.vocab_size, 3, 6, seed=1)
    texts = self_distill(model, prompts, max_new_tokens=12, temperature=0.0, seed=0, batch_size=2)
    for prompt, (ids, length) in zip(prompts, texts):
        assert length == len(prompt) and ids[:length] == prompt
        assert ids[length:] == greedy_reference(tiny_target, prompt, 12)


# --- Exact decoding with the heads, in process ---

def decode(model, proposer: MedusaProposer, prompt: list[int], n: int,  # type: ignore[no-untyped-def]
           params: sampling.SamplingParams, seed: int = 0) -> tuple[list[int], int, int]:
    """The orchestrator's loop, reduced: returns (tokens, proposed, accepted)."""
    session = KVSession("s", vocab_size=model.config.vocab_size)
    history, out, proposed, accepted = [], [], 0, 0
    new = list(prompt)
    while len(out) < n:
        step = verify_directly(model, session, Step(len(history), new), proposer, params, seed + len(out))
        history += new
        new = list(step.committed_token_ids)
        out += new
        proposed += step.proposed_count
        accepted += len(new) - 1
    return out[:n], proposed, accepted


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_trained_heads_equals_target_generate(model, tiny_target: Path,  # type: ignore[no-untyped-def]
                                                          tiny_medusa: Path, prompt: str) -> None:
    proposer = build_medusa(str(tiny_medusa), "", model)
    ids = make_tokenizer().encode(prompt)
    out, proposed, accepted = decode(model, proposer, ids, 40, sampling.SamplingParams())
    assert out == greedy_reference(tiny_target, ids, 40)
    assert proposed > 0 and accepted > 0


def test_heads_for_another_model_still_give_exact_output(tiny_dir: Path, tiny_target: Path,  # type: ignore[no-untyped-def]
                                                         tiny_medusa: Path) -> None:
    """Heads that fit the shapes but not the model propose badly, never wrongly."""
    other = make_model(tiny_dir / "medusa-other", seed=21)
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    proposer = build_medusa(str(tiny_medusa), "[[0], [0, 0], [0, 0, 0]]", model)
    ids = make_tokenizer().encode(PROMPTS[0])
    out, proposed, _ = decode(model, proposer, ids, 30, sampling.SamplingParams())
    assert out == greedy_reference(other, ids, 30) and proposed > 0


def test_train_medusa_command_writes_loadable_heads(tiny_target: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                    capsys) -> None:
    from tandem.cli import main

    main(["train-medusa", "--target", str(tiny_target), "--out", str(tmp_path / "heads"),
          "--dtype", "float32", "--num-heads", "2", "--num-code", "3", "--num-prose", "2",
          "--max-new-tokens", "16", "--epochs", "1", "--threads", "1"])
    assert "wrote 2 Medusa heads" in capsys.readouterr().out
    heads = load_heads(str(tmp_path / "heads"))
    assert heads.num_heads == 2 and heads.base_model_name_or_path == str(tiny_target)


def test_train_medusa_reuses_saved_text(tiny_target: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """--texts: the first run writes the target's text, a second run on the same prompts
    trains from it without generating, and other prompts are refused rather than mixed."""
    from tandem.cli import main

    texts = tmp_path / "texts.json"
    args = ["train-medusa", "--target", str(tiny_target), "--dtype", "float32", "--num-heads", "2",
            "--num-code", "2", "--num-prose", "1", "--max-new-tokens", "8", "--epochs", "1",
            "--threads", "1", "--texts", str(texts)]
    main(args + ["--text-only"])
    assert "text for 3 prompts" in capsys.readouterr().out and not (tmp_path / "a").exists()
    saved = json.loads(texts.read_text())
    assert len(saved["texts"]) == 3 and len(saved["prompts"]) == 3
    written = texts.stat().st_mtime_ns
    main(args + ["--out", str(tmp_path / "a")])
    first = capsys.readouterr().out
    assert texts.stat().st_mtime_ns == written  # read, not written again
    main(args + ["--out", str(tmp_path / "b")])
    assert capsys.readouterr().out.split("(")[1] == first.split("(")[1]  # same rows, same accuracy
    for a, b in zip(load_heads(str(tmp_path / "a")).state_dict().values(),
                    load_heads(str(tmp_path / "b")).state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="other prompts"):
        main(["train-medusa", "--target", str(tiny_target), "--out", str(tmp_path / "c"),
              "--num-code", "1", "--num-prose", "1", "--texts", str(texts)])
