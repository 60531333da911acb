"""kill -9 of ``tokenwire serve`` (embedded Valkey, append-only file) and a restart on the same data."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from protocol import Accepted, Chat, Delta, Done, Message, Params, Resume
from server.client import Client, collect
from tests.e2e.serve_process import ServeProcess

MESSAGES = (Message("user", "Tell me a long story about tokens"),)
# cache=False: the reference run after the restart must generate, not replay "run" from the cache.
PARAMS = Params(max_tokens=400, temperature=0, cache=False)  # greedy on a model without near ties


async def test_kill9_restart_replays_finished_and_completes_running(
    peaky_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    args = ["--model", str(peaky_model_dir)]
    first = ServeProcess(args, data)
    url = first.start()
    try:
        c = await Client.connect(url)
        assert c.welcome is not None
        token = c.welcome.session_token
        finished, _, done, _ = await collect(
            c.chat("short one", id="fin", params=Params(max_tokens=8, seed=1))
        )
        assert done is not None
        await c.send(Chat(id="run", messages=MESSAGES, params=PARAMS))
        seen = ""
        offset = 0
        async for f in c.frames_for("run"):
            if isinstance(f, Delta):
                seen += f.text
                offset += f.n
                if offset >= 5:
                    break
        assert first.proc is not None
        first.proc.send_signal(signal.SIGKILL)  # no shutdown of any kind
        first.proc.wait(10)
    finally:
        first.stop()

    second = ServeProcess(args, data)
    url = second.start()
    try:
        c2 = await Client.connect(url, session_token=token)
        # Finished requests replay whole from the append-only file.
        await c2.send(Resume(id="fin", offset=0))
        again, _, done2, _ = await collect(c2.frames_for("fin"))
        assert again == finished and done2 is not None and done2.offset == done.offset
        # The running request is re-queued once the dead worker's lease lapses, continued after its
        # logged tokens, and the client resumes from where it was: no gap, no repeat.
        await c2.send(Resume(id="run", offset=offset))
        frames = [f async for f in c2.frames_for("run")]
        assert isinstance(frames[0], Accepted) and frames[0].epoch == 1
        rest = [f for f in frames if isinstance(f, Delta)]
        end = frames[-1]
        assert isinstance(end, Done) and end.finish_reason in ("stop", "length")
        pos = offset
        for d in rest:
            assert d.offset == pos
            pos += d.n
        assert end.offset == pos
        # ... and the result is the text an uninterrupted run with the same seed gives.
        reference, _, _, _ = await collect(
            c2.chat(messages=[m.to_wire() for m in MESSAGES], id="ref", params=PARAMS)
        )
        assert seen + "".join(d.text for d in rest) == reference
        await c2.close()
        # It really was continued mid-way (re-prefill after the logged tokens), not finished before the kill.
        log = second.stderr_path.read_text()
        assert "worker.reaped" in log and re.search(r'"resumed_at": [1-9]', log)
    finally:
        assert second.stop() == 0
