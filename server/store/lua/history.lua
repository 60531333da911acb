-- Included (prepended) by the scripts that end a session turn: finish.lua and submit.lua (a cached reply).
-- append_turn adds one turn (the user message and the reply) to a session's history, then drops the
-- oldest turns while the history holds more than max_msgs messages or max_bytes bytes. The newest turn
-- always stays, so a session costs at most max_bytes plus one turn. The history's size in bytes is kept in
-- the session hash (field hist_bytes, same partition) so that trimming costs the turns dropped, not a read
-- of the whole list; a history without that field (written before it existed) is measured once.
local function append_turn(hist, sess, user_msg, reply, max_msgs, max_bytes, ttl)
  local bytes = tonumber(redis.call('HGET', sess, 'hist_bytes') or '')
  if not bytes then
    bytes = 0
    for _, m in ipairs(redis.call('LRANGE', hist, 0, -1)) do bytes = bytes + #m end
  end
  redis.call('RPUSH', hist, user_msg, reply)
  bytes = bytes + #user_msg + #reply
  local n = redis.call('LLEN', hist)
  while n > 2 and (n > max_msgs or bytes > max_bytes) do
    for _, m in ipairs(redis.call('LPOP', hist, 2)) do
      bytes = bytes - #m
      n = n - 1
    end
  end
  redis.call('HSET', sess, 'hist_bytes', bytes)
  redis.call('PEXPIRE', hist, ttl)
  redis.call('PEXPIRE', sess, ttl)
end
