-- The detach timeout for a worker's running requests in one partition: each one no client has been
-- attached to since its attached_until (touch.lua) is cancelled, to free the accelerator. The worker
-- runs this every second or so (step.lua no longer reads every request's hash on every step); a
-- request it cancels stops at the worker's next step (step.lua answers 0: no longer held).
-- KEYS[1] the worker's held hash in the partition, then pairs: KEYS[2i] a request hash, KEYS[2i+1] its
--   token log, for the requests the caller read in the held hash (one partition, one slot)
-- ARGV: 1 worker id, 2 retention_ms
-- Returns {now_ms, then a pair per request still running here: its token log and its attached_until
-- (-1 when this call cancelled it)}. attached_until only ever moves later (touch.lua), so the caller need
-- not ask again about a request before that time: a sweep reads each request about once per detach
-- timeout, not every second (issue 28: the store's cost per token).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i = 2, #KEYS - 1, 2 do
  local req, log = KEYS[i], KEYS[i + 1]
  local e = redis.call('HGET', KEYS[1], log)
  local f = redis.call('HMGET', req, 'state', 'worker', 'attached_until', 'prompt_tokens')
  if e and f[1] == 'running' and f[2] == ARGV[1] and tonumber(f[3] or '0') < now then
    local pt = prompt_len(log, f[4])
    redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', now,
      'finished_ms', now, 'completion_tokens', e, 'prompt_tokens', pt)
    -- 'c': why, for done.cancel_reason (SPEC 10.5): the client can tell this from its own Stop.
    redis.call('XADD', log, e .. '-2', 'd', 'cancelled', 'o', e, 'pt', pt, 'c', 'detach_timeout')
    redis.call('PEXPIRE', req, ARGV[2])
    redis.call('PEXPIRE', log, ARGV[2])
    redis.call('HDEL', KEYS[1], log)
    table.insert(out, log)
    table.insert(out, -1)
  elseif e and f[1] == 'running' and f[2] == ARGV[1] then
    table.insert(out, log)
    table.insert(out, tonumber(f[3] or '0'))
  end
end
return out
