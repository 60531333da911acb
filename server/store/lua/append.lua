-- Append one delta to a running request's token log, fenced by the worker id and the offset.
-- KEYS[1] request hash, KEYS[2] token log stream
-- ARGV: 1 worker id, 2 offset, 3 n tokens, 4 text, 5 prompt tokens (recorded for usage on cancel)
-- The stream entry id is "<offset>-1", so XRANGE/XREAD from "<offset>-0" start exactly at that offset and a
-- second write of the same offset is impossible.
-- Returns 1 on success, 0 when the request is no longer running for this worker (cancelled, taken over):
-- the worker must stop generating it; -1 when the offset is not the log's end (a bug in the caller).
local req = KEYS[1]
local f = redis.call('HMGET', req, 'state', 'worker', 'completion_tokens')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then
  return 0
end
local offset = tonumber(ARGV[2])
if tonumber(f[3]) ~= offset then
  return -1
end
local n = tonumber(ARGV[3])
redis.call('XADD', KEYS[2], offset .. '-1', 'o', offset, 'n', n, 't', ARGV[4])
redis.call('HSET', req, 'completion_tokens', offset + n, 'prompt_tokens', ARGV[5])
return 1
