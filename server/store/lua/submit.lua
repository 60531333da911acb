-- Create a request, or attach to the one with the same id (idempotent retry), atomically.
-- KEYS[1] request hash, KEYS[2] work queue stream, KEYS[3] queued-requests counter
-- ARGV: 1 owner, 2 id, 3 fingerprint, 4 payload (JSON), 5 now_ms, 6 session, 7 user message (JSON or ""),
--       8 ttl_ms (a bound on how long an unfinished request may linger), 9 max_queued (0 = unbounded)
-- Returns {"attach", epoch, state} | {"conflict", 0, state} | {"overloaded", queued, ""} | {"new", 1, "queued"}
local req = KEYS[1]
local existing = redis.call('HMGET', req, 'fp', 'epoch', 'state')
if existing[1] then
  if existing[1] == ARGV[3] then
    return {'attach', tonumber(existing[2]), existing[3]}
  end
  return {'conflict', 0, existing[3]}
end
local max_queued = tonumber(ARGV[9])
local queued = tonumber(redis.call('GET', KEYS[3]) or '0')
if max_queued > 0 and queued >= max_queued then
  return {'overloaded', queued, ''}
end
redis.call('HSET', req,
  'owner', ARGV[1], 'id', ARGV[2], 'fp', ARGV[3], 'payload', ARGV[4],
  'epoch', 1, 'state', 'queued', 'created_ms', ARGV[5], 'updated_ms', ARGV[5],
  'session', ARGV[6], 'user_msg', ARGV[7], 'completion_tokens', 0, 'prompt_tokens', 0)
redis.call('PEXPIRE', req, ARGV[8])
redis.call('INCR', KEYS[3])
redis.call('XADD', KEYS[2], '*', 'req', req)
return {'new', 1, 'queued'}
