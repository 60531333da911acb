-- Re-queue the work one worker left in one partition, once its lease has lapsed (the caller checked it,
-- lease.lua; the lease lives in another slot) or when it hands its own work back: its running requests
-- (running -> queued, so a live worker continues each from its prompt plus the tokens already logged),
-- the entries of its affinity queue, and the queue entries it had read but not started. The worker can no
-- longer append (fenced by the worker id in append.lua). Atomic per partition: two reapers racing
-- re-queue each request once. Only unacknowledged work moves: start.lua deletes every entry it consumes,
-- so whatever is left in a queue is work not yet started, and the script's cost is bounded by that.
-- All keys are in one partition (one hash slot):
-- KEYS[1] the worker's held hash (token log -> tokens logged), KEYS[2] the work queue stream of the
--   worker's model, KEYS[3] its queued-requests counter, KEYS[4] the worker's own queue (requests routed
--   to it by session affinity, not yet started), KEYS[5..4+n] the request hashes of the n fields of
--   KEYS[1] as the caller read them (declared keys), then for each of them in that order the work queue
--   and queued counter of its model (a request goes back to its own model's queue; without them, KEYS[2]
--   and KEYS[3])
-- ARGV: 1 worker id, 2 consumer group, 3 n, then the n token logs (the fields), in the order of KEYS[5..]
-- Returns the number of running requests re-queued, or -2 (nothing changed) if KEYS[1] holds a request
-- the caller did not declare: it reads the hash and retries.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n_declared = tonumber(ARGV[3])
local declared = {}
for i = 1, n_declared do declared[ARGV[3 + i]] = i end
local held = redis.call('HGETALL', KEYS[1])
for i = 1, #held, 2 do
  if not declared[held[i]] then return -2 end
end
local n = 0
for i = 1, #held, 2 do
  local idx = declared[held[i]]
  local req = KEYS[4 + idx]
  local f = redis.call('HMGET', req, 'state', 'worker')
  if f[1] == 'running' and f[2] == ARGV[1] then
    redis.call('HSET', req, 'state', 'queued', 'worker', '', 'updated_ms', now,
      'completion_tokens', held[i + 1])
    redis.call('HINCRBY', req, 'requeues', 1)
    local j = 4 + n_declared + 2 * idx
    local queue, counter = KEYS[j - 1] or KEYS[2], KEYS[j] or KEYS[3]
    redis.call('INCR', counter)
    redis.call('XADD', queue, '*', 'req', req)
    n = n + 1
  end
end
-- Its affinity queue: whatever was routed to it and not started moves to the shared queue. Deleting it
-- (below) also stops submit.lua from routing more work there (it queues only to an existing one).
for _, e in ipairs(redis.call('XRANGE', KEYS[4], '-', '+')) do
  redis.call('XADD', KEYS[2], '*', 'req', e[2][2])
end
-- Queue entries delivered to it but never started (it died between reading and starting them): without
-- this they would stay pending to a consumer that is gone, and their requests queued forever.
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[2], ARGV[2], '-', '+', 100000, ARGV[1])
if ok then
  for _, p in ipairs(pending) do
    local e = redis.call('XRANGE', KEYS[2], p[1], p[1])
    if e[1] then
      redis.call('XADD', KEYS[2], '*', 'req', e[1][2][2])
    end
    redis.call('XACK', KEYS[2], ARGV[2], p[1])
    redis.call('XDEL', KEYS[2], p[1])
  end
  -- Consumers are kept in the group until deleted: one per worker name ever seen would grow forever.
  redis.call('XGROUP', 'DELCONSUMER', KEYS[2], ARGV[2], ARGV[1])
end
redis.call('DEL', KEYS[1], KEYS[4])
return n
