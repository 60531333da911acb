-- Cancel a request that has not ended: -> cancelled, and end its log so every attached reader gets done.
-- KEYS[1] request hash, KEYS[2] token log stream, KEYS[3] queued-requests counter
-- ARGV: 1 retention_ms, 2 key prefix (to find the holding worker's set of running requests)
-- Returns the state before the call ("queued", "running", or a final state, for which nothing changes),
-- or false when the request does not exist. Idempotent: cancelling twice is the same as once.
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'completion_tokens', 'prompt_tokens', 'worker')
if not f[1] then
  return false
end
local state = f[1]
if state ~= 'queued' and state ~= 'running' then
  return state
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if state == 'queued' then
  redis.call('DECR', KEYS[3])
elseif f[4] then
  redis.call('SREM', ARGV[2] .. 'wreqs:' .. f[4], req)
end
redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', now,
  'finished_ms', now)
redis.call('XADD', KEYS[2], f[2] .. '-2', 'd', 'cancelled', 'o', f[2], 'pt', f[3])
redis.call('PEXPIRE', req, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return state
