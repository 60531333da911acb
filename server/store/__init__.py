"""The Redis store: request state machine, token logs, sessions, the work queue (ARCHITECTURE.md)."""
