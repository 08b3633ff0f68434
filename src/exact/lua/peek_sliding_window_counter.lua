-- KEYS[1] = base key; ARGV = cost, limit, window_us. Read only: what
-- sliding_window_counter.lua would answer now, writing nothing (`explain`).
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local idx = math.floor(now / window)
local elapsed = now - idx * window
local cur = tonumber(redis.call('GET', KEYS[1] .. ':swc:' .. id(idx)) or '0')
local prev = tonumber(redis.call('GET', KEYS[1] .. ':swc:' .. id(idx - 1)) or '0')
if cost > limit then return {0, 0, -1, window - elapsed} end
local used = prev * (window - elapsed) / window + cur
if used + cost > limit then
  local retry = nil
  local room = limit - cur - cost
  if room >= 0 and prev > 0 then
    local e = math.ceil(window - room * window / prev)
    if e > elapsed and e < window then retry = e - elapsed end
  end
  if retry == nil then
    local e = 0
    if cur > 0 then e = math.max(0, math.ceil(window - (limit - cost) * window / cur)) end
    retry = window - elapsed + e
  end
  return {0, math.max(0, math.floor(limit - used)), retry, retry}
end
return {1, math.floor(limit - used - cost), 0, window - elapsed}
