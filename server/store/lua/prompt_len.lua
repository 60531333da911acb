-- Shared by cancel.lua, detach.lua and start.lua (prepended: requests._load_script).
-- The prompt's length for a cancelled request's end. The request hash holds 0 until finish.lua writes it;
-- while the request runs, its log's first entry carries it (step.lua, 'p'); before that entry, 0: no
-- token was generated from it yet. pt: the hash's prompt_tokens (nil or '0' when not written yet).
local function prompt_len(log, pt)
  if pt and pt ~= '0' then return pt end
  local x = redis.call('XRANGE', log, '0-1', '0-1')[1]
  if x then
    for j = 1, #x[2], 2 do
      if x[2][j] == 'p' then return x[2][j + 1] end
    end
  end
  return 0
end
