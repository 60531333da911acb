-- Re-queue the work of a worker whose lease lapsed: its running requests (running -> queued, so a live
-- worker continues each from its prompt plus the tokens already logged), the entries of its affinity
-- queue, and the shared-queue entries it had read but not started. The dead worker can no longer append
-- (fenced by the worker id in append.lua). Atomic per dead worker: two reapers racing re-queue each
-- request once. Only unacknowledged work moves: start.lua deletes every entry it consumes, so whatever
-- is left in a queue is work not yet started, and the script's cost is bounded by that, not by history.
-- KEYS[1] workers lease zset (member = worker id, score = lease expiry ms), KEYS[2] the dead worker's
--   set of running requests, KEYS[3] shared work queue stream, KEYS[4] queued-requests counter,
--   KEYS[5] the dead worker's own queue (requests routed to it by session affinity, not yet started),
--   KEYS[6] workers load hash, KEYS[7..6+n] the n members of KEYS[2] as the caller read them (declared
--   keys), then for each member in that order the work queue and queued counter of its model (a request
--   goes back to its own model's queue; without them, KEYS[3] and KEYS[4])
-- ARGV: 1 dead worker id, 2 "self" when a draining worker hands its own requests back (lease ignored),
--   3 consumer group, 4 n (absent: every key from KEYS[7] is a member)
-- Returns the number of running requests re-queued, -1 if the worker's lease is in fact live, or -2
-- (nothing changed) if KEYS[2] holds a request the caller did not declare: it reads the set and retries.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[2] ~= 'self' and expiry and tonumber(expiry) >= now then
  return -1
end
local n_declared = tonumber(ARGV[4] or (#KEYS - 6))
local declared = {}
for i = 7, 6 + n_declared do declared[KEYS[i]] = i - 6 end
local members = redis.call('SMEMBERS', KEYS[2])
for _, req in ipairs(members) do
  if not declared[req] then return -2 end
end
local n = 0
for _, req in ipairs(members) do
  local f = redis.call('HMGET', req, 'state', 'worker')
  if f[1] == 'running' and f[2] == ARGV[1] then
    redis.call('HSET', req, 'state', 'queued', 'worker', '', 'updated_ms', now)
    redis.call('HINCRBY', req, 'requeues', 1)
    local j = 6 + n_declared + 2 * declared[req]
    local queue, counter = KEYS[j - 1] or KEYS[3], KEYS[j] or KEYS[4]
    redis.call('INCR', counter)
    redis.call('XADD', queue, '*', 'req', req)
    n = n + 1
  end
end
-- Its affinity queue: whatever was routed to it and not started moves to the shared queue.
for _, e in ipairs(redis.call('XRANGE', KEYS[5], '-', '+')) do
  redis.call('XADD', KEYS[3], '*', 'req', e[2][2])
end
-- Shared-queue entries delivered to it but never started (it died between reading and starting them):
-- without this they would stay pending to a consumer that is gone, and their requests queued forever.
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[3], ARGV[3], '-', '+', 100000, ARGV[1])
if ok then
  for _, p in ipairs(pending) do
    local e = redis.call('XRANGE', KEYS[3], p[1], p[1])
    if e[1] then
      redis.call('XADD', KEYS[3], '*', 'req', e[1][2][2])
    end
    redis.call('XACK', KEYS[3], ARGV[3], p[1])
    redis.call('XDEL', KEYS[3], p[1])
  end
  -- Consumers are kept in the group until deleted: one per worker name ever seen would grow forever.
  redis.call('XGROUP', 'DELCONSUMER', KEYS[3], ARGV[3], ARGV[1])
end
redis.call('DEL', KEYS[2], KEYS[5])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
return n
