-- Renew a worker's lease: its expiry (Redis clock) in the workers zset. Returns the dead workers, i.e.
-- those whose lease expired, for the caller to reap.
-- KEYS[1] workers lease zset. ARGV: 1 worker id, 2 lease ttl ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
