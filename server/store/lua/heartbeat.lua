-- Renew a worker's lease: its expiry (Redis clock) in the workers zset, and its load for routing.
-- Returns the dead workers, i.e. those whose lease expired, for the caller to reap.
-- KEYS[1] workers lease zset, KEYS[2] workers load hash. ARGV: 1 worker id, 2 lease ttl ms,
-- 3 requests running, 4 requests it can run at once
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. '/' .. ARGV[4])
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
