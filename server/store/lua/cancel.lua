-- Cancel a request that has not ended: -> cancelled, and end its log so every attached reader gets done.
-- KEYS[1] request hash, KEYS[2] token log stream, KEYS[3] queued-requests counter, KEYS[4] the held hash
--   of the worker the caller saw holding it (any key of the partition when it saw none; all keys are in
--   the request's partition: one hash slot). A running request's tokens logged are its value there.
-- ARGV: 1 retention_ms, 2 the worker id the caller saw in the request ("" for none), 3 "detach": cancel
--   only a queued request that no client has been attached to for its detach timeout, as start.lua would
--   when a worker reached it, and say so in its end ('c' detach_timeout); any other request is left as
--   it is (submit's count of an owner's requests in flight, requests.py)
-- Returns the state before the call ("queued", "running", or a final state, for which nothing changes),
-- false when the request does not exist, or "moved" (nothing changed) when another worker holds it now
-- than the caller saw: the caller reads the holder again and retries, so every key is declared.
-- Idempotent: cancelling twice is the same as once.
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'completion_tokens', 'prompt_tokens', 'worker', 'attached_until')
if not f[1] then
  return false
end
local state = f[1]
if state ~= 'queued' and state ~= 'running' then
  return state
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local detach = ARGV[3] == 'detach'
if detach and (state ~= 'queued' or tonumber(f[5] or '0') >= now) then
  return state
end
if state == 'running' and (f[4] or '') ~= ARGV[2] then
  return 'moved'
end
local total = f[2]
if state == 'queued' then
  redis.call('DECR', KEYS[3])
else
  total = redis.call('HGET', KEYS[4], KEYS[2]) or total
  redis.call('HDEL', KEYS[4], KEYS[2])
end
local pt = prompt_len(KEYS[2], f[3])
redis.call('HSET', req, 'state', 'cancelled', 'finish_reason', 'cancelled', 'updated_ms', now,
  'finished_ms', now, 'completion_tokens', total, 'prompt_tokens', pt)
local done = {'d', 'cancelled', 'o', total, 'pt', pt}
if detach then
  done[#done + 1], done[#done + 2] = 'c', 'detach_timeout'
end
redis.call('XADD', KEYS[2], total .. '-2', unpack(done))
redis.call('PEXPIRE', req, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return state
