"""`tandem train-medusa`: Medusa-1 heads by self-distillation (Cai et al. 2024, arXiv 2401.10774).

The backbone stays frozen. The target writes its own training text (continuations of
prompts), so the heads learn the target's behaviour rather than a dataset's: at each
position t of that text, with h_t the last hidden state, head i is trained with
cross-entropy to predict token t+i+2, and the heads' losses are summed with weights
decay**i (the paper's lambda_k; later heads are harder and weigh less).

Head projections start from the target's lm_head and the ResBlocks from the identity, as
in the paper; --freeze-projection trains the ResBlocks only, far cheaper on a CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.prompts import humaneval
from tandem import models
from tandem.lm import CausalLM
from tandem.server import configure_logging
from target_service.medusa import MedusaHeads, save_heads

log = logging.getLogger(__name__)

IGNORE = -100  # a label past the end of the text: no loss

# Prose prompts of our own, apart from bench/prompts.py's (which the benchmark measures).
TRAINING_PROSE = (
    "Explain how a hash map works and why lookups are fast on average.",
    "Write a short story about a robot learning to paint.",
    "Describe the steps to bake a loaf of bread at home.",
    "What is the difference between a process and a thread?",
    "Write a letter to a friend describing a recent trip to the mountains.",
    "Explain recursion to a beginner programmer, with an example.",
    "Summarize the plot of a detective novel you invent.",
    "Give advice for preparing for a job interview as a software engineer.",
    "Describe how vaccines train the immune system.",
    "Explain what version control is and why teams use git.",
    "Write a product description for a reusable water bottle.",
    "Explain how public key cryptography lets two strangers share a secret.",
)
#: The benchmark measures the first HumanEval prompts; training starts after them.
BENCH_CODE_PROMPTS = 20


@dataclass(frozen=True)
class TrainConfig:
    num_heads: int = 3
    num_layers: int = 1
    max_new_tokens: int = 256
    temperature: float = 0.0  # of the self-distillation text; 0: the target's greedy text
    epochs: int = 2
    learning_rate: float = 1e-3
    batch_size: int = 64  # positions per optimiser step
    generate_batch_size: int = 8  # prompts of equal length written at once
    head_decay: float = 0.8
    freeze_projection: bool = False
    held_out: float = 0.1  # share of the texts kept for the accuracy report
    seed: int = 0


@dataclass(frozen=True)
class Corpus:
    """Training rows: the frozen target's hidden state at a position and what each head should say."""

    hidden: torch.Tensor  # [n, h] float32
    labels: torch.Tensor  # [n, K] token t+i+2 for head i; IGNORE past the end


@dataclass(frozen=True)
class TrainReport:
    epoch_losses: tuple[float, ...]
    train_accuracy: tuple[float, ...]  # top-1 per head
    held_out_accuracy: tuple[float, ...]  # top-1 per head; empty without held-out texts
    num_train_rows: int
    num_held_out_rows: int


def self_distill(model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float, seed: int, batch_size: int = 8,
                 progress: Callable[[int], None] | None = None) -> list[tuple[list[int], int]]:
    """The target's own continuation of each prompt: (prompt + continuation, prompt length).

    Prompts of equal length run as one batch (no padding, so each row is what the target
    writes alone); a continuation ends after its first EOS.
    """
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    sampled = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_ids) or None,
        pad_token_id=min(eos_ids, default=0), **sampled)
    torch.manual_seed(seed)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    texts: dict[int, tuple[list[int], int]] = {}
    with torch.inference_mode():
        for length, members in sorted(by_length.items()):
            for start in range(0, len(members), batch_size):
                batch = members[start:start + batch_size]
                ids = torch.tensor([list(prompts[i]) for i in batch], device=device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                for i, row in zip(batch, out.tolist()):
                    stop = next((j + 1 for j in range(length, len(row)) if row[j] in eos_ids), len(row))
                    texts[i] = (row[:stop], length)
                if progress:
                    progress(len(texts))
    return [texts[i] for i in range(len(prompts))]


def build_corpus(model: CausalLM, texts: Sequence[tuple[list[int], int]], num_heads: int,
                 batch_size: int = 8, progress: Callable[[int], None] | None = None) -> Corpus:
    """Rows from the last prompt position on (the first tree grows from there) to the last
    position with a label for head 0. Texts of equal length run as one batch."""
    device = model.get_input_embeddings().weight.device
    by_length: dict[int, list[tuple[list[int], int]]] = {}
    for ids, prompt_length in texts:
        if len(ids) - 2 > prompt_length - 1:
            by_length.setdefault(len(ids), []).append((ids, prompt_length))
    hidden, labels = [], []
    with torch.inference_mode():
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                batch = group[start:start + batch_size]
                out = model(input_ids=torch.tensor([ids for ids, _ in batch], device=device),
                            output_hidden_states=True)
                # The last hidden state is after the final norm: what lm_head and the heads read.
                last = out.hidden_states[-1].float().cpu()
                for row, (ids, prompt_length) in enumerate(batch):
                    positions = torch.arange(prompt_length - 1, len(ids) - 2)
                    hidden.append(last[row, positions])
                    padded = torch.tensor(ids + [IGNORE] * num_heads)
                    labels.append(torch.stack([padded[positions + i + 2] for i in range(num_heads)], 1))
                if progress:
                    progress(len(hidden))
    if not hidden:
        raise ValueError("no training text: every continuation was shorter than 2 tokens")
    return Corpus(torch.cat(hidden), torch.cat(labels))


def head_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float) -> torch.Tensor:
    """sum_i decay**i * CE(head i): logits [K, n, vocab], labels [n, K]."""
    total = logits.new_zeros(())
    for i in range(logits.shape[0]):
        if (labels[:, i] != IGNORE).any():
            total = total + decay**i * torch.nn.functional.cross_entropy(
                logits[i], labels[:, i], ignore_index=IGNORE)
    return total


def top1_accuracy(heads: MedusaHeads, corpus: Corpus, batch_size: int = 256) -> tuple[float, ...]:
    """Per head, the share of labelled rows whose top-1 is the label."""
    hits = torch.zeros(heads.num_heads)
    counts = torch.zeros(heads.num_heads)
    with torch.inference_mode():
        for start in range(0, len(corpus.hidden), batch_size):
            logits = heads(corpus.hidden[start:start + batch_size])  # [K, b, vocab]
            labels = corpus.labels[start:start + batch_size].T  # [K, b]
            known = labels != IGNORE
            hits += ((logits.argmax(-1) == labels) & known).sum(-1)
            counts += known.sum(-1)
    return tuple((hits / counts.clamp_min(1)).tolist())


def train_heads(heads: MedusaHeads, corpus: Corpus, config: TrainConfig,
                progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Adam over shuffled rows; returns the mean loss of each epoch."""
    if config.freeze_projection:
        for projection in heads.projections():
            projection.weight.requires_grad_(False)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    n = len(corpus.hidden)
    steps = config.epochs * math.ceil(n / config.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))  # cosine to 0
    heads.train()
    losses = []
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, config.batch_size):
            rows = order[start:start + config.batch_size]
            loss = head_loss(heads(corpus.hidden[rows]), corpus.labels[rows], config.head_decay)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            schedule.step()
            total += float(loss.detach()) * len(rows)
        losses.append(total / n)
        if progress:
            progress(epoch, losses[-1])
    heads.eval()
    return losses


def train_medusa(model: CausalLM, prompts: Sequence[Sequence[int]], config: TrainConfig,
                 base_model_name_or_path: str = "", texts_path: str | None = None,
                 ) -> tuple[MedusaHeads, TrainReport]:
    """Generate the self-distillation text, hold some out, train the heads, report accuracy.

    With `texts_path`, the text is read from there if the file exists, else written there
    once generated: the expensive half of a run is then paid once.
    """
    started = time.perf_counter()
    texts = distilled_texts(model, prompts, config, texts_path)
    held = int(len(texts) * config.held_out) if len(texts) > 1 else 0

    def read(done: int) -> None:
        log.info("read the target's hidden states for %d/%d training texts (%.0fs)", done,
                 len(texts) - held, time.perf_counter() - started)

    train = build_corpus(model, texts[:len(texts) - held], config.num_heads,
                         config.generate_batch_size, read)
    test = build_corpus(model, texts[len(texts) - held:], config.num_heads,
                        config.generate_batch_size) if held else None
    torch.manual_seed(config.seed)
    heads = MedusaHeads.for_model(model, config.num_heads, config.num_layers, base_model_name_or_path)
    losses = train_heads(heads, train, config, lambda e, loss: log.info(
        "epoch %d/%d: loss %.4f (%.0fs)", e + 1, config.epochs, loss, time.perf_counter() - started))
    report = TrainReport(tuple(losses), top1_accuracy(heads, train),
                         top1_accuracy(heads, test) if test else (), len(train.hidden),
                         len(test.hidden) if test else 0)
    return heads, report


def distilled_texts(model: CausalLM, prompts: Sequence[Sequence[int]], config: TrainConfig,
                    texts_path: str | None = None) -> list[tuple[list[int], int]]:
    """The target's text for each prompt: read from `texts_path` if it holds some, else
    written by the target (and saved there)."""
    texts = load_texts(texts_path, prompts) if texts_path else None
    if texts is None:
        started = time.perf_counter()
        texts = self_distill(model, prompts, config.max_new_tokens, config.temperature,
                             config.seed, config.generate_batch_size,
                             lambda done: log.info("generated %d/%d texts (%.0fs)", done,
                                                   len(prompts), time.perf_counter() - started))
        if texts_path:
            Path(texts_path).write_text(json.dumps(
                {"prompts": [list(p) for p in prompts], "texts": texts}))
    return texts


def load_texts(path: str, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], int]] | None:
    """Texts saved by an earlier run on the same prompts; None if there are none."""
    if not Path(path).exists():
        return None
    saved = json.loads(Path(path).read_text())
    if saved["prompts"] != [list(p) for p in prompts]:
        raise ValueError(f"{path} holds text for other prompts; delete it or pass another --texts")
    log.info("read %d self-distillation texts from %s", len(saved["texts"]), path)
    return [(list(ids), int(length)) for ids, length in saved["texts"]]


def training_prompts(num_code: int, num_prose: int) -> list[str]:
    """HumanEval prompts after the benchmark's, then our own prose."""
    code = [p.text for p in humaneval(BENCH_CODE_PROMPTS + num_code)[BENCH_CODE_PROMPTS:]]
    return code + list(TRAINING_PROSE[:num_prose])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--target", required=True, help="the target model (path, hub id or built-in)")
    parser.add_argument("--out", default="", help="directory to write the heads to")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the target's dtype while it writes text; also the saved heads' dtype")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--num-heads", type=int, default=d.num_heads)
    parser.add_argument("--num-layers", type=int, default=d.num_layers, help="ResBlocks per head")
    parser.add_argument("--num-code", type=int, default=100,
                        help=f"HumanEval prompts (after the benchmark's first {BENCH_CODE_PROMPTS})")
    parser.add_argument("--num-prose", type=int, default=len(TRAINING_PROSE))
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="of the target's self-distillation text (0: greedy)")
    parser.add_argument("--epochs", type=int, default=d.epochs)
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--generate-batch-size", type=int, default=d.generate_batch_size,
                        help="prompts of equal length the target continues at once")
    parser.add_argument("--head-decay", type=float, default=d.head_decay,
                        help="loss weight of head i is decay**i")
    parser.add_argument("--freeze-projection", action="store_true",
                        help="train the ResBlocks only; projections stay the target's lm_head")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--texts", default=None,
                        help="JSON file for the self-distillation text: read if it exists "
                             "(same prompts), else written once generated")
    parser.add_argument("--text-only", action="store_true",
                        help="only write the self-distillation text to --texts, then stop (e.g. "
                             "write it in bfloat16, then train with --dtype float32)")


def main(args: argparse.Namespace) -> None:
    if args.text_only and not args.texts:
        raise SystemExit("--text-only needs --texts FILE to write the text to")
    if not args.text_only and not args.out:
        raise SystemExit("--out is required: the directory to write the heads to")
    configure_logging("INFO")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = TrainConfig(
        num_heads=args.num_heads, num_layers=args.num_layers, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, epochs=args.epochs, learning_rate=args.learning_rate,
        batch_size=args.batch_size, generate_batch_size=args.generate_batch_size,
        head_decay=args.head_decay, freeze_projection=args.freeze_projection, seed=args.seed)
    model = models.load_model(args.target, models.Placement(args.device, args.dtype))
    tokenizer = models.load_tokenizer(args.target)
    prompts = [tokenizer.encode(p) for p in training_prompts(args.num_code, args.num_prose)]
    if args.text_only:
        texts = distilled_texts(model, prompts, config, args.texts)
        print(f"wrote the target's text for {len(texts)} prompts to {args.texts}")
        return
    heads, report = train_medusa(model, prompts, config, args.target, args.texts)
    out = save_heads(heads, args.out, models.torch_dtype(args.dtype))
    accuracy = report.held_out_accuracy or report.train_accuracy
    print(f"wrote {config.num_heads} Medusa heads to {out} ({report.num_train_rows} training rows); "
          f"top-1 per head on {'held-out' if report.held_out_accuracy else 'training'} text: "
          + ", ".join(f"{a:.1%}" for a in accuracy))
