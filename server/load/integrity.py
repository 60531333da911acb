"""Is every text intact? Checks on what a client received, across drops and resumes.

Two checks, both exact:

* **Offsets** (every request): the deltas a client receives for a request, across any number of
  reconnects, start at offset 0 and are contiguous; ``done.offset`` is where they end and equals
  ``usage.completion_tokens``; the epoch never changes silently.
* **Replay** (the requests that were dropped, or all with ``--verify all``): after ``done``, a fresh
  ``resume {id, offset: 0}`` replays the request from the server's log; that replay must itself be
  contiguous and its text must equal the text the client assembled from its interrupted live stream. The
  log is what any later reader sees, so a resume that skipped, repeated or spliced text shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import Accepted, Delta, Done, Error, Resume
from server.load.connection import LoadClient


@dataclass(frozen=True, slots=True)
class Violation:
    request_id: str
    kind: str  # offset_gap, done_mismatch, epoch_changed, replay_mismatch, replay_failed
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"id": self.request_id, "kind": self.kind, "detail": self.detail}


@dataclass(slots=True)
class StreamCheck:
    """Assembles one request's text from its deltas and records what breaks the invariant."""

    request_id: str
    offset: int = 0
    parts: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _bad(self, kind: str, detail: str) -> None:
        self.violations.append(Violation(self.request_id, kind, detail))

    def delta(self, d: Delta) -> None:
        if d.offset != self.offset:
            self._bad("offset_gap", f"delta at offset {d.offset}, expected {self.offset}")
            if d.offset + d.n <= self.offset:
                return  # wholly a repeat of tokens already held: a careful client drops it
        self.parts.append(d.text)
        self.offset = max(self.offset, d.offset) + d.n

    def done(self, d: Done) -> None:
        if d.offset != self.offset or d.usage.completion_tokens != d.offset:
            self._bad(
                "done_mismatch",
                f"done.offset {d.offset}, usage.completion_tokens {d.usage.completion_tokens}, "
                f"received {self.offset}",
            )

    def epoch(self, held: int | None, got: int) -> None:
        if held is not None and got != held and self.offset > 0:
            self._bad("epoch_changed", f"accepted epoch {got} after epoch {held} without resume_failed")

    def restart(self) -> None:
        """After ``resume_failed`` the client discards its partial text (SPEC §10.4)."""
        self.offset = 0
        self.parts.clear()


async def replay_and_compare(client: LoadClient, check: StreamCheck) -> None:
    """Replay the finished request from offset 0 on ``client`` and compare with ``check``'s text.

    Connection errors propagate (the caller reconnects and tries again); protocol answers that make a
    replay impossible are recorded as ``replay_failed``. The caller bounds the time it may take.
    """
    rid = check.request_id
    replay = StreamCheck(rid)
    await client.send(Resume(id=rid, offset=0))
    while True:
        frame, _ = await client.recv_sized()
        if getattr(frame, "id", None) != rid or isinstance(frame, Accepted):
            continue
        if isinstance(frame, Delta):
            replay.delta(frame)
        elif isinstance(frame, Error):
            if frame.code in ("too_large", "internal"):
                continue  # replayed ahead of a done with finish_reason error
            check.violations.append(Violation(rid, "replay_failed", f"{frame.code}: {frame.message}"))
            return
        elif isinstance(frame, Done):
            replay.done(frame)
            break
    for v in replay.violations:
        check.violations.append(Violation(rid, v.kind, "replay: " + v.detail))
    if replay.offset != check.offset or replay.text != check.text:
        check.violations.append(
            Violation(
                rid,
                "replay_mismatch",
                f"live {check.offset} tokens / {len(check.text)} chars, "
                f"replay {replay.offset} tokens / {len(replay.text)} chars; "
                f"first difference at char {_first_diff(check.text, replay.text)}",
            )
        )


def _first_diff(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
