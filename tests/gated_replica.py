"""A draft or target service whose model load waits for a line on stdin.

The real servicer behind the real bootstrap (`server.serve`), held in the state every replica
is in while its weights load, for as long as a test needs it. Run as a script:
`python gated_replica.py draft|target MODEL`; write a line to its stdin to let the load run.
"""

from __future__ import annotations

import asyncio
import sys


def main() -> None:
    from tandem.model_service import ModelHost, ModelServiceConfig
    from tandem.server import serve

    role, model = sys.argv[1], sys.argv[2]
    if role == "draft":
        from draft_service.service import DraftService as Service
    else:
        from target_service.service import TargetService as Service  # type: ignore[assignment]

    class Gated(Service):  # type: ignore[valid-type,misc]
        def load(self) -> None:
            sys.stdin.readline()
            super().load()

    host = ModelHost(ModelServiceConfig(model=model, threads=1))
    asyncio.run(serve([Gated(host)], f"{role}-service", "127.0.0.1", 0, grace_s=1))


if __name__ == "__main__":
    main()
