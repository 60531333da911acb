"""The Redis store: request state machine, token logs, sessions, the work queue (DESIGN.md §4)."""
