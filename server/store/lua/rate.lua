-- Count one action in an owner's fixed rate window, shared by every gateway (RequestStore.rate).
-- KEYS[1] the counter (keys.py: rate:<kind>:<owner>, in the owner's partition)
-- ARGV: 1 the limit per window, 2 the window in ms
-- Returns 0 while within the limit, else the ms until the window ends (at least 1).
-- Two commands in the common case (the call and INCR; PEXPIRE once per window) where a MULTI of INCR,
-- PEXPIRE NX and PTTL cost five. A counter is never left without an expiry: the first count of a window
-- sets it, and a refusal that finds none (a key written some other way) sets it then.
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if n <= tonumber(ARGV[1]) then
  return 0
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  ttl = tonumber(ARGV[2])
end
return math.max(1, ttl)
