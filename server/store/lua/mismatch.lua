-- A step op whose offset was not its log's end (step.lua returned -1: a bug in the caller): take the
-- request from the worker so that it never stays running with no writer. It is re-queued (a worker
-- continues it after the tokens logged, so the stream goes on with no gap), or after ARGV[4] such
-- re-queues it fails with an `internal` error.
-- KEYS[1] request hash, KEYS[2] token log, KEYS[3] the worker's held hash, KEYS[4] the work queue stream
--   of its model, KEYS[5] that queue's queued-requests counter (one partition, one slot)
-- ARGV: 1 worker id, 2 retention_ms, 3 prompt tokens, 4 how many times it may be re-queued for this
-- Returns 1 when re-queued, 2 when failed, 0 when it was not running for this worker (nothing changes).
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'worker')
local e = redis.call('HGET', KEYS[3], KEYS[2])
if f[1] ~= 'running' or f[2] ~= ARGV[1] or not e then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', KEYS[3], KEYS[2])
redis.call('HSET', req, 'completion_tokens', e)
if redis.call('HINCRBY', req, 'mismatches', 1) > tonumber(ARGV[4]) then
  redis.call('HSET', req, 'state', 'failed', 'finish_reason', 'error', 'error_code', 'internal',
    'updated_ms', now, 'finished_ms', now, 'prompt_tokens', ARGV[3])
  redis.call('XADD', KEYS[2], e .. '-2', 'd', 'error', 'o', e, 'pt', ARGV[3], 'e', 'internal',
    'm', 'the server lost its place in this reply; send the chat again with a new id')
  redis.call('PEXPIRE', req, ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 2
end
redis.call('HSET', req, 'state', 'queued', 'worker', '', 'updated_ms', now)
redis.call('HINCRBY', req, 'requeues', 1)
redis.call('INCR', KEYS[5])
redis.call('XADD', KEYS[4], '*', 'req', req)
return 1
