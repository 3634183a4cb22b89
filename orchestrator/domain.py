"""The orchestrator's domain: requests, events, usage, model info, the proposer registry, and
what a step sends to the target and gets back.

No protos here: orchestrator/wire.py converts. The engine (orchestrator/engine.py) takes a
GenerationRequest and yields Delta events and one Summary; gRPC and HTTP are adapters.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from tandem import sampling
from tandem.grammar import GrammarSpec
from tandem.split import NO_SPLIT, PassSplit


@dataclass(frozen=True)
class ProposerSpec:
    """One way of proposing tokens for the target to verify."""

    name: str  # in flags, requests and usage; on gRPC the enum value PROPOSER_<NAME>
    runs_on: str  # "orchestrator", "draft" (a draft replica) or "target" (in its own pass)
    needs: str  # what a deployment must run to offer it


#: Every proposer. Adding one: an entry here, the proposer itself, and its proto enum value.
REGISTRY: dict[str, ProposerSpec] = {spec.name: spec for spec in (
    ProposerSpec("none", "orchestrator", "nothing: the target decodes alone"),
    ProposerSpec("draft-model", "draft", "draft replicas (--draft or --draft-service-name)"),
    ProposerSpec("prompt-lookup", "orchestrator", "nothing: n-grams of the request's own history"),
    ProposerSpec("lookahead", "target", "targets that offer it (--lookahead, on by default)"),
    ProposerSpec("medusa", "target", "targets started with --medusa-heads"),
    ProposerSpec("suffix", "orchestrator", "nothing: the request's own tokens and recent outputs"),
    ProposerSpec("auto", "draft", "draft replicas: suffix proposals where they pay, else the draft"),
)}


def check_proposer(name: str) -> str:
    """`name` if the registry has it; else ValueError listing the names."""
    if name not in REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(REGISTRY)}")
    return name


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens were generated
    EOS = "eos"  # the target generated an end-of-sequence token
    STOP_STRING = "stop"  # a stop string appeared (the text ends before it)
    GRAMMAR_DEAD_END = "grammar_dead_end"  # the request's grammar allows no further token


@dataclass(frozen=True)
class GenerationRequest:
    """A request as the engine takes it from any front end (not yet validated)."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()  # exactly one of prompt and prompt_token_ids
    max_new_tokens: int = 0  # 0: the deployment's --default-max-new-tokens
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed
    num_speculative_tokens: int | None = None  # None: the deployment's (adaptive) k
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    proposer: str = ""  # a REGISTRY name; "": the deployment's default
    n: int = 1  # choices generated from the prompt
    grammar: GrammarSpec | None = None  # structured output: the grammar the reply follows
    logprobs: int | None = None  # each token's log-probability and the top N at its position


@dataclass(frozen=True)
class ModelInfo:
    """What a replica says of its model (GetModelInfo)."""

    model: str
    vocab_size: int  # output rows
    tokenizer_fingerprint: str
    max_context_tokens: int  # 0: unbounded
    eos_token_ids: tuple[int, ...]
    proposers: frozenset[str] = frozenset()  # the proposers it runs in its own pass
    device: str = ""  # "cpu", "cuda:0", ...
    boot_id: str = ""  # its machine's boot id ("": unknown)
    cpu_ids: frozenset[int] = frozenset()  # the CPUs its threads may run on
    accelerator_ids: frozenset[str] = frozenset()  # UUIDs of the GPUs its weights are on
    matmul_path: str = ""  # how its linear layers multiply ("default", "onednn", ...)
    pass_ms: tuple[tuple[int, float], ...] = ()  # (tokens, ms): passes it timed at start-up


def shares_compute(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether two replicas compute on the same hardware: one machine, and a GPU in common or
    (both on the CPU) overlapping CPUs. Unknown machines and GPUs count as separate."""
    if not a.boot_id or a.boot_id != b.boot_id:
        return False
    if a.device.startswith("cpu") and b.device.startswith("cpu"):
        return bool(a.cpu_ids & b.cpu_ids)
    return bool(a.accelerator_ids & b.accelerator_ids)


@dataclass(frozen=True)
class DraftBlock:
    """Tokens proposed outside the target (a draft model, prompt lookup) for it to score."""

    token_ids: tuple[int, ...]
    distributions: tuple[sampling.SparseDistribution, ...]  # what each token was drawn from
    draft_probs: tuple[float, ...]  # q_i(x_i)
    cache_length: int  # the draft replica's cache after proposing (0: no replica)
    compute_ms: float
    prebuilt: int = -1  # tokens drafted ahead, before the step asked (-1: not drafting ahead)
    ahead_hit: bool = False  # the step's history was the branch the draft guessed and drafted
    split: PassSplit = NO_SPLIT  # the draft replica's passes for it, by stage
    cached: int = 0  # history tokens the draft replica took from its prefix cache


#: Nothing proposed: the target scores no draft, a plain target step (k=0).
EMPTY_BLOCK = DraftBlock((), (), (), 0, 0.0)


def one_hot_block(tokens: list[int], compute_ms: float) -> DraftBlock:
    """A deterministic proposal (prompt lookup, suffix decoding): each token a one-hot q."""
    return DraftBlock(tuple(tokens), tuple(sampling.SparseDistribution((t,), (1.0,)) for t in tokens),
                      (1.0,) * len(tokens), 0, compute_ms)


class ReadsHistory:
    """What a proposer that reads only the orchestrator's history (prompt lookup, suffix
    decoding) does besides proposing: nothing to keep in step, nothing to release."""

    def update_candidate_strategy(self, block: DraftBlock, accepted: int, history_length: int) -> None:
        pass

    def lag(self, history_length: int) -> int:
        return 1  # it reads the history the orchestrator holds: always in step

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class PassLoad:
    """The target's forward pass that served a step: what the policy sees of the load."""

    sessions: int  # whose steps shared the pass
    tokens: int  # in the pass, over its sessions
    pass_ms: float  # the pass alone (compute_ms adds the wait for it)
    queue_depth: int  # passes waiting at the replica when the step was answered


@dataclass(frozen=True)
class TargetScores:
    """The target's answer to a DraftBlock: what rejection sampling needs; the orchestrator
    draws the uniforms and decides what is accepted."""

    scored: sampling.ScoredBlock
    cache_length: int  # tokens in the target session's cache after the step
    compute_ms: float
    load: PassLoad | None = None  # None: a replica that does not report it
    split: PassSplit = NO_SPLIT  # the target's pass for it, by stage
    cached: int = 0  # history tokens the target replica took from its prefix cache
    forced: bool = False  # a decode run's token its grammar forced: no pass drew it


@dataclass(frozen=True)
class TreeCommit:
    """The target's answer to a step of a proposer it runs itself (Lookahead, Medusa): it
    proposed a tree, verified it in its pass and decided what the step commits."""

    committed_token_ids: tuple[int, ...]  # the accepted path, then a recovered or bonus token
    proposed_count: int  # tokens in the verified tree
    cache_length: int
    compute_ms: float
    split: PassSplit = NO_SPLIT  # the target's pass for it, by stage
    cached: int = 0  # history tokens the target replica took from its prefix cache


#: What a target step answers: the kind matches what the step sent.
TargetResult = TargetScores | TreeCommit


@dataclass(frozen=True)
class Generation:
    """A validated generation request."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: sampling.SamplingParams
    seed: int
    num_speculative_tokens: int  # k (the most k, under the adaptive policy); 0: plain decoding
    policy: str  # "fixed" or "adaptive" (see orchestrator/policy.py)
    proposer: str  # a REGISTRY name, resolved ("none" when k is 0)
    eos_token_ids: frozenset[int]  # empty when the request ignores EOS
    max_free_tokens: int = 0  # the longest free (suffix) proposal: k when fixed, else the most k
    grammar: GrammarSpec | None = None
    top_logprobs: int | None = None  # each token's log-probability and the top N (None: none)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target, from the pass that verified it,
    and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Step:
    """What one step did: the facts usage and metrics are folded from."""

    token_ids: list[int]  # committed this step
    finished_by_eos: bool
    accepted: int = 0  # of token_ids, how many were drafted (the rest: recovered or bonus)
    drafted: int = 0  # proposed for the target to test (a tree counts its nodes)
    rejected: int = 0  # tested and rejected: at most one per drafted block
    prefill: bool = False  # the first step: it also filled the caches with the prompt
    draft_ms: float = 0.0  # the draft's compute time
    target_ms: float = 0.0  # the target's compute time
    wall_ms: float = 0.0  # the whole step, round trips included
    draft_wait_ms: float = 0.0  # waiting for the drafted block (decode steps)
    draft_hit: bool | None = None  # the draft had guessed this history (None: not drafting ahead)
    target_call_ms: float = 0.0  # the target's call as the orchestrator waited for it
    # From the end of the last step to the end of this one: this step and the consumer's
    # handling of the last (its text, its delta sent to the client).
    cycle_ms: float = 0.0
    draft_split: PassSplit = NO_SPLIT  # the replicas' passes for this step, by stage
    target_split: PassSplit = NO_SPLIT
    # History tokens the replicas took from their prefix caches (a session's first step).
    draft_cached: int = 0
    target_cached: int = 0
    proposer: str = ""  # "suffix", "grammar": a free proposal took the step; "": the request's proposer
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, where the request asked for them
    target_passes: int = 1  # 0: the grammar forced the step's tokens, no model ran
    dead_end: bool = False  # the grammar allows nothing after the step's tokens: the reply ends

    @property
    def orchestrator_ms(self) -> float:
        """The cycle's time outside its calls to the replicas: the orchestrator's own work."""
        return max(0.0, self.cycle_ms - self.draft_wait_ms - self.target_call_ms)

    @property
    def replica_wire_ms(self) -> float:
        """The calls' time outside the replicas' steps: the wire and gRPC on both ends (a
        draft's step that ran ahead, before the wait, adds nothing)."""
        return (max(0.0, self.target_call_ms - self.target_ms)
                + max(0.0, self.draft_wait_ms - self.draft_ms))


@dataclass(frozen=True)
class Usage:
    """A request's usage; `fold` is the one place it grows."""

    proposer: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    target_forward_passes: int = 0
    draft_ms: float = 0.0  # decode steps only
    target_ms: float = 0.0  # decode steps only
    prefill_ms: float = 0.0  # wall time of the first step
    draft_wait_ms: float = 0.0  # decode steps' waits for the draft (the draft on the critical path)
    draft_cache_hits: int = 0  # drafting decode steps whose history the draft guessed (overlap on)
    draft_cache_misses: int = 0  # drafting decode steps whose history it did not (overlap on)
    # Decode steps only: the replicas' passes by stage, the orchestrator's own time and the
    # wire's (Step.orchestrator_ms, Step.replica_wire_ms).
    draft_passes: PassSplit = NO_SPLIT
    target_passes: PassSplit = NO_SPLIT
    orchestrator_ms: float = 0.0
    replica_wire_ms: float = 0.0
    target_cached_tokens: int = 0  # prompt tokens the target took from its prefix cache
    draft_cached_tokens: int = 0  # and the draft
    suffix_drafted_tokens: int = 0  # of drafted_tokens, suffix proposals'
    suffix_accepted_tokens: int = 0  # of accepted_tokens, suffix proposals'
    grammar_forced_tokens: int = 0  # of drafted and accepted tokens, what the grammar forced

    def fold(self, step: Step, kept: int) -> Usage:
        """This usage after `step`, of whose tokens the first `kept` were delivered (a stop
        string may cut the rest: those are neither completion nor accepted tokens)."""
        return dataclasses.replace(
            self, completion_tokens=self.completion_tokens + kept,
            drafted_tokens=self.drafted_tokens + step.drafted,
            accepted_tokens=self.accepted_tokens + min(step.accepted, kept),
            suffix_drafted_tokens=self.suffix_drafted_tokens + (step.drafted if step.proposer == "suffix" else 0),
            suffix_accepted_tokens=self.suffix_accepted_tokens + (
                min(step.accepted, kept) if step.proposer == "suffix" else 0),
            grammar_forced_tokens=self.grammar_forced_tokens + (
                min(step.accepted, kept) if step.proposer == "grammar" else 0),
            rejected_tokens=self.rejected_tokens + step.rejected,
            target_forward_passes=self.target_forward_passes + step.target_passes,
            draft_ms=self.draft_ms + (0.0 if step.prefill else step.draft_ms),
            target_ms=self.target_ms + (0.0 if step.prefill else step.target_ms),
            prefill_ms=self.prefill_ms + (step.wall_ms if step.prefill else 0.0),
            draft_wait_ms=self.draft_wait_ms + step.draft_wait_ms,
            draft_cache_hits=self.draft_cache_hits + (step.draft_hit is True),
            draft_cache_misses=self.draft_cache_misses + (step.draft_hit is False),
            draft_passes=self.draft_passes + (NO_SPLIT if step.prefill else step.draft_split),
            target_passes=self.target_passes + (NO_SPLIT if step.prefill else step.target_split),
            orchestrator_ms=self.orchestrator_ms + (0.0 if step.prefill else step.orchestrator_ms),
            replica_wire_ms=self.replica_wire_ms + (0.0 if step.prefill else step.replica_wire_ms),
            target_cached_tokens=self.target_cached_tokens + step.target_cached,
            draft_cached_tokens=self.draft_cached_tokens + step.draft_cached)


@dataclass(frozen=True)
class Delta:
    """Tokens committed and the text they complete (text may lag behind its tokens)."""

    token_ids: tuple[int, ...]
    text: str
    choice: int = 0  # of a request for several (GenerationRequest.n)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, where the request asked for them


@dataclass(frozen=True)
class Summary:
    """The end of a generation (of one choice, in a request for several)."""

    finish_reason: FinishReason
    usage: Usage
    wire_bytes: int  # exchanged with the replicas
    total_ms: float
    choice: int = 0


Event = Delta | Summary
