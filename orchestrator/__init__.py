"""The orchestrator: public API, speculation loop, routing across replicas."""
