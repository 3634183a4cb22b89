"""`tandem bench-load --conversations`: multi-turn traffic with the prefix cache on and off.

Each conversation is a system prompt (two chat ones that many conversations share, and an
agent one that carries a source file), then turns: a user message, the reply, the next
message. An agent's later turns send the file back with one line changed, as a tool's output
would. Every turn sends the whole conversation so far (chat-templated with the target's
tokenizer), as an OpenAI client does; clients run conversations concurrently, each turn after
the reply to the one before.

For each mode (`on`, `off`: both replicas' --prefix-cache) and each client count it starts a
fresh stack and reports the time to first token of first turns and of later turns (medians),
tokens per second over the whole run, and the share of later turns' prompt tokens the target
and the draft took from their prefix caches (the usage's cached tokens), per replica pool.
Greedy requests: a later turn's reply must be the same in both modes (checked, and reported).

With `--duration` it is a soak instead: one stack, the prefix cache on, conversations going
round (each round's histories new after the system prompts, so entries keep coming and going)
for that long, every process sampled as `tandem bench-load --duration` samples it (bench/soak.py:
memory, descriptors, threads, streams, the tokens each prefix cache holds) and the slopes per
hour reported. It fails on growth past the soak's slack, on a prefix cache past
`--prefix-cache-tokens`, or on a failed turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench import soak
from bench.prompts import CODE, PROSE
from bench.tiny import make_pair
from tandem import models
from tandem.launch import Stack, start_stack
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import orchestrator_pb2, orchestrator_pb2_grpc

# Two system prompts of about 450 tokens each (on the built-in pair's tokenizer).
CHAT_SYSTEM = [
    "You are a patient assistant for a team of engineers. Questions they asked before:\n"
    + "\n".join(PROSE) + "\nCode they work on:\n" + "".join(CODE[:5]) + "Answer briefly.",
    "You review Python code for a living. Prefer small, readable functions. Code under review:\n"
    + "".join(CODE[3:8]) + "\nQuestions the team asked before:\n" + "\n".join(PROSE[::-1]),
]
FOLLOW_UPS = ["Can you say that again in fewer words?", "Now give an example.",
              "What would you change about it?", "Thanks. One more detail, please."]


@dataclass(frozen=True)
class Conversation:
    system: str
    messages: tuple[str, ...]  # the user's messages (an agent's: tool outputs), one per turn


def conversations(count: int, turns: int, chars: int = 0, round_: int = 0) -> list[Conversation]:
    """Chats over two shared system prompts, and every third an agent loop over a file; with
    `chars`, each text cut to that many characters (a tiny model's short context); a `round_`
    past 0 opens each first message with its number (new histories under the same prompts)."""
    def cut(text: str) -> str:
        return text[:chars] if chars else text

    if round_:
        return [Conversation(c.system, (cut(f"({round_}) {c.messages[0]}"), *c.messages[1:]))
                for c in conversations(count, turns, chars)]

    out = []
    for c in range(count):
        if c % 3 == 2:
            source = "".join(CODE[:4])
            lines = source.splitlines()
            edits = []
            for t in range(turns):
                changed = list(lines)
                changed[(3 * t + c) % len(changed)] += f"  # edited in step {t}"
                edits.append("Tool output (the file after the edit):\n" + "\n".join(changed))
            out.append(Conversation(cut("You are a coding agent. Here is the file you work on:\n" + source),
                                    tuple(cut(e) for e in edits)))
        else:
            first = PROSE[c % len(PROSE)]
            out.append(Conversation(cut(CHAT_SYSTEM[c % 2]), tuple(cut(m) for m in (first, *FOLLOW_UPS[:turns - 1]))))
    return out


def render(tokenizer: Any, system: str, turns: list[tuple[str, str]], message: str) -> str:
    """The conversation so far, then `message`, as the target's chat template writes it."""
    messages = [{"role": "system", "content": system}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": message})
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    completion_tokens: int
    target_cached: int
    draft_cached: int
    text: str


async def run_conversations(address: str, tokenizer: Any, convs: Sequence[Conversation], clients: int,
                            max_new_tokens: int, stop: threading.Event | None = None
                            ) -> tuple[list[TurnResult], float]:
    """Every conversation, `clients` at a time; with `stop`, no conversation starts once set."""
    queue = list(enumerate(convs))
    results: list[TurnResult] = []

    async def client() -> None:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while queue and not (stop is not None and stop.is_set()):
                index, conv = queue.pop(0)
                history: list[tuple[str, str]] = []
                for t, message in enumerate(conv.messages):
                    prompt = render(tokenizer, conv.system, history, message)
                    started = time.perf_counter()
                    ttft, text, usage = 0.0, "", None
                    request = orchestrator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens)
                    async for reply in stub.Generate(request, timeout=1800):
                        if reply.HasField("delta"):
                            ttft = ttft or time.perf_counter() - started
                            text += reply.delta.text
                        else:
                            usage = reply.summary.usage
                    assert usage is not None
                    results.append(TurnResult(index, t, usage.prompt_tokens, ttft, time.perf_counter() - started,
                                              usage.completion_tokens, usage.target_cached_tokens,
                                              usage.draft_cached_tokens, text))
                    history.append((message, text))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - started


@dataclass
class ModeReport:
    mode: str
    clients: int
    first_turn_ttft_s: float
    later_turn_ttft_s: float
    tokens_per_s: float
    target_reuse: float  # later turns' cached target tokens / their prompt tokens
    draft_reuse: float
    later_turns_covering_80: float  # later turns whose cached tokens cover 80% of the turn before
    turns: list[TurnResult] = field(default_factory=list)


def summarize(mode: str, clients: int, results: list[TurnResult], wall_s: float) -> ModeReport:
    first = [r for r in results if r.turn == 0]
    later = [r for r in results if r.turn > 0]
    by_key = {(r.conversation, r.turn): r for r in results}
    covering = [r.target_cached >= 0.8 * by_key[(r.conversation, r.turn - 1)].prompt_tokens for r in later]
    prompt = sum(r.prompt_tokens for r in later) or 1
    return ModeReport(mode, clients, statistics.median(r.ttft_s for r in first),
                      statistics.median(r.ttft_s for r in later) if later else 0.0,
                      sum(r.completion_tokens for r in results) / wall_s,
                      sum(r.target_cached for r in later) / prompt, sum(r.draft_cached for r in later) / prompt,
                      sum(covering) / len(covering) if covering else 0.0, results)


def soak_conversations(stack: Stack, tokenizer: Any, args: argparse.Namespace, chars: int,
                       samples: list[soak.Sample]) -> tuple[int, list[str]]:
    """Conversations round and round for args.duration, sampled every args.sample_every;
    the turns served and what failed."""
    stop, turns, failures = threading.Event(), [0], []
    clients = int(args.clients.split(",")[0])

    def load() -> None:
        round_ = 0
        while not stop.is_set():
            round_ += 1
            convs = conversations(args.count, args.turns, chars, round_)
            try:
                results, _ = asyncio.run(run_conversations(stack.address, tokenizer, convs, clients,
                                                           args.max_new_tokens, stop))
            except Exception as exc:  # noqa: BLE001 - reported, and the soak fails
                failures.append(f"round {round_}: {exc!r}")
                return
            turns[0] += len(results)

    loader = threading.Thread(target=load, name="conversations", daemon=True)
    started = time.monotonic()
    loader.start()
    while time.monotonic() - started < args.duration and loader.is_alive():
        time.sleep(max(0.0, started + (len(samples) + 1) * args.sample_every - time.monotonic()))
        samples.append(soak.sample(stack, started, turns[0]))
    stop.set()
    loader.join()
    budget = args.prefix_cache_tokens
    for s in samples:
        for name, figures in s.figures.items():
            if budget and figures["prefix_tokens"] > budget:
                failures.append(f"{name}: its prefix cache held {figures['prefix_tokens']:.0f} tokens, "
                                f"past --prefix-cache-tokens {budget}")
    return turns[0], failures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load --conversations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--draft", default="", help="draft model (default: a tiny random one; "
                        "'none': the target alone)")
    parser.add_argument("--target", default="", help="target model (default: a tiny random one)")
    parser.add_argument("--count", type=int, default=6, help="conversations per run")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts")
    parser.add_argument("--modes", default="on,off", help="prefix cache modes to run: on, off")
    parser.add_argument("--replicas", default="1,1", help="drafts,targets behind the orchestrator")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="threads per service (0: all)")
    parser.add_argument("--draft-args", default="", help="extra draft-service flags")
    parser.add_argument("--target-args", default="", help="extra target-service flags")
    parser.add_argument("--json", default="", help="write the report here")
    parser.add_argument("--duration", type=soak.seconds, default=0.0,
                        help="soak this long instead (90s, 30m, 1h): the cache on, the first --clients")
    parser.add_argument("--sample-every", type=soak.seconds, default=60.0, help="the soak's sampling interval")
    parser.add_argument("--prefix-cache-tokens", type=int, default=0,
                        help="both replicas' --prefix-cache-tokens (0: their default)")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    draft, target = args.draft, args.target
    if not target:  # the tiny pair: a character per token in a context of 512
        pair = make_pair(Path(tmp.name))
        draft, target = draft or str(pair[0]), str(pair[1])
    tokenizer = models.load_tokenizer(target)
    drafts, targets = (int(n) for n in args.replicas.split(","))
    chars = 0 if args.target else 90
    convs = conversations(args.count, args.turns, chars)
    sized = ["--prefix-cache-tokens", str(args.prefix_cache_tokens)] if args.prefix_cache_tokens else []

    def stack_with(flags: list[str], orchestrator_args: Sequence[str] = ()) -> Stack:
        """A stack of the replicas asked for, each with `flags` on both tiers."""
        return start_stack(None if draft == "none" else draft, target, num_drafts=drafts, num_targets=targets,
                           threads=args.threads, draft_dtype="auto", target_dtype="auto",
                           draft_args=[*flags, *args.draft_args.split()],
                           target_args=[*flags, *args.target_args.split()], orchestrator_args=orchestrator_args)

    if args.duration:
        metrics = ["--metrics-port", "0"]
        soaked = stack_with([*metrics, *sized], orchestrator_args=metrics)
        samples: list[soak.Sample] = []
        try:
            served, failures = soak_conversations(soaked, tokenizer, args, chars, samples)
        finally:
            soaked.stop()
        print(soak.table(samples))
        problems = failures + soak.growth(samples)
        print(f"{served} turns in {args.duration / 60:.1f} min")
        for problem in problems[:20]:
            print(f"FAIL {problem}", file=sys.stderr)
        path = Path(args.json or f"bench/results/conversation-soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"argv": sys.argv, "turns": served, "samples": [asdict(s) for s in samples],
                                    "trends": soak.trends(samples), "problems": problems}, indent=1, default=str))
        print(f"wrote {path}")
        tmp.cleanup()
        sys.exit(1 if problems else 0)
    reports: list[ModeReport] = []
    replies: dict[str, dict[tuple[int, int], str]] = {}
    for mode in args.modes.split(","):
        for clients in (int(c) for c in args.clients.split(",")):
            stack = stack_with(["--prefix-cache", mode, *sized])
            try:
                results, wall = asyncio.run(run_conversations(stack.address, tokenizer, convs, clients,
                                                              args.max_new_tokens))
            finally:
                stack.stop()
            report = summarize(mode, clients, results, wall)
            reports.append(report)
            replies[f"{mode}/{clients}"] = {(r.conversation, r.turn): r.text for r in results}
            print(f"prefix cache {mode}, {clients} clients: TTFT first turns {report.first_turn_ttft_s:.2f} s, "
                  f"later turns {report.later_turn_ttft_s:.2f} s; {report.tokens_per_s:.2f} tokens/s; "
                  f"later turns' prompt tokens cached: target {report.target_reuse:.0%}, draft "
                  f"{report.draft_reuse:.0%}; later turns reusing 80% of the turn before: "
                  f"{report.later_turns_covering_80:.0%}", flush=True)
    runs = list(replies.values())
    same = all(run == runs[0] for run in runs[1:])
    print("replies: " + ("the same in every mode and at every client count" if same else "DIFFER between runs"))
    path = Path(args.json or f"bench/results/conversations-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"argv": sys.argv, "same_replies": same,
                                "reports": [asdict(r) for r in reports]}, indent=1, default=str))
    print(f"wrote {path}")
    tmp.cleanup()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
