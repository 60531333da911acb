-- Append one delta to a running request's token log, fenced by the worker id and the offset.
-- KEYS[1] request hash, KEYS[2] token log stream, KEYS[3] the worker's set of running requests,
-- KEYS[4] the partition's work queue stream, KEYS[5] its queued-requests counter (one partition, one slot)
-- ARGV: 1 worker id, 2 offset, 3 n tokens, 4 text, 5 prompt tokens, 6 token ids (comma-separated),
--       7 retention_ms, 8 how many times a request may be re-queued for an offset mismatch
-- The stream entry id is "<offset>-1", so XRANGE/XREAD from "<offset>-0" start exactly at that offset and a
-- second write of the same offset is impossible. Token ids (and the writing worker) are logged so that another worker can continue
-- the request from the prompt plus these tokens (re-prefill) if this one dies.
-- Returns 1 on success (also for a retry of a delta this worker already logged); 0 when the request is no longer running for this worker (cancelled, taken over)
-- or has had nobody attached for detach_timeout (then it is cancelled here): the worker must stop
-- generating it; -1 when the offset is not the log's end (a bug in the caller): then the request is
-- re-queued (a worker continues it after the tokens logged, so the stream goes on with no gap), or after
-- ARGV[8] such re-queues it fails with an `internal` error, so it never stays running with no writer.
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'worker', 'completion_tokens', 'attached_until')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(f[4] or '0') < now then
  redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', now,
    'finished_ms', now)
  redis.call('XADD', KEYS[2], f[3] .. '-2', 'd', 'cancelled', 'o', f[3], 'pt', ARGV[5])
  redis.call('PEXPIRE', req, ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
  redis.call('SREM', KEYS[3], req)
  return 0
end
local offset = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
-- A retry of a write whose reply was lost (Redis went away mid-pipeline): the same delta is already
-- logged, so it succeeds again without a second copy.
if offset + n <= tonumber(f[3]) then
  local e = redis.call('XRANGE', KEYS[2], offset .. '-1', offset .. '-1')
  if e[1] then
    local kv = {}
    for i = 1, #e[1][2], 2 do kv[e[1][2][i]] = e[1][2][i + 1] end
    if tonumber(kv['n']) == n and kv['w'] == ARGV[1] then
      return 1
    end
  end
end
if tonumber(f[3]) ~= offset then
  redis.call('SREM', KEYS[3], req)
  if redis.call('HINCRBY', req, 'mismatches', 1) > tonumber(ARGV[8]) then
    redis.call('HSET', req, 'state', 'failed', 'finish_reason', 'error', 'error_code', 'internal',
      'updated_ms', now, 'finished_ms', now)
    redis.call('XADD', KEYS[2], f[3] .. '-2', 'd', 'error', 'o', f[3], 'pt', ARGV[5], 'e', 'internal',
      'm', 'the server lost its place in this reply; send the chat again with a new id')
    redis.call('PEXPIRE', req, ARGV[7])
    redis.call('PEXPIRE', KEYS[2], ARGV[7])
  else
    redis.call('HSET', req, 'state', 'queued', 'worker', '', 'updated_ms', now)
    redis.call('HINCRBY', req, 'requeues', 1)
    redis.call('INCR', KEYS[5])
    redis.call('XADD', KEYS[4], '*', 'req', req)
  end
  return -1
end
redis.call('XADD', KEYS[2], offset .. '-1', 'o', offset, 'n', n, 't', ARGV[4], 'k', ARGV[6], 'w', ARGV[1])
redis.call('HSET', req, 'completion_tokens', offset + n, 'prompt_tokens', ARGV[5])
return 1
