"""The WebSocket gateway: connections, sessions, auth, and fan-out of token logs to sockets."""
