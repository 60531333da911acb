-- Cancel a request that has not ended: -> cancelled, and end its log so every attached reader gets done.
-- KEYS[1] request hash, KEYS[2] token log stream, KEYS[3] queued-requests counter
-- ARGV: 1 now_ms, 2 retention_ms
-- Returns the state before the call ("queued", "running", or a final state, for which nothing changes),
-- or false when the request does not exist. Idempotent: cancelling twice is the same as once.
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'completion_tokens', 'prompt_tokens')
if not f[1] then
  return false
end
local state = f[1]
if state ~= 'queued' and state ~= 'running' then
  return state
end
if state == 'queued' then
  redis.call('DECR', KEYS[3])
end
redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', ARGV[1],
  'finished_ms', ARGV[1])
redis.call('XADD', KEYS[2], f[2] .. '-2', 'd', 'cancelled', 'o', f[2], 'pt', f[3])
redis.call('PEXPIRE', req, ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return state
