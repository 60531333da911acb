"""The gateway's settings: limits, timeouts and the degradation ladder's thresholds (``tokenwire serve
--help`` lists the operator's flags for them)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol import frames
from server.defaults import DEFAULT_MAX_TOKENS


@dataclass(slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8765
    max_frame_bytes: int = 1 << 20
    auth_secret: str | None = None
    ping_interval_s: float = 20.0
    max_tokens: int = frames.MAX_MAX_TOKENS  # cap on params.max_tokens, advertised in welcome.limits
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a chat does not say
    # Hostile or buggy clients: limits that answer rate_limited (with retry_after_ms) instead of serving.
    chat_rate_per_connection: float = 10.0  # chats per second, bursts of twice that
    chat_rate_per_user: int = 50  # chats per second per user, across all gateways
    max_streams_per_connection: int = 64  # requests one connection may follow at once
    # Bytes of chat text (content or messages) per second per connection, bursts of twice that: the
    # default lets a 1 MiB chat through once a second, and small chats at the chat rate.
    chat_bytes_per_connection: int = 1 << 20
    # Reading (SPEC §2.2, ingress.py): every connection is read at twice the chat-text rate, and the
    # connections of one peer address together at this rate (0: no per-peer pace; behind a reverse
    # proxy all clients share its address). A WebSocket held back by its own pace for flood_close_s
    # in a row is closed with 1008 (0: only paced).
    ingress_bytes_per_peer: int = 16 << 20
    flood_close_s: float = 1.0
    resume_rate_per_connection: float = 10.0  # resumes per second, bursts of max(2 x that, max_streams)
    # Cancels per second on one connection, bursts of max(2 x that, max_streams): each costs the store a
    # script call, so they are limited like resumes (a client stopping all its streams at once passes).
    cancel_rate_per_connection: float = 10.0
    # The most a chat's params.detach_timeout_ms may keep it running with nobody attached (welcome.limits):
    # for an app away for minutes. Its cost is bounded anyway (max_tokens; --max-inflight-per-user).
    max_detach_timeout_ms: int = 600_000
    hello_timeout_s: float = 10.0  # a WebSocket that has not sent hello by then is closed 1008
    resume_rate_per_user: int = 200  # resumes per second per user, across all gateways
    # Streams one owner may have attached to this gateway at once, over all its connections and doors
    # (WebSocket streams, HTTP streams and waits, content turns waiting for the previous turn).
    max_streams_per_user: int = 256
    # Content-mode turns of one session held until the previous turn ends (SPEC §4.2); past this the
    # answer is rate_limited. Each holds its frame's content in memory, so the gateway also caps their
    # total bytes (past it: overloaded).
    max_waiting_turns_per_session: int = 2
    max_waiting_bytes: int = 32 << 20
    # The HTTP door: a request's headers and body must arrive within this deadline (a body trickled a
    # byte at a time gets 408); a kept-alive connection idle this long is closed.
    http_request_timeout_s: float = 30.0
    http_idle_timeout_s: float = 15.0
    # HTTP connections this gateway holds at once, and per peer address: past them, 503 / 429 and close.
    max_http_connections: int = 4096
    max_http_connections_per_peer: int = 256
    # WebSockets (both doors, /v1/ws and /v1/responses, together) this gateway holds at once, and per
    # peer address (0: no per-peer cap, for a gateway behind a proxy every client shares): past them the
    # handshake is refused 503 / 429. An idle WebSocket costs tens of KB; one address must not take all.
    max_ws_connections: int = 65536
    max_ws_connections_per_peer: int = 8192
    allowed_origins: tuple[str, ...] | None = None  # browser Origins allowed; None: any
    slow_reader_timeout_s: float = 10.0  # a send blocked this long closes the connection (1008)
    response_cache: bool = True  # answer repeated deterministic requests from the store's cache
    # One cache for all users instead of one per user: more hits, but whether a prompt is answered at once
    # tells a user that someone else asked it recently (a side channel); an operator's explicit choice.
    shared_response_cache: bool = False
    # Degradation under load: past either threshold (0 = off), new chats get at most degrade_max_tokens
    # and only the system prompt plus the latest degrade_context_messages messages.
    degrade_queue_depth: int = 0  # requests waiting in the store's queue
    degrade_ttft_s: float = 0.0  # recent time to first token seen by this gateway (moving average)
    degrade_max_tokens: int = 128
    degrade_context_messages: int = 8
    # --fallback MODEL=LIGHT: past a threshold, MODEL's new chats go to LIGHT (rung 3 of the ladder in
    # submit.py), unless the chat says params.fallback false.
    fallbacks: tuple[tuple[str, str], ...] = ()
    # /metrics on a port of its own (None: on the client port, and only while auth is off).
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: the same address as host
    ui_connect: tuple[str, ...] = ()  # WebSocket origins the browser UI may use besides this server's

    def fallback_for(self, model: str) -> str | None:
        return next((light for heavy, light in self.fallbacks if heavy == model), None)
