-- A worker's lease, for reaping (reap.lua runs per partition, in other slots): ARGV[3] "check" answers
-- whether it may be reaped; "drop" then forgets the worker (its lease and load) unless it renewed its
-- lease meanwhile (it came back: it keeps its lease and simply finds its requests taken away).
-- KEYS[1] workers lease zset (member = worker id, score = lease expiry ms), KEYS[2] workers load hash
-- ARGV: 1 worker id, 2 "self" when a draining worker hands its own requests back (lease ignored),
--   3 "check" | "drop"
-- Returns -1 when the lease is live (and ARGV[2] is not "self"), else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[2] ~= 'self' and expiry and tonumber(expiry) >= now then
  return -1
end
if ARGV[3] == 'drop' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 0
