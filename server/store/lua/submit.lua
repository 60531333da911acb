-- Create a request, or attach to the one with the same id (idempotent retry), atomically.
-- KEYS[1] request hash, KEYS[2] shared work queue stream, KEYS[3] queued-requests counter,
-- KEYS[4] the preferred worker's own queue (session affinity; "" for none), KEYS[5] workers lease zset,
-- KEYS[6] token log stream, KEYS[7] response-cache entry ("" when the request is not cacheable),
-- KEYS[8] session history list, KEYS[9] the owner's in-flight set ("" when there is no per-user limit),
-- KEYS[10] the session hash (content-mode turns: its "turn" field names the session's latest turn),
-- KEYS[11..] the members of KEYS[9] as the caller read them (declared, so this script may read them)
-- ARGV: 1 owner, 2 id, 3 fingerprint, 4 payload (JSON), 5 session, 6 user message (JSON or ""),
--       7 ttl_ms (a bound on how long an unfinished request may linger), 8 max_queued (0 = unbounded),
--       9 detach_timeout_ms, 10 preferred worker id ("" for none), 11 retention_ms,
--       12 history max messages, 13 session ttl_ms, 14 max requests in flight per owner (0 = unbounded),
--       15 "1" for a content-mode turn, 16 the id of the session's latest turn the caller waited for ("" none),
--       17 the model that serves it, 18 its route ("" for the default model; KEYS[2] and KEYS[3] are that
--       model's queue and counter, and reap.lua re-queues the request to them)
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
    -- A retry is also a sign of life: the client is attached again.
    redis.call('HSET', req, 'attached_until', now + tonumber(ARGV[9]))
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
if KEYS[7] ~= '' then
  local cached = redis.call('GET', KEYS[7])
  if cached then
    local c = cjson.decode(cached)
    local total = 0
    local reply = {}
    for _, e in ipairs(c.e) do
      redis.call('XADD', KEYS[6], e[1] .. '-1', 'o', e[1], 'n', e[2], 't', e[3], 'k', e[4], 'w', 'cache')
      total = e[1] + e[2]
      table.insert(reply, e[3])
    end
    redis.call('XADD', KEYS[6], total .. '-2', 'd', c.d, 'o', total, 'pt', c.pt)
    redis.call('HSET', req,
      'owner', ARGV[1], 'id', ARGV[2], 'fp', ARGV[3], 'payload', ARGV[4],
      'epoch', 1, 'state', 'done', 'finish_reason', c.d, 'created_ms', now, 'updated_ms', now,
      'finished_ms', now, 'session', ARGV[5], 'user_msg', ARGV[6], 'completion_tokens', total,
      'prompt_tokens', c.pt, 'cached', 1, 'model', ARGV[17] or '', 'route', ARGV[18] or '')
    redis.call('PEXPIRE', req, ARGV[11])
    redis.call('PEXPIRE', KEYS[6], ARGV[11])
    if ARGV[6] ~= '' then
      redis.call('RPUSH', KEYS[8], ARGV[6], cjson.encode({role = 'assistant', content = table.concat(reply)}))
      redis.call('LTRIM', KEYS[8], -tonumber(ARGV[12]), -1)
      redis.call('PEXPIRE', KEYS[8], ARGV[13])
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
local queued = tonumber(redis.call('GET', KEYS[3]) or '0')
if max_queued > 0 and queued >= max_queued then
  return {'overloaded', queued, ''}
end
redis.call('HSET', req,
  'owner', ARGV[1], 'id', ARGV[2], 'fp', ARGV[3], 'payload', ARGV[4],
  'epoch', 1, 'state', 'queued', 'created_ms', now, 'updated_ms', now,
  'session', ARGV[5], 'user_msg', ARGV[6], 'completion_tokens', 0, 'prompt_tokens', 0,
  'attached_until', now + tonumber(ARGV[9]), 'cache_key', KEYS[7],
  'model', ARGV[17] or '', 'route', ARGV[18] or '')
redis.call('PEXPIRE', req, ARGV[7])
redis.call('INCR', KEYS[3])
if max_inflight > 0 then
  redis.call('SADD', KEYS[9], req)
  redis.call('PEXPIRE', KEYS[9], ARGV[7])
end
-- The preferred worker's queue only while its lease is live: reap.lua removes the lease and drains that
-- queue in one step, so nothing can be left behind in the queue of a dead worker.
local queue = KEYS[2]
if KEYS[4] ~= '' then
  local expiry = redis.call('ZSCORE', KEYS[5], ARGV[10])
  if expiry and tonumber(expiry) >= now then
    queue = KEYS[4]
  end
end
redis.call('XADD', queue, '*', 'req', req)
record_turn()
return {'new', 1, 'queued'}
