-- Re-queue one request its own worker holds as running but does not run (an orphan: the reply to its
-- start.lua was lost, or the worker failed between starting it and handing it to its engine, or it is
-- a restarted process under the same name). As reap.lua does for a dead worker, but for one request of a
-- live one: running -> queued on its own model's queue, same epoch, so the next start continues it after
-- the tokens already logged (nothing is generated twice, nothing lost).
-- Fenced: only while it is still running for this worker under the start the caller saw (started_ms),
-- so a request that ended, moved, or was re-queued and started again meanwhile is left alone.
-- All keys are in the request's partition (one hash slot):
-- KEYS[1] the worker's held hash, KEYS[2] the request hash, KEYS[3] the work queue stream of its model,
--   KEYS[4] that queue's queued-requests counter, KEYS[5] the request's token log
-- ARGV: 1 worker id, 2 the request's started_ms as the caller read it, 3 its route as the caller read it
-- Returns 1 when re-queued; 0 when nothing was to be done (then a stale member of KEYS[1], one not running
-- for this worker, is removed from it); -2 (nothing changed) when its route differs from ARGV[3]: the
-- caller declared the wrong queue, reads the route again and retries.
local req = KEYS[2]
local f = redis.call('HMGET', req, 'state', 'worker', 'started_ms', 'route')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then
  redis.call('HDEL', KEYS[1], KEYS[5])
  return 0
end
if (f[3] or '') ~= ARGV[2] then
  return 0
end
if (f[4] or '') ~= ARGV[3] then
  return -2
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local logged = redis.call('HGET', KEYS[1], KEYS[5])
redis.call('HDEL', KEYS[1], KEYS[5])
redis.call('HSET', req, 'state', 'queued', 'worker', '', 'updated_ms', now)
if logged then
  redis.call('HSET', req, 'completion_tokens', logged)
end
redis.call('HINCRBY', req, 'requeues', 1)
redis.call('INCR', KEYS[4])
redis.call('XADD', KEYS[3], '*', 'req', req)
return 1
