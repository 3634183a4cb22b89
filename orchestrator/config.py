"""The orchestrator's one typed configuration, from flags and TANDEM_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import option
from tandem.security import ClientTls, ServerSecurityConfig, load_client_tls
from tandem.server import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class OrchestratorConfig(ServerSecurityConfig):
    """Configuration of the orchestrator (TLS of its public API: ServerSecurityConfig)."""

    draft: str = option("", "draft replica addresses, comma-separated (empty: no draft)")
    target: str = option("", "target replica addresses, comma-separated")
    draft_service_name: str = option("", "Kubernetes Service whose EndpointSlices list the draft "
                                     "replicas (live discovery, instead of --draft)")
    target_service_name: str = option("", "Kubernetes Service whose EndpointSlices list the "
                                      "target replicas (live discovery, instead of --target)")
    namespace: str = option("", "namespace of those Services (empty: the pod's own)")
    kubeconfig: str = option("", "kubeconfig file for discovery from outside the cluster (empty: "
                             "the pod's service account, else $KUBECONFIG or ~/.kube/config)")
    service_port_name: str = option("grpc", "name of the gRPC port in those Services")
    tokenizer: str = option("", "tokenizer: path, hub id or built-in name, matching the "
                            "replicas' (empty: the one the reference target serves)")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50051, "port to bind (0 picks a free one)")
    http_port: int = option(-1, "port for the OpenAI-compatible HTTP API (0 picks a free one; "
                            "-1: none; tandem up serves it on 8000)")
    served_model_name: str = option("", "the model name the HTTP API answers to and lists "
                                    "(empty: the target's --model)")
    num_speculative_tokens: int = option(4, "default draft block length k, the most k under the "
                                         "adaptive policy (0: plain target decoding)")
    speculation_policy: str = option("adaptive", "adaptive: choose k per step from measured acceptance "
                                     "and costs (falls to 0 when speculation does not pay); fixed: "
                                     "always k. A request that sets num_speculative_tokens gets fixed k")
    max_speculative_tokens: int = option(16, "largest k a request may ask for")
    speculation_by_batch: str = option("", "adaptive policy: the most k by the sessions sharing "
                                       "the target's pass, e.g. \"1-4:4,5-16:2,17-:0\" (empty, or "
                                       "sessions it leaves out: derived from the target's measured "
                                       "pass times)")
    overlap: str = option("auto", "on: the draft drafts the next block while the target verifies "
                          "this one, guessing its outcomes (exact either way); off: draft and "
                          "target take turns; auto: on unless a draft replica shares a target "
                          "replica's hardware (one machine, overlapping CPUs or the same GPU)")
    max_support_size: int = option(8, "K: support of each draft distribution sent over the wire")
    proposer: str = option("", "default proposer: auto, draft-model, suffix, prompt-lookup, lookahead, "
                           "medusa or none (empty: auto when draft replicas are configured, else none)")
    suffix_cache_tokens: int = option(1 << 18, "suffix decoding: tokens of recent outputs kept for every "
                                      "request to match, oldest out first (0: none kept)")
    prompt_lookup_min_ngram: int = option(2, "prompt lookup: shortest n-gram matched in the history")
    prompt_lookup_max_ngram: int = option(3, "prompt lookup: longest n-gram matched (tried first)")
    max_new_tokens_cap: int = option(4096, "largest max_new_tokens a request may ask for")
    max_choices: int = option(16, "largest n (choices from one prompt) a request may ask for")
    default_max_new_tokens: int = option(256, "max_new_tokens when a request leaves it unset")
    replica_retry_s: float = option(10.0, "how long a request whose target session was lost waits "
                                    "for a target replica to rebuild it on (e.g. a restart), once "
                                    "every replica was tried")
    max_concurrent_requests: int = option(256, "requests generating at once; more wait in the "
                                          "queue")
    max_queued_requests: int = option(1024, "requests waiting for a running slot; beyond running "
                                      "+ queued, a request gets RESOURCE_EXHAUSTED")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest request message accepted, in "
                                    "bytes; a larger one gets RESOURCE_EXHAUSTED")
    replica_wait_s: float = option(600.0, "how long start-up waits for replicas to be SERVING")
    grace_s: float = option(30.0, "seconds to drain in-flight streams on SIGTERM")
    metrics_port: int = option(-1, "port for Prometheus metrics over HTTP (0 picks a free one; "
                               "-1: none)")
    log_level: str = option("INFO", "logging level")
    auth_token_file: str = option("", "file holding the bearer token every public API call must "
                                  "send, one per line where several are accepted; read again "
                                  "when it changes (empty: no authentication); health and "
                                  "reflection stay open")
    upstream_tls_ca: str = option("", "PEM CA bundle to verify draft/target certificates with "
                                  "(setting any --upstream-tls-* turns on TLS to the replicas)")
    upstream_tls_cert: str = option("", "PEM client certificate to present to the replicas "
                                    "(mutual TLS)")
    upstream_tls_key: str = option("", "PEM private key of --upstream-tls-cert")
    upstream_tls_server_name: str = option("", "name to verify replica certificates against "
                                           "(discovered replicas are dialled by pod IP)")

    def upstream_tls(self) -> ClientTls | None:
        return load_client_tls(self.upstream_tls_ca, self.upstream_tls_cert,
                               self.upstream_tls_key, self.upstream_tls_server_name,
                               flag="--upstream-tls")
