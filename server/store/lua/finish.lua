-- End a running request: running -> done | failed, write the log's end entry, extend retention, and on a
-- normal end of a session turn append the user message and the reply to the session history.
-- KEYS[1] request hash, KEYS[2] token log stream, KEYS[3] session history list, KEYS[4] the worker's held
--   hash in this partition (log -> tokens logged), KEYS[5] the session hash (all in the owner's partition:
--   one hash slot)
-- ARGV: 1 worker id, 2 finish reason (stop|length|error), 3 prompt tokens, 4 reply text,
--       5 retention_ms, 6 error code ("" if none), 7 error message, 8 history max messages, 9 session ttl_ms,
--       10 the tombstone's ttl_ms, 11 the payload a tombstone keeps (JSON, without the prompt; "" when the
--       caller saw tokens generated), 12 history max bytes (history.lua's append_turn), 13 cached prompt
--       tokens (of ARGV[3], those the engine reused; written only when not 0, to keep the end entry short),
--       14 why a "length" ended (max_tokens|context, done.length_reason; "" writes none)
-- A request that fails with no token logged (refused: too_large, overloaded, ...) and ARGV[11] given is
-- kept as a tombstone only: what a retry needs (state, error, fingerprint, owner, the slim payload, the
-- log's end entry), both expiring after ARGV[10]; the prompt, the user message and the cache key go now.
-- A refused chat then costs Redis a few hundred bytes for minutes, not its size for the retention.
-- A request that carries a response-cache key and ends normally returns the cache entry (JSON) instead
-- of 1: the caller writes it with a separate SET, since a shared cache entry lives in another slot. A crash
-- between the two loses only that cache entry (a later identical chat is generated again), never the
-- request, its log or its history, which this transition writes.
-- Returns 1 (also for a retry of this worker's own finish), the cache entry, or 0 when the request is not
-- running for this worker (then nothing changes).
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'worker', 'completion_tokens', 'user_msg', 'cache_key')
if f[2] == ARGV[1] and (f[1] == 'done' or f[1] == 'failed') then
  return 1  -- a retry of this worker's own finish whose reply was lost: already done
end
if f[1] ~= 'running' or f[2] ~= ARGV[1] then
  return 0
end
local logged = redis.call('HGET', KEYS[4], KEYS[2])
if not logged then
  return 0  -- not held any more (a transition took it: the fence step.lua uses)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local total = tonumber(logged)
local reason = ARGV[2]
local state = 'done'
if reason == 'error' then state = 'failed' end
local cached = tonumber(ARGV[13] or '0') or 0
redis.call('HSET', req, 'state', state, 'finish_reason', reason, 'prompt_tokens', ARGV[3],
  'updated_ms', now, 'finished_ms', now, 'error_code', ARGV[6], 'completion_tokens', total,
  'cached_tokens', cached)
local entry = {'d', reason, 'o', total, 'pt', ARGV[3]}
if cached > 0 then
  table.insert(entry, 'ct'); table.insert(entry, cached)
end
local why = ARGV[14] or ''
if why ~= '' then
  table.insert(entry, 'lr'); table.insert(entry, why)
end
if ARGV[6] ~= '' then
  table.insert(entry, 'e'); table.insert(entry, ARGV[6])
  table.insert(entry, 'm'); table.insert(entry, ARGV[7])
end
redis.call('XADD', KEYS[2], total .. '-2', unpack(entry))
redis.call('HDEL', KEYS[4], KEYS[2])
if state == 'failed' and total == 0 and (ARGV[11] or '') ~= '' then
  redis.call('HSET', req, 'payload', ARGV[11], 'tombstone', 1)
  redis.call('HDEL', req, 'user_msg', 'cache_key')
  redis.call('PEXPIRE', req, ARGV[10])
  redis.call('PEXPIRE', KEYS[2], ARGV[10])
  return 1
end
redis.call('PEXPIRE', req, ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
local cache = nil
if state == 'done' and f[5] and f[5] ~= '' then
  local entries = {}
  for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
    local kv = {}
    for i = 1, #e[2], 2 do kv[e[2][i]] = e[2][i + 1] end
    if kv['n'] then
      table.insert(entries, {tonumber(kv['o']), tonumber(kv['n']), kv['t'], kv['k'] or ''})
    end
  end
  cache = cjson.encode({e = entries, d = reason, pt = tonumber(ARGV[3]), lr = why})
end
if state == 'done' and f[4] and f[4] ~= '' then
  append_turn(KEYS[3], KEYS[5], f[4], cjson.encode({role = 'assistant', content = ARGV[4]}),
    tonumber(ARGV[8]), tonumber(ARGV[12]), ARGV[9])
end
return cache or 1
