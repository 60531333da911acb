-- A worker takes a queued request: queued -> running, recording which worker holds it.
-- KEYS[1] request hash, KEYS[2] queued-requests counter
-- ARGV: 1 worker id, 2 now_ms
-- Returns {payload, completion_tokens, epoch} or false when the request is gone or no longer queued
-- (cancelled while it waited): the worker then just acknowledges the queue entry.
local req = KEYS[1]
local state = redis.call('HGET', req, 'state')
if state ~= 'queued' then
  return false
end
redis.call('DECR', KEYS[2])
redis.call('HSET', req, 'state', 'running', 'worker', ARGV[1], 'started_ms', ARGV[2], 'updated_ms', ARGV[2])
local f = redis.call('HMGET', req, 'payload', 'completion_tokens', 'epoch')
return {f[1], tonumber(f[2]), tonumber(f[3])}
