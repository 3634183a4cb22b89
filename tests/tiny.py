"""The tiny random models live in bench/tiny.py, shared with `tandem bench-load`; Medusa heads for them here."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from bench.tiny import (
    DEFAULT_CHARS,
    EOS,
    PROMPTS,
    greedy_reference,
    make_draft_like,
    make_gguf,
    make_model,
    make_tokenizer,
)
from tandem.client import TandemClient
from tandem.v1 import common_pb2, orchestrator_pb2

__all__ = [
    "DEFAULT_CHARS",
    "EOS",
    "PROMPTS",
    "greedy_reference",
    "last_logits",
    "make_draft_like",
    "make_gguf",
    "make_medusa_heads",
    "make_model",
    "make_tokenizer",
    "noisy_copy",
    "random_prompts",
    "save_family",
    "speculated",
    "verify_directly",
]


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Prompts of ordinary tokens (ids 2.. : no EOS, no unk), all of one length so they batch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (count, length), generator=generator).tolist()  # type: ignore[no-any-return]


def make_medusa_heads(target: Path, path: Path, *, seed: int = 0, num_heads: int = 3,
                      temperature: float = 0.0, num_prompts: int = 320, max_new_tokens: int = 64,
                      epochs: int = 3) -> Path:
    """Medusa heads for a tiny target, trained on its own text (EOS ignored): seconds on a CPU."""
    from target_service.medusa import save_heads
    from target_service.medusa_train import TrainConfig, train_medusa

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    prompts = random_prompts(model.config.vocab_size, num_prompts, 8, seed)
    config = TrainConfig(num_heads=num_heads, max_new_tokens=max_new_tokens, temperature=temperature,
                         epochs=epochs, learning_rate=1e-2, generate_batch_size=64, held_out=0.0,
                         seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a busy CPU
    try:
        heads, _ = train_medusa(model, prompts, config, str(target))
    finally:
        torch.set_num_threads(threads)
    return save_heads(heads, path)


def last_logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's logits after `ids`, from one plain full pass (the reference for cached passes)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def save_family(path: Path, model_class: type[PreTrainedModel], config_class: type[PretrainedConfig],
                seed: int, **extra: object) -> Path:
    """A tiny random model of one family with the tests' character tokenizer, saved at `path`."""
    tokenizer = make_tokenizer()
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None,
        pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def noisy_copy(target: Path, path: Path, seed: int) -> Path:
    """The target plus weight noise, same family: a draft that agrees with it often, not always."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def verify_directly(model, session, step, proposer, params, seed):  # type: ignore[no-untyped-def]
    """`propose_and_verify` on a model in process: its pass runs at once (no scheduler)."""
    import asyncio

    from tandem import batching, models
    from target_service.scorer import propose_and_verify

    return asyncio.run(propose_and_verify(batching.direct(model), session, step, proposer, params, seed,
                                          models.exact_positions(model)))


def speculated(client: TandemClient, prompt: str | list[int], length: int, k: int,
               **fields: object) -> tuple[list[int], orchestrator_pb2.Usage]:
    """A greedy request of `length` tokens at a fixed k, streamed, and its usage.

    Asserts that it was speculation all the way: the draft model ran it, and
    every step after the prefill drafted its k (min(k, tokens left - 1)). Exact output alone
    cannot tell that apart from a draft that fell back, or drafted less, and the target
    decoding alone."""
    tokens: list[int] = []
    drafts_expected = 0
    usage: orchestrator_pb2.Usage | None = None
    with client.generate_stream(prompt, max_new_tokens=length, num_speculative_tokens=k,
                                ignore_eos=True, **fields) as stream:  # type: ignore[arg-type]
        for message in stream:
            if message.HasField("summary"):
                usage = message.summary.usage
            elif message.delta.token_ids:
                if tokens:  # not the prefill, which drafts nothing
                    drafts_expected += min(k, length - len(tokens) - 1)
                tokens += message.delta.token_ids
    assert usage is not None, "no summary"
    assert usage.proposer == common_pb2.PROPOSER_DRAFT_MODEL, \
        f"ran with {common_pb2.Proposer.Name(usage.proposer)}"
    assert len(tokens) == usage.completion_tokens == length
    assert usage.drafted_tokens == drafts_expected, (usage.drafted_tokens, drafts_expected)
    assert usage.completion_tokens == usage.accepted_tokens + usage.target_forward_passes
    return tokens, usage
