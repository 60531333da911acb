-- Included (prepended) by the scripts that end a session turn: finish.lua and submit.lua (a cached reply).
-- append_turn adds one turn (the user message and the reply) to a session's history, then drops the
-- oldest turns while the history holds more than max_msgs messages or max_bytes bytes. The newest turn
-- always stays, so a session costs at most max_bytes plus one turn. The history's size in bytes is kept in
-- the session hash (field hist_bytes, same partition) so that trimming costs the turns dropped, not a read
-- of the whole list; a history without that field (written before it existed) is measured once.
local function append_turn(hist, sess, user_msg, reply, max_msgs, max_bytes, ttl)
  local bytes = tonumber(redis.call('HGET', sess, 'hist_bytes') or '')
  local n = redis.call('RPUSH', hist, user_msg, reply)  -- the length after: no LLEN
  if not bytes then
    -- Measured once: nothing before this turn (a new session: no read at all), or a history older than
    -- the field.
    bytes = 0
    if n > 2 then
      for _, m in ipairs(redis.call('LRANGE', hist, 0, n - 3)) do bytes = bytes + #m end
    end
  end
  bytes = bytes + #user_msg + #reply
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
