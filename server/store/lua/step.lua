-- Append one engine step to the token logs of a worker's running requests in one partition: one call
-- for the whole step, whatever the number of requests (issue 28: the store's cost grows with steps, not
-- tokens). Fenced by the worker's held hash, which is also the offset check.
-- KEYS[1] the worker's held hash in this partition (log key -> tokens logged so far, keys.py), KEYS[2..]
--   the token logs the ops write to, one per op in order (all in the partition: one hash slot)
-- ARGV: 1 worker id, then five per op: offset, n tokens, text, token ids (comma-separated), and the
--   prompt's length in tokens for the op at offset 0 ("" for the others): the first entry carries it as
--   'p', so a request cancelled while it runs reports it (cancel.lua, detach.lua) before finish.lua
--   writes it to the request hash
-- Per op: 1 appended (also for a retry of a delta already logged, whose reply was lost); 0 when the
-- request is no longer held by this worker (ended, cancelled, detached, re-queued, taken over): stop
-- generating it; -1 when the offset is not the log's end (a bug in the caller): nothing is written and
-- the caller re-queues or fails it (mismatch.lua). The stream entry id is "<offset>-1", so XRANGE/XREAD
-- from "<offset>-0" start exactly at that offset and a second write of the same offset is impossible.
-- Token ids and the writing worker are logged so that another worker can continue the request from the
-- prompt plus these tokens (re-prefill) if this one dies.
-- Commands: HMGET + one XADD per op + HSET, so a step of N requests costs N + 2 commands and one call.
local held = KEYS[1]
local n = #KEYS - 1
local logs = {}
for i = 1, n do logs[i] = KEYS[i + 1] end
local ends = redis.call('HMGET', held, unpack(logs))
local cur = {}  -- log -> its end as this call has moved it (a step may hold two ops of one request)
for i = 1, n do
  if ends[i] then cur[logs[i]] = tonumber(ends[i]) end
end
local out, moved = {}, {}
for i = 1, n do
  local log = logs[i]
  local a = 2 + 5 * (i - 1)
  local offset, cnt = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local e = cur[log]
  if e == nil then
    out[i] = 0
  elseif offset == e then
    if offset == 0 and ARGV[a + 4] ~= '' then
      redis.call('XADD', log, '0-1', 'o', 0, 'n', cnt, 't', ARGV[a + 2], 'k', ARGV[a + 3], 'w', ARGV[1],
        'p', ARGV[a + 4])
    else
      redis.call('XADD', log, offset .. '-1', 'o', offset, 'n', cnt, 't', ARGV[a + 2], 'k', ARGV[a + 3],
        'w', ARGV[1])
    end
    cur[log] = offset + cnt
    moved[log] = true
    out[i] = 1
  elseif offset + cnt <= e then
    -- A retry of a write whose reply was lost (Redis went away mid-pipeline): the same delta is logged.
    local x = redis.call('XRANGE', log, offset .. '-1', offset .. '-1')
    local same = false
    if x[1] then
      for j = 1, #x[1][2], 2 do
        if x[1][2][j] == 'n' and tonumber(x[1][2][j + 1]) == cnt then same = true end
      end
    end
    out[i] = same and 1 or -1
  else
    out[i] = -1
  end
end
local upd = {}
for log, _ in pairs(moved) do
  table.insert(upd, log)
  table.insert(upd, cur[log])
end
if #upd > 0 then
  redis.call('HSET', held, unpack(upd))
end
return out
