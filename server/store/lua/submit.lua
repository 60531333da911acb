-- Create a request, or attach to the one with the same id (idempotent retry), atomically.
-- Every key is in the owner's partition (one hash slot: keys.py); a key not needed is passed as KEYS[1].
-- KEYS[1] request hash, KEYS[2] the partition's work queue stream, KEYS[3] its queued-requests counter,
-- KEYS[4] the preferred worker's own queue in this partition (session affinity; ARGV[10] says whether
-- there is one), KEYS[5] unused (KEYS[1]), KEYS[6] token log stream, KEYS[7] unused (KEYS[1]),
-- KEYS[8] session history list, KEYS[9] the owner's in-flight set (used when ARGV[14] > 0),
-- KEYS[10] the session hash (content-mode turns: its "turn" field names the session's latest turn),
-- KEYS[11..] the members of KEYS[9] as the caller read them (declared, so this script may read them)
-- ARGV: 1 owner, 2 id, 3 fingerprint, 4 payload (JSON), 5 session, 6 user message (JSON or ""),
--       7 ttl_ms (a bound on how long an unfinished request may linger), 8 max_queued (0 = unbounded),
--       9 detach_timeout_ms, 10 preferred worker id ("" for none), 11 retention_ms,
--       12 history max messages, 13 session ttl_ms, 14 max requests in flight per owner (0 = unbounded),
--       15 "1" for a content-mode turn, 16 the id of the session's latest turn the caller waited for ("" none),
--       17 requests queued in the other partitions (as the caller read them just before: the queue limit
--       is global, its other partitions live in other slots), 18 the response-cache entry the caller read
--       ("" for none: not cacheable, or a miss), 19 the response-cache key this request's log is cached
--       under when it ends normally ("" when not cacheable), 20 the model that serves it, 21 its route
--       ("" for the default model; KEYS[2] and KEYS[3] are that model's queue and counter in this
--       partition, and reap.lua re-queues the request to them), 22 history max bytes (history.lua),
--       23 "1" when ARGV[9] is the request's own detach timeout, which touch.lua then extends it by
-- Returns {"attach", epoch, state} | {"conflict", 0, state} | {"overloaded", queued, ""} | {"new", 1, "queued"}
--       | {"user_limit", in_flight, ""} (the owner already has that many queued or running; nothing written)
--       | {"cached", 1, "done"} (answered from the response cache: the log is written, no worker runs)
--       | {"turn_moved", 0, ""} (a content turn: another turn of the session was accepted since the caller
--         read ARGV[16]; nothing written: wait for that one and read the history again)
local req = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local existing = redis.call('HMGET', req, 'fp', 'epoch', 'state')
if existing[1] then
  if existing[1] == ARGV[3] then
    -- A retry is also a sign of life: the client is attached again. Only ever extended (as touch.lua):
    -- a background response's long deadline survives a retry that carries the usual detach timeout.
    local deadline = now + tonumber(ARGV[9])
    if tonumber(redis.call('HGET', req, 'attached_until') or '0') < deadline then
      redis.call('HSET', req, 'attached_until', deadline)
    end
    return {'attach', tonumber(existing[2]), existing[3]}
  end
  return {'conflict', 0, existing[3]}
end
-- Content-mode turns of a session are accepted one after another: each names the turn it waited for.
-- (The new turn is recorded where the request is created, below: a refused request is no turn.)
local function record_turn()
  if ARGV[15] == '1' then
    redis.call('HSET', KEYS[10], 'turn', ARGV[2])
    redis.call('PEXPIRE', KEYS[10], ARGV[13])
  end
end
if ARGV[15] == '1' and (redis.call('HGET', KEYS[10], 'turn') or '') ~= ARGV[16] then
  return {'turn_moved', 0, ''}
end
-- A deterministic request seen recently: write its cached log and finish it here. Checked before the
-- queue limit, so cached answers are still served under overload.
if ARGV[18] ~= '' then
  do
    local c = cjson.decode(ARGV[18])
    local total = 0
    local reply = {}
    for _, e in ipairs(c.e) do
      redis.call('XADD', KEYS[6], e[1] .. '-1', 'o', e[1], 'n', e[2], 't', e[3], 'k', e[4], 'w', 'cache')
      total = e[1] + e[2]
      table.insert(reply, e[3])
    end
    -- Nothing was computed for this answer: every prompt token counts as cached (usage.cached_tokens).
    -- 'lr' (why a length ended) came with cache entries from the revision that added it.
    if type(c.lr) == 'string' and c.lr ~= '' then
      redis.call('XADD', KEYS[6], total .. '-2', 'd', c.d, 'o', total, 'pt', c.pt, 'ct', c.pt, 'lr', c.lr)
    else
      redis.call('XADD', KEYS[6], total .. '-2', 'd', c.d, 'o', total, 'pt', c.pt, 'ct', c.pt)
    end
    redis.call('HSET', req,
      'owner', ARGV[1], 'id', ARGV[2], 'fp', ARGV[3], 'payload', ARGV[4],
      'epoch', 1, 'state', 'done', 'finish_reason', c.d, 'created_ms', now, 'updated_ms', now,
      'finished_ms', now, 'session', ARGV[5], 'user_msg', ARGV[6], 'completion_tokens', total,
      'prompt_tokens', c.pt, 'cached_tokens', c.pt, 'cached', 1, 'model', ARGV[20] or '',
      'route', ARGV[21] or '')
    redis.call('PEXPIRE', req, ARGV[11])
    redis.call('PEXPIRE', KEYS[6], ARGV[11])
    if ARGV[6] ~= '' then
      append_turn(KEYS[8], KEYS[10], ARGV[6], cjson.encode({role = 'assistant', content = table.concat(reply)}),
        tonumber(ARGV[12]), tonumber(ARGV[22]), ARGV[13])
    end
    record_turn()
    return {'cached', 1, 'done'}
  end
end
local max_inflight = tonumber(ARGV[14])
if max_inflight > 0 then
  -- Forget the owner's requests that have ended (or expired) before counting. No other script keeps this
  -- set: however a request ends (done, failed, cancelled, detached, reaped and finished elsewhere), it is
  -- simply found ended here, so the count cannot drift. The set never holds more than the limit. Only
  -- the members the caller declared are read; one added since it read the set counts as in flight.
  local members = {}
  for _, r in ipairs(redis.call('SMEMBERS', KEYS[9])) do members[r] = true end
  for i = 11, #KEYS do
    local r = KEYS[i]
    if members[r] then
      local s = redis.call('HGET', r, 'state')
      if s ~= 'queued' and s ~= 'running' then
        redis.call('SREM', KEYS[9], r)
      end
    end
  end
  local n = redis.call('SCARD', KEYS[9])
  if n >= max_inflight then
    return {'user_limit', n, ''}
  end
end
local max_queued = tonumber(ARGV[8])
local queued = tonumber(redis.call('GET', KEYS[3]) or '0') + tonumber(ARGV[17])
if max_queued > 0 and queued >= max_queued then
  return {'overloaded', queued, ''}
end
redis.call('HSET', req,
  'owner', ARGV[1], 'id', ARGV[2], 'fp', ARGV[3], 'payload', ARGV[4],
  'epoch', 1, 'state', 'queued', 'created_ms', now, 'updated_ms', now,
  'session', ARGV[5], 'user_msg', ARGV[6], 'completion_tokens', 0, 'prompt_tokens', 0,
  'attached_until', now + tonumber(ARGV[9]), 'cache_key', ARGV[19],
  'model', ARGV[20] or '', 'route', ARGV[21] or '')
if ARGV[23] == '1' then
  redis.call('HSET', req, 'detach_ms', ARGV[9])
end
redis.call('PEXPIRE', req, ARGV[7])
redis.call('INCR', KEYS[3])
if max_inflight > 0 then
  redis.call('SADD', KEYS[9], req)
  redis.call('PEXPIRE', KEYS[9], ARGV[7])
end
-- The preferred worker's queue only while it exists: the worker creates it (with its consumer group)
-- when it starts, and reap.lua drains and deletes it in one step when the worker's lease has lapsed, so
-- nothing can be left behind in the queue of a reaped worker. (The lease itself lives in another slot;
-- the caller prefers only workers it saw live.)
local queue = KEYS[2]
if ARGV[10] ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then
  queue = KEYS[4]
end
redis.call('XADD', queue, '*', 'req', req)
record_turn()
return {'new', 1, 'queued'}
