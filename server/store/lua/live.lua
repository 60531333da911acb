-- The workers whose leases are live and their loads, read in one step on the Redis clock.
-- KEYS[1] workers lease zset, KEYS[2] workers load hash. Returns {worker, load, worker, load, ...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  table.insert(out, w)
  table.insert(out, redis.call('HGET', KEYS[2], w) or '0/0')
end
return out
