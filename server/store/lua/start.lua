-- A worker takes a queued request: queued -> running, recording which worker holds it, and consumes the
-- queue entry that brought it (acknowledged and deleted, so a queue holds only work not yet started).
-- One transition: the entry is never consumed without the request moving, nor the other way round.
-- KEYS[1] request hash, KEYS[2] queued-requests counter, KEYS[3] token log, KEYS[4] this worker's held
--   hash (log -> tokens logged: what step.lua fences on and what another worker re-queues if this one's
--   lease lapses), KEYS[5] the queue stream
--   the entry came from (all in the request's partition: one hash slot)
-- ARGV: 1 worker id, 2 retention_ms, 3 consumer group, 4 queue entry id
-- Returns {payload, completion_tokens, epoch, queue wait ms, response-cache key or ""} or false when the request is gone or no longer
-- queued (cancelled while it waited, or nobody attached for detach_timeout: then it is cancelled here).
-- A re-queued request whose log is gone cannot be continued: it restarts from token 0 under a new epoch,
-- so a client holding the old epoch gets resume_failed instead of a silently different stream.
redis.call('XACK', KEYS[5], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[5], ARGV[4])
local req = KEYS[1]
-- One read of everything the transition and its answer need (the fields it changes are tracked below).
local f = redis.call('HMGET', req, 'state', 'attached_until', 'completion_tokens', 'updated_ms', 'payload',
  'epoch', 'cache_key')
if f[1] ~= 'queued' then
  return false
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('DECR', KEYS[2])
if tonumber(f[2] or '0') < now then
  -- A re-queued request may have logged tokens already: its first entry carries the prompt's length.
  local pt = prompt_len(KEYS[3], nil)
  redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', now,
    'finished_ms', now, 'prompt_tokens', pt)
  redis.call('XADD', KEYS[3], f[3] .. '-2', 'd', 'cancelled', 'o', f[3], 'pt', pt, 'c', 'detach_timeout')
  redis.call('PEXPIRE', req, ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return false
end
local done, epoch = tonumber(f[3]), tonumber(f[6])
if done > 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  epoch = redis.call('HINCRBY', req, 'epoch', 1)
  done = 0
  redis.call('HSET', req, 'completion_tokens', 0)
end
redis.call('HSET', req, 'state', 'running', 'worker', ARGV[1], 'started_ms', now, 'updated_ms', now)
redis.call('HSET', KEYS[4], KEYS[3], done or 0)
-- updated_ms was set when it was queued (or re-queued): the difference is the time it waited.
return {f[5], done, epoch, now - tonumber(f[4] or now), f[7] or ''}
