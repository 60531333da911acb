-- Mark requests as having a client attached until at least now + ARGV[1] ms (the detach timeout), or
-- the request's own longer one (its 'detach_ms': a chat's params.detach_timeout_ms, submit.lua), for
-- every key that still exists (HSET alone would resurrect an expired request as a stray hash).
-- Only ever extends attached_until: a request given a longer deadline (a background HTTP response,
-- submitted with its unfinished TTL) keeps it when a WebSocket client resumes it with the usual 30 s.
-- Every request hash has a state (submit.lua), so one HMGET tells both whether it exists and its deadline:
-- 2 commands per request at most, not EXISTS + HGET + HSET (issue 28: the gateway touches every stream it
-- serves every few seconds, a cost per stream and second).
-- KEYS: request hashes. Returns how many were touched (existing ones, whether or not their deadline moved).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for _, req in ipairs(KEYS) do
  local f = redis.call('HMGET', req, 'state', 'attached_until', 'detach_ms')
  if f[1] then
    local deadline = now + math.max(tonumber(ARGV[1]), tonumber(f[3] or '0'))
    if tonumber(f[2] or '0') < deadline then
      redis.call('HSET', req, 'attached_until', deadline)
    end
    n = n + 1
  end
end
return n
