-- Mark requests as having a client attached until now + ARGV[1] ms (the detach timeout), for every key
-- that still exists (HSET alone would resurrect an expired request as a stray hash).
-- KEYS: request hashes. Returns how many were touched.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for _, req in ipairs(KEYS) do
  if redis.call('EXISTS', req) == 1 then
    redis.call('HSET', req, 'attached_until', now + tonumber(ARGV[1]))
    n = n + 1
  end
end
return n
